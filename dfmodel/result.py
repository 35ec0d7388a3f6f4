"""The answer of an optimisation: a plain dataclass with stable JSON keys (SI units)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

BREAKDOWN_KEYS = ("compute", "memory", "tp_comm", "pp_comm", "dp_comm", "bubble", "optimizer", "input", "checkpoint",
                  "cp_comm", "ep_comm", "offload")


@dataclass
class Parallelism:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    interleave: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    dims: dict[str, list[str]] = field(default_factory=dict)  # parallelism -> ["nvlink:8", "ib:4"]
    # the record's other dimensions and strategy options (dfmodel.inter_chip.config DIMS/OPTIONS)
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    cp_comm: str = "ring"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    etp: int = 0  # expert tensor parallelism: 0 = same as tp (Megatron default), 1 = experts unsplit
    offload_optimizer: str = "none"
    offload_activations: bool = False
    offload_weights: bool = False


@dataclass
class SolverInfo:
    backend: str
    status: str  # optimal | time_limit | ...
    gap: float
    wall_s: float
    candidates_evaluated: int
    candidates_pruned: int
    proven_optimal: bool = True
    lower_bound_s: float | None = None  # proven lower bound on the optimum (status time_limit: < iteration)


@dataclass
class Result:
    """Everything a user asks of one solve; ``to_dict`` gives the documented JSON keys.

    ``breakdown_s`` splits ``iteration_time_s`` exactly: its values add up to the iteration time.
    """

    workload: str
    system: str
    num_chips: int
    iteration_time_s: float
    samples_per_s: float
    tokens_per_s: float
    model_flops_utilization: float
    hardware_flops_utilization: float
    parallelism: Parallelism
    breakdown_s: dict[str, float]
    memory_per_chip_bytes: dict[str, float]
    sharding: dict[str, str]
    intra_chip: dict
    solver: SolverInfo
    cost_usd: float
    power_w: float
    bottleneck: str
    input_bound: bool = False
    notes: list[str] = field(default_factory=list)
    pipeline: dict = field(default_factory=dict)  # stage times, layers per stage (for timelines)
    # storage I/O: binding tier, first epoch vs steady state, checkpoint, restart, I/O energy
    # (dfmodel.inter_chip.io.io_report; empty without a storage block)
    io: dict = field(default_factory=dict)
    # runners-up, best first: {rank, iteration_time_s, slower_by, differs, bottleneck, mapping}
    alternatives: list[dict] = field(default_factory=list)
    # candidates whose bound beat the winner but that could not run: {"memory": n, "infeasible": n}
    ruled_out: dict[str, int] = field(default_factory=dict)
    # per knob value the winner does not use ("tp=8"): its best time, bound, or what ruled it out
    why_not: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["throughput"] = {"samples_per_s": d.pop("samples_per_s"), "tokens_per_s": d.pop("tokens_per_s")}
        tput = self.samples_per_s
        d["throughput_per_usd"] = tput / self.cost_usd if self.cost_usd > 0 else None
        d["throughput_per_w"] = tput / self.power_w if self.power_w > 0 else None
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)
