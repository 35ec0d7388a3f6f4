"""Run the LLM search and turn its best evaluation into a :class:`~dfmodel.result.Result`."""

from __future__ import annotations

from dfmodel.inter_chip.config import DIM_NAMES
from dfmodel.inter_chip.io import io_report
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.result import Parallelism, Result, SolverInfo
from dfmodel.system.cost import system_cost_usd, system_power_w


def model_flop_per_iteration(model: LLMModel) -> float:
    """Training FLOP of one iteration (global batch): the graph's own count, no recompute."""
    return model.graphs(1).total_flop() * model.training.global_batch


def to_result(model: LLMModel, ev, stats) -> Result:
    m = ev.mapping
    system, w = model.system, model.workload
    n = system.num_chips
    peak = system.chip.peak(model.precision)
    flop = model_flop_per_iteration(model)
    samples_per_s = w.training.global_batch / ev.iteration_time_s
    status = "optimal" if stats.proven_optimal else "time_limit"
    intra = {
        "forward": {"time_s": ev.layer.fwd.time_s, "partitions": ev.layer.fwd.partitions},
        "backward": {"time_s": ev.layer.bwd.time_s, "partitions": ev.layer.bwd.partitions},
        "partitions": ev.layer.fwd.partitions + ev.layer.bwd.partitions,
    }
    breakdown = dict(ev.breakdown_s)
    bottleneck = max(breakdown, key=breakdown.get)
    return Result(
        workload=w.name,
        system=system.name,
        num_chips=n,
        iteration_time_s=ev.iteration_time_s,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * w.model.seq_len,
        model_flops_utilization=flop / (ev.iteration_time_s * n * peak),
        hardware_flops_utilization=(flop + _recompute_flop(model, m)) / (ev.iteration_time_s * n * peak),
        parallelism=Parallelism(
            m.tp, m.pp, m.dp, m.micro_batch, m.num_micro_batches, m.interleave, m.recompute,
            m.sequence_parallel, m.distributed_optimizer, m.dims_report(),
            **{d: getattr(m, d) for d in DIM_NAMES if d not in ("tp", "pp", "dp")}, **m.options(),
        ),
        breakdown_s=breakdown,
        memory_per_chip_bytes=ev.memory.to_dict(),
        sharding={k: v for k, v in ev.layer.sharded.plan.strategy.items()},
        intra_chip=intra,
        solver=SolverInfo(
            backend=ev.layer.sharded.plan.backend if m.tp > 1 else "closed_form",
            status=status,
            gap=0.0 if stats.proven_optimal else max(ev.layer.fwd.gap, ev.layer.bwd.gap),
            wall_s=stats.wall_s,
            candidates_evaluated=stats.evaluated,
            candidates_pruned=stats.pruned,
            proven_optimal=stats.proven_optimal,
        ),
        cost_usd=system_cost_usd(system),
        power_w=system_power_w(system),
        bottleneck=bottleneck,
        input_bound=ev.input_bound,
        notes=(list(ev.io.notes) if ev.io else []) + list(ev.notes),
        io=io_report(ev.io, system, iteration_time_s=ev.iteration_time_s, compute_power_w=system_power_w(system),
                     samples=w.training.global_batch, compute_cost_usd=system_cost_usd(system)),
        pipeline={
            "layers_per_stage": ev.layers_per_stage,
            "split_moved": ev.split_moved,  # layers moved off the time-balanced split to fit memory
            "stage_forward_s": ev.stage_fwd_s,
            "stage_backward_s": ev.stage_bwd_s,
            "num_micro_batches": m.num_micro_batches,
            "interleave": m.interleave,
        },
    )


def _recompute_flop(model: LLMModel, m) -> float:
    """Extra FLOP re-run by recompute per iteration (forward of the recomputed kernels)."""
    from dfmodel.graph.kernel import Phase
    from dfmodel.inter_chip.llm import _is_attention_core

    if m.recompute == "none":
        return 0.0
    gs = model.graphs(1)
    pred = _is_attention_core if m.recompute == "selective" else (lambda k: k.phase == Phase.forward)
    # every layer kind times its count (an MoE model's dense layers apart)
    per_model = sum(sum(k.flop for k in g.kernels if pred(k)) * n
                    for g, n in ((gs.layer, gs.num_moe_layers), (gs.dense_layer, gs.num_dense_layers)) if g is not None)
    return per_model * model.training.global_batch
