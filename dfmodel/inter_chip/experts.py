"""Mixture-of-experts terms of the LLM mapping: dense vs MoE layers per stage, the expert
data-parallel group, and the all-to-all overlap of Megatron-Core / DeepSeek's DualPipe.

Plain functions over numbers and groups (no model object), so :mod:`.llm` calls them as hooks
and the tests check them in closed form.
"""

from __future__ import annotations

from dfmodel.graph.workload import fc1_width_factor
from dfmodel.netmodels.nccl import H100_SMS, overlapped_exposed_s

#: Bytes per element of an FP8 dispatch: 1 (E4M3) plus one fp32 scale per 1x128 tile
#: (DeepSeek-V3, arXiv:2412.19437 sec. 3.3.1-3.3.3: fine-grained tile-wise quantisation)
FP8_DISPATCH_BYTES = 1.0 + 4.0 / 128

#: SMs DeepSeek-V3 gives the dispatch / combine kernels while they overlap computation:
#: "only 20 SMs are sufficient to fully utilize the bandwidths of IB and NVLink" (DeepSeek-AI
#: 2024, arXiv:2412.19437, sec. 3.2.2), of the H800's 132 SMs (same die as the H100 SXM5).
A2A_OVERLAP_SMS = 20


def a2a_sm_fraction(sms: int = H100_SMS, comm_sms: int = A2A_OVERLAP_SMS) -> float:
    """Fraction of the chip's compute the overlapped all-to-all kernels take away.

    >>> round(a2a_sm_fraction(), 4)
    0.1515
    """
    return comm_sms / sms


#: the exposed part of all-to-alls overlapped with another micro-batch's computation that loses
#: ``sm_fraction`` of the chip while they run (:func:`~dfmodel.netmodels.nccl.overlapped_exposed_s`)
overlapped_a2a_exposed_s = overlapped_exposed_s


def with_unpaired(share: float, *, pp: int, num_micro_batches: int) -> float:
    """Exposed share of a layer's all-to-alls averaged over a stage's micro-batches, when
    ``share`` is exposed in the overlapped steady state and the unpaired ones are exposed whole.

    The overlap pairs a forward with another micro-batch's backward (Megatron-Core's combined
    1F1B; DualPipe's forward-backward chunks). The first stage of a 1F1B pipeline runs ``pp - 1``
    warm-up forwards before its first backward and ``pp - 1`` cool-down backwards after its last
    forward (Narayanan et al. 2021, sec. 2.2.1): those have nothing to hide behind. Of its ``M``
    forwards (and backwards) ``u = min(pp - 1, M)`` are unpaired, so the mean exposed share is
    ``share + (1 - share) u / M`` (the bottleneck stage taken as the first: the others have fewer).

    >>> with_unpaired(0.25, pp=1, num_micro_batches=8), with_unpaired(0.25, pp=5, num_micro_batches=8)
    (0.25, 0.625)
    >>> with_unpaired(0.25, pp=16, num_micro_batches=8)
    1.0
    """
    unpaired = min(pp - 1, num_micro_batches) / num_micro_batches
    return share + (1.0 - share) * unpaired


def a2a_overlap_applies(*, ep: int, num_micro_batches: int) -> bool:
    """Whether the overlap option can do anything: an ep group to exchange over and a second
    micro-batch whose computation hides the first's all-to-alls (Megatron-Core pairs the
    forward of micro-batch ``i + 1`` with the backward of ``i``; DualPipe pairs a forward and a
    backward chunk, sec. 3.2.1 of the DeepSeek-V3 report).

    >>> a2a_overlap_applies(ep=8, num_micro_batches=4), a2a_overlap_applies(ep=1, num_micro_batches=4)
    (True, False)
    """
    return ep > 1 and num_micro_batches >= 2


