"""I/O terms of one training step (input and checkpoint) and their report with I/O energy.

Every family with a training loop calls :func:`io_terms` once per evaluated mapping, next to
its step time, and adds ``input_s`` and ``checkpoint_s`` to it; :func:`io_report` turns the
best mapping's terms into the ``io`` section of the :class:`~dfmodel.result.Result`.

**Energy per step.** Compute side: the system's power (chips, memory, links, switches;
:mod:`dfmodel.system.cost`) over the iteration. I/O side: every storage tier's power (node tiers
times the nodes) and the nodes' storage NICs over the same iteration -- storage servers, caches
and NICs draw their power whether the step computes or waits, so a stalled step costs I/O energy too, the accounting EMLIO uses
(Jamil, Nine, Kosar, SC'25 workshops, arXiv:2508.11035: energy = power x time of the I/O
components). ``samples_per_j``, ``throughput_per_w`` and ``throughput_per_usd`` (storage price added to the
system's) then count compute and I/O together; the result's own ``power_w`` and ``cost_usd``
stay the compute side, as before storage tiers existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dfmodel.inter_chip.checkpoint import CheckpointCost, CheckpointState, checkpoint_cost
from dfmodel.inter_chip.input_pipeline import InputTime, input_exposed_s, input_time
from dfmodel.system.schema import System


@dataclass
class IOTerms:
    """Exposed input and amortised checkpoint seconds of one step, with their details."""

    input_s: float = 0.0
    checkpoint_s: float = 0.0
    steady: InputTime | None = None
    cold: InputTime | None = None
    checkpoint: CheckpointCost | None = None
    epoch_steps: float | None = None
    notes: list[str] = field(default_factory=list)
    legacy_binding: str = "none"  # one-block storage: "read" or "cpu"


def _legacy_binding(system: System, global_batch: int, sample_bytes: float) -> str:
    """Which half of the one-block model is slower: reading or preprocessing."""
    st = system.storage
    if sample_bytes <= 0:
        return "none"
    samples = global_batch / st.nodes(system.num_chips)
    read_s, cpu_s = samples * sample_bytes / st.read_bandwidth_Bps, samples / st.preprocess_samples_per_s
    return "read" if read_s >= cpu_s else "cpu"


def io_terms(system: System, training, global_batch: int, step_s: float, state: CheckpointState | None = None, *,
             source: str | None = None) -> IOTerms:
    """Input (steady and first epoch) and checkpoint terms for a step of ``step_s`` seconds.

    ``training`` is the workload's training block (``input_bytes_per_sample``, ``data``,
    ``checkpoint``); ``state`` what a checkpoint saves (None: the family does not say).
    No storage block: nothing is modelled (zeros), exactly as before storage tiers existed.
    """
    storage = system.storage
    out = IOTerms()
    if storage is None:
        return out
    sample_bytes = training.input_bytes_per_sample or 0.0
    data = getattr(training, "data", None)
    if not storage.tiered:
        out.input_s = input_exposed_s(system, global_batch, sample_bytes, step_s)
        out.legacy_binding = _legacy_binding(system, global_batch, sample_bytes)
    elif sample_bytes > 0:
        out.steady = input_time(system, global_batch, sample_bytes, data, step_s)
        out.cold = input_time(system, global_batch, sample_bytes, data, step_s, cold=True)
        out.input_s = out.steady.exposed_s
        samples = data.dataset_size_samples(sample_bytes) if data is not None else None
        out.epoch_steps = samples / global_batch if samples else None
    ckpt = getattr(training, "checkpoint", None)
    if ckpt is not None and state is not None:
        if storage.tiered:
            out.checkpoint = checkpoint_cost(system, ckpt, state, step_s + out.input_s, source=source)
            out.checkpoint_s = out.checkpoint.per_step_s
        else:
            out.notes.append("checkpointing not modelled: the system's storage block has no tiers")
    return out


def io_power_by_part_w(system: System) -> dict[str, float]:
    """Power of every storage tier (node tiers times the nodes) and of the nodes' storage NICs
    (``network``) attributed to this system."""
    storage = system.storage
    if storage is None:
        return {}
    nodes = storage.nodes(system.num_chips)
    parts = {t.name: t.power_for(nodes) for t in storage.tiers}
    parts["network"] = storage.node_network_power_w * nodes
    return parts


def io_power_w(system: System) -> float:
    """Total I/O power: storage tiers, caches and storage network (:func:`io_power_by_part_w`)."""
    return sum(io_power_by_part_w(system).values())


def io_price_usd(system: System) -> float:
    storage = system.storage
    if storage is None:
        return 0.0
    nodes = storage.nodes(system.num_chips)
    return sum(t.price_for(nodes) for t in storage.tiers)


def io_report(terms: IOTerms | None, system: System, *, iteration_time_s: float, compute_power_w: float,
              samples: float, compute_cost_usd: float | None = None) -> dict:
    """The ``io`` section of a result: binding tier, first epoch vs steady state, checkpoint,
    restart, I/O power, price and energy per step (module doc). Empty without a storage block."""
    if terms is None or system.storage is None:
        return {}
    io_w = io_power_w(system)
    compute_j = compute_power_w * iteration_time_s
    io_j = io_w * iteration_time_s
    total_w = compute_power_w + io_w
    out: dict = {
        "input_s": terms.input_s,
        "checkpoint_s": terms.checkpoint_s,
        "binding_tier": terms.steady.binding if terms.steady else terms.legacy_binding,
        "power_w": io_w,
        "cost_usd": io_price_usd(system),
        "energy_j_per_step": {"compute": compute_j, "io": io_j, "total": compute_j + io_j,
                              "io_by_part": {k: w * iteration_time_s for k, w in io_power_by_part_w(system).items()}},
        "samples_per_j": samples / (compute_j + io_j) if compute_j + io_j > 0 else None,
        "throughput_per_w": samples / iteration_time_s / total_w if total_w > 0 and iteration_time_s > 0 else None,
    }
    if compute_cost_usd is not None:
        total_usd = compute_cost_usd + out["cost_usd"]
        out["throughput_per_usd"] = samples / iteration_time_s / total_usd if total_usd > 0 and iteration_time_s > 0 else None
    if terms.steady is not None:
        cold_extra = max(0.0, terms.cold.exposed_s - terms.steady.exposed_s)
        out["steady_state"] = terms.steady.to_dict()
        out["first_epoch"] = terms.cold.to_dict()
        out["first_epoch_binding_tier"] = terms.cold.binding
        out["epoch_steps"] = terms.epoch_steps
        # the first epoch's extra wait over a steady epoch (per step x steps per epoch)
        out["first_epoch_extra_s"] = cold_extra * terms.epoch_steps if terms.epoch_steps else None
    if terms.checkpoint is not None:
        out["checkpoint"] = terms.checkpoint.to_dict()
    if terms.notes:
        out["notes"] = list(terms.notes)
    return out


def reprice_io(result, workload, system: System) -> tuple[float, IOTerms]:
    """Iteration time of a solved LLM ``result`` (its mapping kept) on ``system``'s storage.

    The storage terms do not change which mapping is fastest: the iteration is
    ``max(step, load) + checkpoint`` with a load that does not depend on the mapping and a
    checkpoint stall that never grows when the step shrinks (async drains overlap the whole
    iteration), and the search breaks ties by the fastest step. So one solve prices every
    storage configuration of a sweep exactly, with the step of ``result``.
    """
    from dfmodel.graph.build import build_graphs
    from dfmodel.inter_chip.checkpoint import checkpoint_state

    if getattr(workload, "kind", None) != "llm":
        raise ValueError("reprice_io handles LLM workloads (re-solve other families)")
    br = result.breakdown_s
    step_s = result.iteration_time_s - br.get("input", 0.0) - br.get("checkpoint", 0.0)
    t = workload.training
    p = result.parallelism
    state = None
    if t.checkpoint is not None:
        state = checkpoint_state(build_graphs(workload, batch=1).params(), num_chips=system.num_chips, tp=p.tp,
                                 pp=p.pp, dp=p.dp, checkpoint=t.checkpoint)
    terms = io_terms(system, t, t.global_batch, step_s, state, source=workload.source)
    return step_s + terms.input_s + terms.checkpoint_s, terms
