"""An MoE layer under Megatron's layouts runs what Megatron-Core's alltoall dispatcher runs
(issue 11, item 3: time and memory from the same layouts): the router, routing, permute and
unpermute on each TP rank's own sequence shard; with expert TP = TP the routed rows are
all-gathered over TP once after the dispatch and the experts' output reduce-scattered before the
combine (their backward: an all-gather of the output gradient, a reduce-scatter of the input
gradient) -- four TP collectives of routed rows per layer, no all-reduce of the expert output;
the expert FC1 keeps the gathered rows for its weight gradient, which memory counts."""

from __future__ import annotations

import pytest

from dfmodel import load_system, load_workload
from dfmodel.graph.kernel import Phase
from dfmodel.inter_chip import memory as mem
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm_space import llm_candidates
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.sharding import is_moe_routing

from test_inter_chip import small_system
from test_moe_physics import _etp_pair, assert_bounds_below_evaluation, moe_workload

FWD, BWD = Phase.forward, Phase.backward
#: experts as wide as the dense MLP (4 x hidden), so the sharding picks Megatron's column-parallel
#: FC1 and row-parallel FC2 (with 64-wide experts gathering FC1's output is cheaper)
WIDE = dict(num_shared_experts=0, expert_ffn_hidden=4096)


def _tp_collectives(sharded) -> set[tuple[str, str, Phase]]:
    """(collective, tensor, phase) of every TP communication kernel of a sharded layer."""
    out = set()
    for k in sharded.graph.kernels:
        if k.collective is not None:
            _, collective, tensor = k.name.split(".", 2)
            out.add((collective, tensor, k.phase))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_tp_equal_tp_runs_the_dispatchers_four_collectives(tp):
    model = LLMModel(load_workload(moe_workload(**WIDE)), load_system(small_system(4, 2)))
    m = next(iter(llm_candidates(model, Knobs(tp=tp, pp=1, ep=2, micro_batch=1, recompute="none", etp=0,
                                              sequence_parallel=True, tp_comm_overlap=False))))
    sharded = model.evaluate(m).layer.sharded
    routing = [k.name for k in model.graphs(1).layer.kernels if is_moe_routing(k)]
    assert len(routing) == 9  # router GEMM (fwd, dgrad, wgrad), route, permute, unpermute, fwd and bwd
    assert {sharded.plan.strategy[n] for n in routing} == {"tok"}
    moe = {c for c in _tp_collectives(sharded) if c[1] in ("routed_in", "expert_out", "d_expert_out", "d_routed_in")}
    assert moe == {("all_gather", "routed_in", FWD), ("reduce_scatter", "expert_out", FWD),
                   ("all_gather", "d_expert_out", BWD), ("reduce_scatter", "d_routed_in", BWD)}
    # the router's weight is whole on every rank: its gradient is all-reduced, as the norms' are
    assert ("all_reduce", "dW.router", Phase.weight_grad) in _tp_collectives(sharded)


def test_expert_tp_1_routes_without_tp_collectives_of_routed_rows():
    model = LLMModel(load_workload(moe_workload(**WIDE)), load_system(small_system(4, 2)))
    _, m1 = _etp_pair(model)
    names = {c[1] for c in _tp_collectives(model.evaluate(m1).layer.sharded)}
    assert not names & {"routed_in", "expert_out", "d_expert_out", "d_routed_in"}