def dense_layers_per_stage(chunk_layers: "tuple[int, ...] | list[int]", pp: int, num_dense: int) -> list[int]:
    """How many of the first ``num_dense`` layers (an MoE model's dense layers) each physical
    pipeline stage holds, given the layers per (virtual) chunk in pipeline order: chunk ``j``
    runs on stage ``j mod pp`` (Megatron's interleaved placement) and takes the next layers of
    the chain, so the dense layers fill the first chunks.

    >>> dense_layers_per_stage([2, 2, 2, 2], 4, 3), dense_layers_per_stage([1, 1, 1, 1], 2, 3)
    ([2, 1, 0, 0], [2, 1])
    """
    out = [0] * pp
    left = num_dense
    for j, n in enumerate(chunk_layers):
        take = min(n, left)
        out[j % pp] += take
        left -= take
    return out


def complement_group(system, group, sub) -> tuple[tuple[str, int], ...]:
    """``group`` with the members of its sub-group ``sub`` factored out, per network dimension:
    Megatron-Core's expert data-parallel group (the dp x cp ranks that hold the same experts:
    ``dp x cp / ep`` of them with expert TP = TP) from the dp x cp group and the ep group
    carved out of it (``parallel_state.py``: ``expert_data_parallel_size = world / (etp x ep x
    pp)``).

    >>> from dfmodel.system import load_system
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> complement_group(s, (("nv", 4), ("ib", 8)), (("nv", 4), ("ib", 2)))
    (('ib', 4),)
    """
    members = dict(group)
    for dim, n in sub:
        if members.get(dim, 1) % n:
            raise ValueError(f"{sub} is not a sub-group of {group}")
        members[dim] = members[dim] // n
    return tuple((d.name, members[d.name]) for d in system.network if members.get(d.name, 1) > 1)


#: Megatron-Core's alltoall token dispatcher (NCCL all-to-all, one copy per routed expert) against
#: DeepEP (one RDMA copy per target node) on the same cluster and layers: deepseek-ai/DeepEP issue #59
#: (2025-03-08; nsys of DeepSeek-V3's first pipeline stage under Megatron-LM's DeepEP integration on
#: 8 H100 nodes): "the combining alltoall comms are faster (13ms->5ms) with DeepEP".
DEEPEP59_NCCL_COMBINE_S = 13e-3
DEEPEP59_DEEPEP_COMBINE_S = 5e-3
#: DeepSeek-V3's routing there: top-8 experts on at most M = 4 of the 8 nodes (node-limited routing,
#: arXiv:2412.19437 sec. 2.1.2; Megatron-Core --moe-router-num-groups = nodes, --moe-router-group-topk 4)
DEEPEP59_TOP_K, DEEPEP59_NODES_PER_TOKEN = 8, 4


def nccl_a2a_scale_out_efficiency() -> float:
    """Rate of NCCL's all-to-all over a GPU cluster's scale-out network as a share of a per-node
    dispatcher's (DeepEP's), which is the rate the GPU presets' scale-out dimension runs at
    (dgx_h800 / dgx_h100 ``ib`` 45 GB/s, checked against DeepEP's 43-47 GB/s RDMA in
    tests/test_moe_search.py).

    In DeepEP issue #59 the two moved the same layer's tokens: NCCL sends every routed copy bound
    for another node, ``top_k (n - 1) / n`` per token, DeepEP one per target node, ``M (n - 1) / n``
    (the node-limited count of :func:`token_a2a_s`): ``top_k / M`` = 2x fewer bytes, in 5 ms
    against NCCL's 13 ms, so NCCL ran at ``(top_k / M) x 5 / 13`` = 0.77 of DeepEP's rate. DeepEP
    does not exceed its README's 43-47 GB/s, so 0.77 is the most NCCL's share of the preset rate
    can be (an untuned DeepEP there, whose dispatch was slower than NCCL's, only lowers it;
    unlimited routing, 4.6 target nodes of 7 per token, would give 0.59).

    >>> round(nccl_a2a_scale_out_efficiency(), 3)
    0.769
    """
    bytes_ratio = DEEPEP59_TOP_K / DEEPEP59_NODES_PER_TOKEN
    return bytes_ratio * DEEPEP59_DEEPEP_COMBINE_S / DEEPEP59_NCCL_COMBINE_S


