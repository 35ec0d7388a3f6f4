"""Per-kernel time on one chip: compute and DRAM traffic (DESIGN.md section 4).

Every compute and memory formula of the project lives here, once.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from dfmodel.graph.fp8 import RECIPES, recipe_cost
from dfmodel.graph.kernel import Kernel, KernelKind, Phase
from dfmodel.system.schema import Chip, Precision, System


def padding_factor(kernel: Kernel, tile: tuple[int, int, int]) -> float:
    """Work inflation of a matmul whose m, n, k are padded up to multiples of ``tile``.

    >>> from dfmodel.graph.kernel import Kernel, KernelKind
    >>> k = Kernel("g", KernelKind.matmul, {"m": 100, "n": 128, "k": 64}, flop=0, output_bytes=1)
    >>> padding_factor(k, (128, 128, 64))
    1.28
    """
    factor = 1.0
    for dim, t in zip(("m", "n", "k"), tile):
        size = kernel.dims.get(dim)
        if size:
            factor *= math.ceil(size / t) * t / size
    return factor


def achieved_rate_Fps(chip: Chip, kernel: Kernel, precision: Precision | str) -> float:
    """Achieved FLOP/s of ``kernel`` on the whole chip (before tile padding).

    The kernel's own precision (``kernel.precision``, e.g. an FP8 GEMM of a bf16-stored
    Transformer Engine layer) overrides the workload's. Matmuls run on the matrix units at
    ``peak(p) * efficiency.matmul_at(p)``; a fused attention kernel (``efficiency="attention"``)
    at ``peak(p) * efficiency.attention``; every other kind on the vector units at
    ``vector_flops(p) * efficiency.vector``.
    """
    p = kernel.precision or precision
    eff = chip.efficiency
    if kernel.kind.is_matrix:
        factor = eff.attention_at(p) if kernel.efficiency == "attention" else eff.matmul_at(p)
        return chip.peak(p) * factor
    return chip.vector_peak(p) * eff.vector


def compute_time_s(chip: Chip, kernel: Kernel, precision: Precision | str) -> float:
    """Time for ``kernel``'s arithmetic on the whole chip: ``FLOP / achieved rate``
    (:func:`mainloop_time_s`), plus, on a chip whose GEMM epilogue is serial, the epilogue that
    follows each tile's mainloop (:func:`gemm_epilogue_exposed_s`): the GEMM kernel's own time,
    so every pass that times a kernel (intra-chip, sharding, the search's floors, the other
    families) charges it alike. Communication kernels do no arithmetic here.
    """
    mainloop_s = mainloop_time_s(chip, kernel, precision)
    return mainloop_s + _serial_epilogue_s(chip, kernel, mainloop_s, precision)


def mainloop_time_s(chip: Chip, kernel: Kernel, precision: Precision | str) -> float:
    """``FLOP / achieved rate`` of ``kernel`` on the whole chip; matmuls padded to
    ``efficiency.matmul_tile`` first (see :func:`achieved_rate_Fps` for the rates)."""
    if kernel.kind == KernelKind.comm or kernel.flop == 0:
        return 0.0
    rate = achieved_rate_Fps(chip, kernel, precision)
    if kernel.kind.is_matrix:
        return kernel.flop * padding_factor(kernel, chip.efficiency.matmul_tile) / rate
    return kernel.flop / rate


def memory_time_s(chip: Chip, num_bytes: float) -> float:
    """Time to move ``num_bytes`` between DRAM and the chip at the achieved bandwidth."""
    return num_bytes / (chip.memory.bandwidth_Bps * chip.efficiency.memory)


def gemm_epilogue_bytes(kernel: Kernel) -> float:
    """DRAM bytes of a GEMM's epilogue: its output D written, and for a weight-gradient GEMM the
    main-gradient C it accumulates into read first (Megatron-LM's gradient-accumulation fusion:
    the wgrad GEMM runs with beta = 1 on ``param.main_grad``, TE ``accumulate=True``; the graph
    charges that read as the kernel's ``weight_bytes``). 0 for anything but a matrix kernel, and
    for a fused attention kernel, whose own efficiency factor covers its output.

    >>> k = Kernel("wgrad.fc1", KernelKind.matmul, {"m": 8, "n": 8, "k": 4}, flop=512, output_bytes=256,
    ...            weight_bytes=256, phase=Phase.weight_grad)
    >>> gemm_epilogue_bytes(k), gemm_epilogue_bytes(Kernel("fc1", KernelKind.matmul, {}, flop=512,
    ...     output_bytes=128, weight_bytes=64))
    (512, 128.0)
    """
    if not kernel.kind.is_matrix or kernel.efficiency == "attention":
        return 0.0
    return kernel.output_bytes + (kernel.weight_bytes if kernel.phase == Phase.weight_grad else 0.0)


def gemm_epilogue_exposed_s(chip: Chip, kernel: Kernel, precision: Precision | str) -> float:
    """Time a GEMM's epilogue adds to its mainloop on a chip whose ``gemm_epilogue`` is "serial":
    ``min(mainloop, epilogue bytes / bandwidth)``, so the kernel's compute time is its mainloop
    plus its epilogue (:func:`compute_time_s`; its operand loads are hidden under the math, and
    a memory-bound GEMM's roofline already counts the epilogue's bytes); 0 where the epilogue
    overlaps the next tile's MMAs.

    On Hopper a GEMM tile's accumulators live in the registers of the warp groups that computed
    them (wgmma), so a tile's epilogue -- load C, add, store D -- runs after its mainloop, on the
    same warps, while the tensor cores idle; CUTLASS's sm90 "cooperative" persistent kernel has
    both consumer warp groups on one tile and does not overlap them (only the "ping-pong" schedule
    overlaps one warp group's epilogue with the other's mainloop: Wright & Hoque, 'Deep Dive on
    CUTLASS Ping-Pong GEMM Kernel', PyTorch blog 2024; Triton's Gluon persistent-matmul tutorial:
    "especially for small K ... overlap the epilogue. Fully overlapping the epilogue is
    challenging"). The epilogue's share is its bytes per FLOP: 1 / K of a 16-bit output, and
    2 x 4 bytes per 2 T FLOP for a weight-gradient GEMM accumulating into fp32 main gradients over
    the micro-batch's T tokens: on H100 (618 TFLOPS achieved, 2.85 TB/s) 0.42 of a wgrad GEMM's
    math at GPT-3's T = 2048 (14 % of the layer's GEMM time; half that with bf16 main gradients),
    a quarter of it at T = 8192. The roofline counted those bytes but hid them under the math. Blackwell
    double-buffers the accumulator in tensor memory, so the next tile's MMAs run during the
    epilogue (Triton Gluon Blackwell tutorial: "Double-buffer the accumulator to fully overlap the
    epilogue"; CUTLASS sm100 kernels' "overlapping accum"): "overlapped" there.

    >>> from dfmodel.system.schema import Chip
    >>> chip = Chip.model_validate({"name": "c", "peak_flops": "1 TFLOPS", "sram_bytes": "1 MB", "memory": {"kind": "HBM",
    ...     "capacity_bytes": "1 GB", "bandwidth_Bps": "1 TB/s"}, "efficiency": {"memory": 1.0, "matmul": 1.0},
    ...     "gemm_epilogue": "serial"})
    >>> k = Kernel("wgrad.fc1", KernelKind.matmul, {}, flop=4e9, output_bytes=4e6, weight_bytes=4e6, phase=Phase.weight_grad)
    >>> round(gemm_epilogue_exposed_s(chip, k, "bf16"), 9)  # 8 MB at 1 TB/s under a 4 ms mainloop
    8e-06
    >>> round(gemm_epilogue_exposed_s(chip, Kernel("g", KernelKind.matmul, {}, flop=2e6, output_bytes=4e6), "bf16"), 9)
    2e-06
    >>> gemm_epilogue_exposed_s(chip.model_copy(update={"gemm_epilogue": "overlapped"}), k, "bf16")
    0.0
    """
    return _serial_epilogue_s(chip, kernel, mainloop_time_s(chip, kernel, precision), precision)


#: GEMM precisions Hopper runs on its warp-group MMA (wgmma: f16 / bf16 / tf32 / fp8 / int8
#: operands, PTX ISA 8.x sec. 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
#: the serial epilogue of :func:`gemm_epilogue_exposed_s` is theirs. An fp64 GEMM (HPL's DGEMM)
#: runs on the warp-level DMMA (mma.sync) with several CTAs per SM, as on Ampere, whose
#: epilogues overlap ("overlapped", dgx_a100.yaml).
WGMMA_PRECISIONS = frozenset(("bf16", "fp16", "fp8"))


def _serial_epilogue_s(chip: Chip, kernel: Kernel, mainloop_s: float, precision: Precision | str) -> float:
    """:func:`gemm_epilogue_exposed_s` of a kernel whose mainloop takes ``mainloop_s``."""
    if (chip.gemm_epilogue != "serial" or chip.execution != "kernel_by_kernel"  # a dataflow partition streams
            or Precision(kernel.precision or precision).value not in WGMMA_PRECISIONS):
        return 0.0
    ep = gemm_epilogue_bytes(kernel)
    return min(mainloop_s, memory_time_s(chip, ep)) if ep > 0 else 0.0


def kernel_memory_bytes(kernel: Kernel, input_bytes: float) -> float:
    """DRAM bytes of a kernel run alone (kernel-by-kernel): inputs, output, weights, extra."""
    return input_bytes + kernel.output_bytes + kernel.weight_bytes + kernel.extra_memory_bytes


def tile_allocation(times_s: Sequence[float], tiles: int) -> list[int] | None:
    """Integer tiles per fused kernel minimising the slowest ``time_k * tiles / t_k``.

    Greedy water-filling (give the next tile to the current bottleneck) is exact for this
    min-max over integers, from any start below an optimum (Fox 1966). It starts from the
    proportional floor ``max(1, floor(t_k (tiles - n) / sum t))``, which never exceeds the least
    optimal allocation, so only O(n) greedy steps remain even with 850,000 tiles (WSE-2).
    Returns None when there are more kernels than tiles.

    >>> tile_allocation([3.0, 1.0], 4)
    [3, 1]
    """
    n = len(times_s)
    if n > tiles:
        return None
    total = float(sum(times_s))
    alloc = [1] * n
    if n == 0:
        return alloc
    if total <= 0:
        # no work (a partition of communication or zero-FLOP kernels): every split is optimal;
        # the greedy would hand kernel 0 the spare tiles one heap step at a time (850,000 on a
        # WSE-2: ~0.3 s per report), so give them at once, as it would
        alloc[0] += tiles - n
        return alloc
    if tiles > n:
        alloc = [max(1, math.floor(t * (tiles - n) / total)) for t in times_s]
    heap = [(-t / a, i) for i, (t, a) in enumerate(zip(times_s, alloc))]
    heapq.heapify(heap)
    for _ in range(tiles - sum(alloc)):
        _, i = heapq.heappop(heap)
        alloc[i] += 1
        heapq.heappush(heap, (-times_s[i] / alloc[i], i))
    return alloc


def fused_compute_time_s(times_s: Sequence[float], tiles: int) -> float | None:
    """Compute time of kernels fused in one dataflow partition sharing ``tiles`` compute tiles.

    Each kernel gets its own tiles and all run as one spatial pipeline paced by the slowest:
    ``max_k time_k * tiles / t_k`` with ``time_k`` the kernel's whole-chip time. None when the
    kernels outnumber the tiles (the partition cannot be placed).

    >>> fused_compute_time_s([3.0, 1.0], 4)
    4.0
    """
    work = [t for t in times_s if t > 0]
    if not work:
        return 0.0 if len(times_s) <= tiles else None
    alloc = tile_allocation(work, tiles - (len(times_s) - len(work)))
    if alloc is None:
        return None
    return max(t * tiles / a for t, a in zip(work, alloc))


#: DRAM bytes per element of Transformer Engine's FP8 operand preparation for one FP8 GEMM
#: operand, run as kernels of their own before the GEMM (so nothing hides them under its math):
#:
#: - ``FP8_TRANSPOSE_BYTES`` (read 1 + write 1): Hopper's FP8 tensor-core GEMMs take only the
#:   "TN" layout (cuBLASLt FP8 requirement; TE keeps a transposed FP8 copy of every GEMM input for
#:   the weight-gradient GEMM: ``fp8_transpose`` / ``fp8_cast_transpose_fused`` in
#:   transformer_engine/pytorch/module/{linear,layernorm_linear,layernorm_mlp}.py, TE v1.11), over
#:   the operand as the GEMM reads it (the gathered tensor under sequence parallelism), for the
#:   per-tensor recipes (:data:`dfmodel.graph.fp8.RECIPES` ``transposes``);
#: - ``FP8_CAST_BYTES`` (read 2 + write 1): the delayed-scaling cast on the rank's un-gathered
#:   shard (TE casts before the FP8 userbuffers all-gather); the other recipes' casts are in
#:   :data:`dfmodel.graph.fp8.RECIPES`.
FP8_TRANSPOSE_BYTES = 2.0
FP8_CAST_BYTES = RECIPES["delayed"].cast_bytes


def fp8_operand_prep_s(chip: Chip, gathered_elements: float, shard_elements: float, *, from_norm: bool,
                       recipe: str = "delayed", dispatched: bool = False) -> float:
    """Time of Transformer Engine's cast / transpose kernels for one FP8 GEMM operand of
    ``gathered_elements`` (as the GEMM reads it) whose rank holds ``shard_elements`` before any
    all-gather, under FP8 ``recipe`` (:data:`dfmodel.graph.fp8.RECIPES`): the recipe's cast bytes
    x shard (its ``norm_bytes`` when the operand is a layer norm's output that TE's
    LayerNormLinear quantises, ``from_norm``) plus, for a per-tensor recipe on a chip whose FP8
    GEMMs take only the TN layout, ``FP8_TRANSPOSE_BYTES`` x gathered, at the achieved DRAM
    bandwidth, plus one launch per kernel (the transpose shares the cast's). Memory-bound kernels run alone (kernel-by-kernel), so
    this adds to the step; bf16 GEMMs need none of it. Nothing at all (no kernel) when there is
    nothing to do (delayed scaling after a layer norm on Blackwell).

    >>> from dfmodel.system.schema import Chip
    >>> chip = Chip.model_validate({"name": "c", "peak_flops": "1 TFLOPS", "sram_bytes": "1 MB", "memory": {"kind": "HBM",
    ...     "capacity_bytes": "1 GB", "bandwidth_Bps": "1 TB/s"}, "efficiency": {"memory": 1.0, "kernel_overhead_s": 0}})
    >>> fp8_operand_prep_s(chip, 1e9, 0.25e9, from_norm=True), fp8_operand_prep_s(chip, 1e9, 0.25e9, from_norm=False)
    (0.002, 0.00275)
    >>> blackwell = chip.model_copy(update={"fp8_gemm_any_layout": True})
    >>> fp8_operand_prep_s(blackwell, 1e9, 0.25e9, from_norm=True), fp8_operand_prep_s(blackwell, 1e9, 0.25e9, from_norm=False)
    (0.0, 0.00075)
    >>> fp8_operand_prep_s(blackwell, 1e9, 0.25e9, from_norm=False, recipe="current")  # + the amax pass
    0.00125

    ``dispatched``: the operand crossed an FP8 all-to-all (an MoE expert GEMM's input with
    ``moe.dispatch_fp8``): the sender cast one row-wise copy of its ``shard_elements`` tokens, and
    the receiver makes the other copy of the ``gathered_elements`` rows it computes on by reading
    the FP8 rows out, transposing and re-quantising them (DeepSeek-V3, arXiv:2412.19437 sec. 3.5.1:
    "read out, dequantized, transposed, re-quantized into 128x1 tiles, and stored in HBM"): read
    and write one copy per element, the transpose of the per-tensor recipes.

    >>> fp8_operand_prep_s(blackwell, 1e9, 0.25e9, from_norm=False, recipe="blockwise", dispatched=True)
    0.0028203125
    """
    cost = recipe_cost(recipe)
    if dispatched:
        return _dispatched_prep_s(chip, cost, gathered_elements, shard_elements)
    transpose = FP8_TRANSPOSE_BYTES * gathered_elements if cost.transposes and not chip.fp8_gemm_any_layout else 0.0
    num_bytes = transpose + (cost.norm_bytes if from_norm else cost.cast_bytes) * shard_elements
    # TE fuses the transpose into the cast when there is one (``fp8_cast_transpose_fused``)
    kernels = (cost.norm_kernels if from_norm else cost.cast_kernels) or int(transpose > 0)
    if num_bytes == 0:
        return 0.0
    return memory_time_s(chip, num_bytes) + kernels * chip.efficiency.kernel_overhead_s


def _dispatched_prep_s(chip: Chip, cost, gathered_elements: float, shard_elements: float) -> float:
    """:func:`fp8_operand_prep_s` of an operand the sender quantised before an FP8 dispatch:
    the sender's cast without the second copy, plus the receiver's re-quantised second copy
    (none for a per-tensor recipe on a chip whose FP8 GEMMs take any layout)."""
    one_copy = cost.cast_bytes - (0.0 if cost.transposes else cost.copy_bytes)
    second = 0.0 if cost.transposes and chip.fp8_gemm_any_layout else 2 * cost.copy_bytes * gathered_elements
    num_bytes = one_copy * shard_elements + second
    kernels = cost.cast_kernels + int(second > 0)
    return memory_time_s(chip, num_bytes) + kernels * chip.efficiency.kernel_overhead_s


def graph_launched(system: System) -> System:
    """``system`` with its per-kernel overhead replaced by the in-graph one (CUDA graphs).

    A captured iteration replays its kernels without the CPU launch, so only the GPU-side gap
    between graph nodes remains (:meth:`~dfmodel.system.schema.Efficiency.graph_overhead_s`).
    The system is unchanged when the chip gives no separate figure. Used by every family whose
    workload says it runs as CUDA graphs (DLRM: HugeCTR's holistic graph; LLM: Megatron-Core's
    ``cuda_graph_scope: full_iteration`` as NVIDIA's MLPerf submissions run it).
    """
    eff = system.chip.efficiency
    if eff.graph_kernel_overhead_s is None:
        return system
    eff = eff.model_copy(update={"kernel_overhead_s": eff.graph_overhead_s()})
    return system.model_copy(update={"chip": system.chip.model_copy(update={"efficiency": eff})})
