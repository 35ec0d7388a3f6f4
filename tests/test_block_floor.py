"""The per-kernel and forced-TP-collective floors of the search's bounds (issue 12,
dfmodel/inter_chip/block_floor.py): below every solved block, below every candidate's
evaluation (with and without tp_comm_overlap, SP, recompute), and built on the micro-batch
scaling they assume."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.kernel import Phase
from dfmodel.inter_chip import block_floor as bf
from dfmodel.inter_chip.config import Knobs, Mapping
from dfmodel.inter_chip.llm import LLMModel, _layer_times_s
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.inter_chip.sharding import is_weight_gradient
from dfmodel.presets import list_presets
from tests.test_inter_chip import SMALL_LLM, small_system
from tests.test_moe import MOE, with_moe


def _llm_presets():
    return [p for p in list_presets("workloads") if load_workload(p).kind == "llm"]


@pytest.mark.parametrize("preset", _llm_presets(), ids=lambda p: p.stem)
def test_kernels_grow_at_least_linearly_with_the_micro_batch(preset):
    """BlockFloor evaluates a micro-batch of k from the graph of one: every kernel's FLOP and
    every tensor but a weight gradient grow at least k-fold; weights stay, weight gradients (taken
    as fixed) never shrink (a sparse embedding gradient grows with the tokens)."""
    model = LLMModel(load_workload(preset), load_system("dgx_h100"))
    k = 3
    for cp in (1, 2):
        g1, gk = model.graphs(1, cp), model.graphs(k, cp)
        for which in ("layer", "embedding", "head", "dense_layer"):
            a, b = getattr(g1, which), getattr(gk, which)
            if a is None:
                continue
            ka, kb = {x.name: x for x in a.kernels}, {x.name: x for x in b.kernels}
            assert ka.keys() == kb.keys()
            for name, x in ka.items():
                y = kb[name]
                assert y.flop >= k * x.flop * (1 - 1e-12)
                assert y.extra_memory_bytes >= k * x.extra_memory_bytes * (1 - 1e-12)
                assert y.weight_bytes == x.weight_bytes
            small = {(t.name, t.producer, t.consumer): t.bytes for t in a.tensors}
            for t in b.tensors:
                k_p = b.kernel(t.producer) if t.producer is not None else None
                if k_p is not None and (k_p.phase == Phase.weight_grad or is_weight_gradient(k_p, t)):
                    assert t.bytes >= small[(t.name, t.producer, t.consumer)]  # (taken as fixed: a floor)
                else:
                    assert t.bytes >= k * small[(t.name, t.producer, t.consumer)] * (1 - 1e-12)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, True), (8, False)])
@pytest.mark.parametrize("mb", [1, 2])
def test_floor_is_below_every_solved_block(tp, sp, mb):
    """Kernel floors + forced reductions <= the solved block's forward + backward, for each TP
    group (intra- and inter-node), and the forced reductions <= its TP collectives."""
    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    groups = [(("nvlink", tp),)] if tp <= 4 else [(("nvlink", 4), ("ib", 2))]
    if tp == 2:
        groups.append((("ib", 2),))
    for group in groups:
        for which in ("layer", "embedding", "head"):
            blk = model.block(which, mb, tp, group, sp)
            fl = model._block_floor(which, tp, 1, sp, 1, False)
            forced = bf.forced_comm_s(fl, mb, model.costs, group, "none")
            assert fl.kernels_s(mb, "none") + forced <= (blk.fwd.time_s + blk.bwd.time_s) * (1 + 1e-12)
            assert forced <= blk.sharded.tp_comm_s * (1 + 1e-12) + len(blk.sharded.network_time_s) * fl.overhead_s
            for rc in ("selective", "full"):
                again = bf.forced_comm_s(fl, mb, model.costs, group, rc)
                assert fl.kernels_s(mb, rc) + again <= (blk.fwd.time_s + blk.backward_s(rc)) * (1 + 1e-12)
            if tp > 1 and which == "layer":
                # Megatron's layer reduces 2 partial sums forward, 2 backward: never free
                assert forced > 0.0
                # tp_comm_overlap: at least the longer of the GEMMs and the collectives
                m = Mapping(tp, 1, 8 // tp, mb, 16 // (8 // tp) // mb, recompute="full", sequence_parallel=sp,
                            tp_comm_overlap=True)
                f_ub, b_ub = _layer_times_s(blk, m, model.system.chip.compute_tiles)
                wire = bf.forced_comm_s(fl, mb, model.costs, group, "full", launches=False)
                assert fl.kernels_overlapped_s(mb, "full", wire) <= (f_ub + b_ub) * (1 + 1e-12)
                assert fl.kernels_overlapped_s(mb, "full", wire) >= fl.kernels_s(mb, "full") - 1e-15


@pytest.mark.parametrize("workload,system,knobs", [
    (SMALL_LLM, small_system(4, 2), Knobs()),
    (SMALL_LLM, small_system(4, 2), Knobs(tp_comm_overlap=True, recompute="full")),
    (SMALL_LLM, small_system(4, 2, ib_bw="2 GB/s"), Knobs(sequence_parallel=True)),
    (with_moe(MOE), small_system(4, 2), Knobs()),
])
def test_bound_below_every_candidates_evaluation(workload, system, knobs):
    """lower_bound_s (now with the kernel and TP floors) <= evaluate on every candidate."""
    model = LLMModel(load_workload(workload), load_system(system))
    cands = list(llm_candidates(model, knobs))
    assert any(m.tp > 1 for m in cands)
    tighter = 0
    for m in cands[::3]:
        ev = model.evaluate(m)
        lb = model.lower_bound_s(m)
        assert lb <= ev.iteration_time_s * (1 + 1e-12)
        floor = model.pass_floor_s(m)
        tighter += floor / m.pp > model.compute_floor_s(m.micro_batch, m.recompute) / (m.tp * m.cp * m.pp)
    assert tighter > 0  # the new floor is what bounds some candidates


def test_slow_tp_network_is_pruned_by_its_collectives():
    """Over a slow inter-node link, TP across nodes costs more than its compute: the bound says
    so before any block is solved, so the search needs fewer evaluations, same optimum."""
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2, ib_bw="1 GB/s"))
    model = LLMModel(w, s)
    slow = [m for m in llm_candidates(model, Knobs(tp=8)) if not m.tp_comm_overlap][0]
    assert model.lower_bound_s(slow) > 2 * model.compute_floor_s(slow.micro_batch, slow.recompute) / 8 * slow.num_micro_batches
    fast = solve_llm(w, s, Knobs())
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    assert fast.solver.status == "optimal"


def test_dataflow_chips_take_the_dataflow_floor():
    """Dataflow chips fuse kernels (no per-kernel traffic): their pass floor is the dataflow one
    (compute and compulsory traffic, tests/test_dataflow_floor.py), not this module's."""
    from dfmodel.inter_chip import dataflow_floor as dff
    from dfmodel.inter_chip.llm import _is_attention_core

    s = small_system(4, 2)
    s["chip"]["execution"] = "dataflow"
    model = LLMModel(load_workload(SMALL_LLM), load_system(s))
    m = next(iter(llm_candidates(model, Knobs(tp=2))))
    assert model.pass_floor_s(m, comm=False) == dff.pass_floor_s(model, m, _is_attention_core) > 0.0
    # with the forced TP reductions as each phase's network floor (tests/test_comm_floor.py)
    with_tp = dff.pass_floor_s(model, m, _is_attention_core, model._tp_groups(m))
    assert model.pass_floor_s(m) == with_tp > model.pass_floor_s(m, comm=False)