def nccl_scale_out_dims(system, group, fast_dim: str) -> frozenset:
    """The dimensions of an ep ``group`` over which an NCCL all-to-all runs at
    :func:`nccl_a2a_scale_out_efficiency`: on a kernel-by-kernel chip (a GPU; dataflow chips
    exchange tokens with their own runtimes), the switched dimensions outside the fast (NVLink)
    one, the cluster's InfiniBand / Ethernet scale-out (rings, tori and fully connected
    dimensions are other machines' fabrics, not NCCL's; RCCL's all-to-all is NCCL's design).

    >>> from dfmodel.system import load_system
    >>> s = load_system("dgx_h100", num_chips=64)
    >>> sorted(nccl_scale_out_dims(s, (("nvlink", 8), ("ib", 8)), "nvlink")), sorted(nccl_scale_out_dims(s, (("nvlink", 8),), "nvlink"))
    (['ib'], [])
    """
    if system.chip.execution != "kernel_by_kernel":
        return frozenset()
    switched = {d.name for d in system.network if d.topology == "switch"}
    return frozenset(dim for dim, n in group if dim != fast_dim and n > 1 and dim in switched)


def _nccl_a2a_s(costs, group, slow: frozenset, buffer: float) -> float:
    """An all-to-all of ``buffer`` bytes per member over ``group`` as the cost table runs it (one
    all-to-all per dimension, in series or pipelined across dimensions, ``NetworkDim.pipelined``),
    the bandwidth part of the ``slow`` dimensions' steps at :func:`nccl_a2a_scale_out_efficiency`.
    With no slow dimension it is the cost table's ``all_to_all``."""
    eff = nccl_a2a_scale_out_efficiency()
    fills, steps = [], []
    for dim, n in group:
        fill = costs.time_s("all_to_all", 0.0, ((dim, n),))  # latency-only
        t = costs.time_s("all_to_all", buffer, ((dim, n),))
        fills.append(fill)
        steps.append(fill + (t - fill) / eff if dim in slow else t)
    if len(steps) == 1:
        return steps[0]
    pipelined = all(d.pipelined for d in costs.system.network if d.name in dict(group))
    return min(sum(steps), max(steps) + sum(fills)) if pipelined else sum(steps)