def test_gathered_expert_input_memory_by_hand():
    """Expert TP = t > 1 with SP: the FC1 input is kept whole, ``g R h (1 - 1/t)`` more than
    sharded; without SP (nothing sharded to gather) and with full recompute, no change."""
    w = load_workload(moe_workload())
    model, t, s, b = w.model, 4, w.model.seq_len, 2
    rows = s * b * model.moe.routed_token_factor
    common = dict(seq_len=s, micro_batch=b, tp=t, bytes_per_element=2, recompute="none", linear_input_bytes=1)
    delta = (mem.moe_mla_activation_delta_bytes(model, sequence_parallel=True, experts_gathered=True, **common)
             - mem.moe_mla_activation_delta_bytes(model, sequence_parallel=True, **common))
    assert delta == pytest.approx(1 * rows * model.hidden * (1 - 1 / t))
    assert mem.moe_mla_activation_delta_bytes(model, sequence_parallel=False, experts_gathered=True, **common) == \
        mem.moe_mla_activation_delta_bytes(model, sequence_parallel=False, **common)
    full = {**common, "recompute": "full"}
    assert mem.moe_mla_activation_delta_bytes(model, sequence_parallel=True, experts_gathered=True, **full) == 0.0


def test_gathered_rows_cost_memory_only_where_gathered_and_bounds_hold():
    """The evaluated memory of an expert-TP-2 mapping holds the gathered rows (above the same
    mapping counted sharded), expert TP 1's does not; every search bound stays below both."""
    model = LLMModel(load_workload(moe_workload()), load_system(small_system(4, 2)))
    m0, m1 = _etp_pair(model)
    assert model._experts_gathered(m0) and not model._experts_gathered(m1)
    sharded_count = model.__class__._experts_gathered
    try:
        model.__class__._experts_gathered = lambda self, m: False
        plain = LLMModel(load_workload(moe_workload()), load_system(small_system(4, 2))).evaluate(m0)
    finally:
        model.__class__._experts_gathered = sharded_count
    assert model.evaluate(m0).memory.total_bytes > plain.memory.total_bytes
    assert_bounds_below_evaluation(model, [m0, m1])


def test_tensor_and_expert_parallelism_only_with_sequence_parallelism():
    """Megatron-Core refuses TP x EP without SP: the space never offers it (TP without EP keeps
    both), and fixing SP off there is an input error that says so, with the nearest valid knobs."""
    from dfmodel.errors import DFModelError
    from dfmodel.optimizer import optimize

    w, s = load_workload(moe_workload(**WIDE)), load_system(small_system(4, 2))
    cands = list(llm_candidates(LLMModel(w, s), Knobs(micro_batch=1, recompute="none", pp=1)))
    assert cands and all(c.sequence_parallel for c in cands if c.tp > 1 and c.ep > 1)
    assert {c.sequence_parallel for c in cands if c.tp > 1 and c.ep == 1} == {False, True}
    with pytest.raises(DFModelError, match="sequence parallelism is off.*tp 2, ep 2.*nearest valid"):
        optimize(w, s, num_chips=8, tp=2, ep=2, sequence_parallel=False)


def test_compiled_chips_keep_the_free_routing_layouts_and_sp_choice():
    """Megatron-Core's dispatcher layouts and its SP rule belong to the chips that run it
    (``Chip.eager``); a compiled stack (XLA on a TPU, a dataflow compiler) may route replicated
    and run TP x EP without SP: both stay choices there, and the routing kernels keep every
    option (the sharding picks the cheapest)."""
    from dfmodel.inter_chip.sharding import ShardingProblem, TPGroup

    spec = small_system(4, 2)
    spec["chip"]["compiled"] = True
    w, s = load_workload(moe_workload(**WIDE)), load_system(spec)
    assert not s.chip.eager
    cands = list(llm_candidates(LLMModel(w, s), Knobs(micro_batch=1, recompute="none", pp=1)))
    assert {c.sequence_parallel for c in cands if c.tp > 1 and c.ep > 1} == {False, True}
    layer = LLMModel(w, s).graphs(1).layer
    free = ShardingProblem(layer, s, TPGroup(2, ()), None, tokens_split=True, megatron_layouts=True)
    gpu = ShardingProblem(layer, load_system(small_system(4, 2)), TPGroup(2, ()), None, tokens_split=True,
                          megatron_layouts=True)
    router = free.group_of["fwd.permute"]
    assert "rep" in free.options[router] and gpu.options[gpu.group_of["fwd.permute"]] == ["tok"]