def test_memoised_kernel_sums_are_the_sums_of_the_kernel_floors():
    """kernels_s / kernels_overlapped_s (memoised per micro-batch and recompute on the floor)
    equal the sums taken from kernel_floors_s at every (mb, recompute, comm) asked in any order,
    and a replaced copy starts with no memo of its own."""
    import dataclasses

    import numpy as np

    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    fl = model._block_floor("layer", 2, 1, True, 1, False)
    asks = [(mb, rc, c) for mb in (4, 1, 2, 1) for rc in ("full", "none", "selective") for c in (0.0, 1e-3, 1.0)]
    for mb, rc, comm in asks:
        t = fl.kernel_floors_s(mb)
        again = {"none": 0.0, "selective": t[fl.core].sum(), "full": t[fl.fwd].sum()}[rc]
        assert fl.kernels_s(mb, rc) == pytest.approx(t.sum() + again, rel=1e-12)
        gemm_t = np.where(fl.linear, t - fl.overhead_s, 0.0)
        rest_t = t - gemm_t
        gemm = gemm_t.sum() + (gemm_t[fl.fwd].sum() if rc == "full" else 0.0)
        rest = rest_t.sum() + {"none": 0.0, "selective": t[fl.core].sum(), "full": rest_t[fl.fwd].sum()}[rc]
        assert fl.kernels_overlapped_s(mb, rc, comm) == pytest.approx(rest + max(gemm, comm), rel=1e-12)
    assert fl._sums and not dataclasses.replace(fl)._sums