def token_a2a_s(costs, group, fast_dim: str, *, rows: float, hidden: int,
                bytes_per_element: float, moe) -> float:
    """One token all-to-all (a dispatch or a combine) over the ep ``group``.

    Hierarchically, one all-to-all per network dimension of the group, one after another or
    pipelined across dimensions, whichever is faster (the cost table's multi-dimension
    all-to-all, :func:`dfmodel.netmodels.collectives.algorithms`). Each member's buffer is its
    ``rows`` routed copies of ``hidden`` elements. With node-limited routing
    (``moe.max_nodes_per_token`` = M, DeepSeek-V3 sec. 3.2.2) a token crosses the dimensions
    outside the node (``fast_dim``) once per target node, at most ``min(M, top_k, nodes of
    the group)`` times, instead of once per expert: the buffer of those dimensions is
    ``rows x copies / top_k``; inside the node NVLink forwards every copy.

    Check on published kernels: DeepEP (github.com/deepseek-ai/DeepEP, README "Normal kernels
    with NVLink and RDMA forwarding", H800 + CX7 400 Gb/s, DeepSeek-V3's pretraining setting)
    measures 43-47 GB/s RDMA and 153-158 GB/s NVLink "bottleneck bandwidth" per GPU for these
    dispatches and combines; dgx_h800's IB and NVLink steps run at 45 and 160 GB/s
    (tests/test_moe_search.py checks the IB figure). Without node-limited routing the exchange
    is Megatron-Core's alltoall dispatcher, an NCCL all-to-all, which reaches
    :func:`nccl_a2a_scale_out_efficiency` of that rate on the scale-out dimensions
    (:func:`nccl_scale_out_dims`).

    >>> from dfmodel.system import load_system
    >>> from dfmodel.netmodels import CostTable
    >>> from dfmodel.graph.workload import MoEConfig
    >>> s = load_system({"name": "t", "chip": {"name": "c", "peak_flops": 1e12, "sram_bytes": 1e6,
    ...     "memory": {"kind": "DDR", "capacity_bytes": 1e9, "bandwidth_Bps": 1e10}},
    ...     "network": [{"name": "nv", "topology": "switch", "size": 8, "link_bandwidth_Bps": 1e11},
    ...                 {"name": "ib", "topology": "switch", "size": 16, "link_bandwidth_Bps": 1e10}]})
    >>> c, g = CostTable(s), (("nv", 8), ("ib", 8))
    >>> free = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048)
    >>> lim = MoEConfig(num_experts=256, top_k=8, expert_ffn_hidden=2048, max_nodes_per_token=4)
    >>> kw = dict(rows=8 * 4096, hidden=7168, bytes_per_element=2)
    >>> a, b = token_a2a_s(c, g, "nv", moe=free, **kw), token_a2a_s(c, g, "nv", moe=lim, **kw)
    >>> a > c.time_s("all_to_all", 8 * 4096 * 7168 * 2, g), round(b / a, 2) < 0.6
    (True, True)
    >>> token_a2a_s(c, (("nv", 8),), "nv", moe=free, **kw) == c.time_s("all_to_all", 8 * 4096 * 7168 * 2, (("nv", 8),))
    True
    """
    buffer = rows * hidden * bytes_per_element
    limit = getattr(moe, "max_nodes_per_token", None)
    if limit is None or not group:
        slow = nccl_scale_out_dims(costs.system, group, fast_dim) if group else frozenset()
        return _nccl_a2a_s(costs, group, slow, buffer) if slow else costs.time_s("all_to_all", buffer, group)
    nodes = 1
    for dim, n in group:
        if dim != fast_dim:
            nodes *= n
    scale_out = buffer * min(limit, moe.top_k, nodes) / moe.top_k
    steps = [costs.time_s("all_to_all", buffer if dim == fast_dim else scale_out, ((dim, n),)) for dim, n in group]
    if len(steps) == 1:
        return steps[0]
    fill = sum(costs.time_s("all_to_all", 0.0, ((dim, n),)) for dim, n in group)  # latency-only
    return min(sum(steps), max(steps) + fill)


def dispatch_bytes_per_element(moe, activation_bytes: float) -> float:
    """Element size of a dispatch (and of the combine's backward, which sends the gradients
    before the down-projections the same way): FP8 with tile scales when ``moe.dispatch_fp8``
    (DeepSeek-V3 sec. 3.3.3), else the activation precision; combines stay at the latter.

    >>> from types import SimpleNamespace as N
    >>> dispatch_bytes_per_element(N(dispatch_fp8=True), 2), dispatch_bytes_per_element(N(dispatch_fp8=False), 2)
    (1.03125, 2)
    """
    return FP8_DISPATCH_BYTES if getattr(moe, "dispatch_fp8", False) else activation_bytes


def mla_up_recompute_s(chip, mla, *, tokens: float, heads: int, tp: int, precision) -> float:
    """Backward-time cost of recomputing MLA's up projections (``mla.recompute_up_proj``):
    their forward GEMMs again, ``2 x tokens x (q_lora x a (nope + rope) + kv_lora x a (nope +
    v))`` FLOP (:func:`dfmodel.graph.builders.mla.mla_up_flop`), heads split ``tp`` ways, at
    the chip's matmul rate for ``precision``; 0 when the field is off. RoPE's element-wise pass
    over Q and K is left out (one read and write of tensors the GEMM just wrote).

    >>> from types import SimpleNamespace as N
    >>> from dfmodel.graph.workload import MLAConfig
    >>> chip = N(peak=lambda p: 1e15, efficiency=N(matmul_at=lambda p: 0.5))
    >>> on = MLAConfig(recompute_up_proj=True)
    >>> mla_up_recompute_s(chip, on, tokens=4096, heads=128, tp=2, precision="bf16") * 5e14 * 2 == 2 * 4096 * (1536 * 128 * 192 + 512 * 128 * 256)
    True
    >>> mla_up_recompute_s(chip, MLAConfig(), tokens=4096, heads=128, tp=2, precision="bf16")
    0.0
    """
    from dfmodel.graph.builders.mla import mla_up_flop

    if mla is None or not getattr(mla, "recompute_up_proj", False):
        return 0.0
    return mla_up_flop(mla, tokens, heads) / tp / (chip.peak(precision) * chip.efficiency.matmul_at(precision))


def moe_recompute_bytes(model, *, tokens: float, tp: int, sequence_parallel: bool, bytes_per_element: float,
                        linear_input_bytes: float) -> float:
    """DRAM bytes one MoE layer's backward moves per micro-batch to recompute what Megatron-Core's
    fine-grained recompute dropped (the saved tensors :func:`~dfmodel.inter_chip.memory.
    moe_mla_activation_delta_bytes` no longer counts); 0 when neither field is set.

    - ``moe.recompute_activation`` (``moe_act``): the activation again, reading the FC1 output
      (``2|1 x e`` per element, gated or not) and writing its output (``e``), on the routed rows
      ``R = tokens x top_k x capacity x imbalance`` of width ``f_e / tp``; in FP8 training
      (``linear_input_bytes`` < ``e``) TE quantises FC2's input for its weight gradient again:
      read ``e``, write ``linear_input_bytes`` (``set_save_original_input``).
    - ``moe.recompute_norm`` (``layernorm``): the pre-MLP RMSNorm again, read and write ``e`` per
      element of ``tokens x h`` (``/tp`` with SP); with MLA the input norm too, whose output
      feeds linears (FP8: quantised again, as above).

    Memory-bound element-wise passes: the caller times them at the chip's DRAM bandwidth.

    >>> from types import SimpleNamespace as N
    >>> moe = N(recompute_activation=True, recompute_norm=False, routed_token_factor=8, expert_ffn_hidden=768)
    >>> model = N(moe=moe, mla=None, hidden=2048, ffn_type="swiglu")
    >>> moe_recompute_bytes(model, tokens=4096, tp=1, sequence_parallel=False, bytes_per_element=2,
    ...                     linear_input_bytes=2) == 4096 * 8 * 768 * (2 * 2 + 2)
    True
    """
    moe = getattr(model, "moe", None)
    if moe is None:
        return 0.0
    e, g = bytes_per_element, linear_input_bytes
    requantise = e + g if g < e else 0.0  # (FP8: read the 16-bit recomputed output, write its FP8 copy)
    out = 0.0
    if getattr(moe, "recompute_activation", False):
        gated = fc1_width_factor(model.ffn_type)
        out += (gated * e + e + requantise) * tokens * moe.routed_token_factor * moe.expert_ffn_hidden / tp
    if getattr(moe, "recompute_norm", False):
        rows = tokens * model.hidden / (tp if sequence_parallel else 1)
        out += 2 * e * rows + ((2 * e + requantise) * rows if getattr(model, "mla", None) is not None else 0.0)
    return out


def mtp_projection_s(chip, *, tokens: float, hidden: int, tp: int, precision) -> tuple[float, float]:
    """(forward, backward) time of one multi-token-prediction module's projection M_k
    (DeepSeek-V3, arXiv:2412.19437 sec. 2.2 eq. 21: ``M_k [RMSNorm(h); RMSNorm(Emb(t))]``, a
    ``2d x d`` matrix) on ``tokens`` tokens of one micro-batch, split ``tp`` ways (Megatron-Core's
    ``eh_proj`` is a column-parallel linear): ``2 x tokens x 2d x d / tp`` FLOP forward and twice
    that backward (data and weight gradients), at the chip's matmul rate for ``precision``.

    >>> from types import SimpleNamespace as N
    >>> chip = N(peak=lambda p: 1e15, efficiency=N(matmul_at=lambda p: 0.5))
    >>> mtp_projection_s(chip, tokens=4096, hidden=1024, tp=2, precision="bf16")
    (1.7179869184e-05, 3.4359738368e-05)
    """
    fwd = 2.0 * tokens * 2 * hidden * hidden / tp / (chip.peak(precision) * chip.efficiency.matmul_at(precision))
    return fwd, 2.0 * fwd


def mtp_stage_s(moe, *, layer_s: tuple[float, float], head_s: tuple[float, float],
                projection_s: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) time the multi-token-prediction modules add to the last pipeline
    stage per micro-batch: each of ``moe.mtp_layers`` modules runs one more Transformer block of
    the model's (an MoE layer with its all-to-alls, as DeepSeek-V3's MTP block: HF config
    ``num_nextn_predict_layers = 1`` is layer 61, an MoE layer), its projection, and the shared
    output head again with its own cross-entropy (sec. 2.2 eq. 22-24). Their RMSNorms are two
    element-wise passes over the micro-batch, left out beside the layer's.

    >>> from types import SimpleNamespace as N
    >>> mtp_stage_s(N(mtp_layers=1), layer_s=(1.0, 2.0), head_s=(0.5, 1.0), projection_s=(0.1, 0.2))
    (1.6, 3.2)
    >>> mtp_stage_s(N(mtp_layers=0), layer_s=(1.0, 2.0), head_s=(0.5, 1.0), projection_s=(0.1, 0.2))
    (0.0, 0.0)
    """
    n = getattr(moe, "mtp_layers", 0) if moe is not None else 0
    return (n * (layer_s[0] + head_s[0] + projection_s[0]), n * (layer_s[1] + head_s[1] + projection_s[1]))


def recipe_order(deg: dict[str, int], fast_size: int) -> tuple:
    """Order in which the search tries MoE recipe incumbents (:meth:`LLMSpace.seeds`), as the
    published MoE runs are laid out: TP inside the fast (NVLink) domain, no context parallelism
    at short sequences, the largest expert-parallel degree (DeepSeek-V3: EP 64 over 8 nodes,
    arXiv:2412.19437 sec. 3.2; Megatron-Core's DeepSeek-V3 recipe: EP 64), then the shallowest
    pipeline, then the narrowest TP (memory decides whether a candidate fits; the search
    evaluates it).

    >>> sorted([{"tp": 2, "pp": 16, "cp": 1, "ep": 64}, {"tp": 16, "pp": 2, "cp": 1, "ep": 4},
    ...         {"tp": 1, "pp": 8, "cp": 1, "ep": 64}], key=lambda d: recipe_order(d, 8))[0]
    {'tp': 1, 'pp': 8, 'cp': 1, 'ep': 64}
    """
    return (deg["tp"] > fast_size, deg["cp"], -deg["ep"], deg["pp"], deg["tp"])


#: overlap flags MoE recipes turn on (Megatron-Core's DeepSeek-V3 / Mixtral recipes: TP
#: communication overlap, overlapped gradient reduce and parameter gather): a seed takes them
RECIPE_OVERLAPS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")


def members_off(group, fast_dim: str) -> int:
    """Members of a rank group (``(dim, members)`` pairs) outside the fast dimension: 1 when
    the whole group sits on it (where recipes put TP: Megatron-LM keeps TP within the NVLink
    domain).

    >>> members_off((("nvlink", 2),), "nvlink"), members_off((("nvlink", 2), ("ib", 4)), "nvlink")
    (1, 4)
    """
    out = 1
    for dim, n in group:
        if dim != fast_dim:
            out *= n
    return out


__all__ = ["nccl_a2a_scale_out_efficiency", "nccl_scale_out_dims", "mla_up_recompute_s", "moe_recompute_bytes", "mtp_projection_s", "mtp_stage_s", "with_unpaired", "token_a2a_s", "dispatch_bytes_per_element", "FP8_DISPATCH_BYTES", "members_off", "recipe_order", "A2A_OVERLAP_SMS", "a2a_sm_fraction", "overlapped_a2a_exposed_s", "a2a_overlap_applies",
           "dense_layers_per_stage", "complement_group"]
