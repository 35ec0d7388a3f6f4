"""The parallelism record: one candidate of the inter-chip search, and what the user fixed.

Everything about LLM parallelism derives from the tables below. A parallel dimension is a
:data:`DIMS` entry (its degree is a :class:`Mapping` field, its network group a ``placement``
entry); a schedule/strategy option is an :data:`OPTIONS` entry. The candidate enumeration
(:mod:`dfmodel.inter_chip.llm_space`), the ``optimize(...)`` keyword arguments, the CLI options,
the ``parallelism`` JSON block and the breakdown keys (``<dim>_comm``) are generated from these
tables, so a new dimension is: its entry here, its cost and memory terms, its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

RECOMPUTE = ("none", "selective", "full")
#: ZeRO stages (Rajbhandari et al., SC 2020, sec. 5): 0 replicated, 1 optimizer state sharded
#: (P_os = Megatron's distributed optimizer), 2 also gradients (P_os+g), 3 also parameters
#: (P_os+g+p = PyTorch FSDP FULL_SHARD).
ZERO_STAGES = (0, 1, 2, 3)
#: Context-parallel attention: Megatron-Core / Transformer Engine ``p2p`` ring (K/V blocks sent
#: around the ring, overlapped with the attention of the block in hand), or the Llama 3
#: ``all_gather`` of K/V before attention (Dubey et al. 2024, arXiv:2407.21783, sec. 3.3.2).
CP_COMM = ("ring", "all_gather")
#: Optimizer offload to host memory (:mod:`dfmodel.inter_chip.offload`): none; ``host`` =
#: ZeRO-Offload (Ren et al., ATC 2021): fp32 master weights and Adam moments on the host, the
#: step on its CPU after the backward; ``delayed`` = the same with ZeRO-Offload's one-step
#: delayed parameter update (sec. 4.3): the CPU step overlaps the next iteration. ``delayed``
#: changes the training algorithm (stale weights by one step), so only a user may choose it.
OFFLOAD_OPTIMIZER = ("none", "host", "delayed")


@dataclass(frozen=True)
class Dim:
    """A named parallel dimension: its name and what it does, for help texts and reports."""

    name: str
    help: str
    #: True when it multiplies the chip count (ep does not: it is carved out of dp x cp ranks)
    takes_chips: bool = True


#: The parallel dimensions, innermost-first default nesting. Breakdown key: ``<name>_comm``.
DIMS: tuple[Dim, ...] = (
    Dim("tp", "tensor parallelism (Megatron-LM): each GEMM split over the group"),
    Dim("cp", "context parallelism (Megatron-Core): the sequence split over the group"),
    Dim("ep", "expert parallelism: MoE experts split over ep ranks carved out of dp x cp", takes_chips=False),
    Dim("pp", "pipeline parallelism: layers split into stages (1F1B)"),
    Dim("dp", "data parallelism: the batch split over replicas"),
)
DIM_NAMES = tuple(d.name for d in DIMS)
#: dimensions whose degrees multiply to the chip count
CHIP_DIMS = tuple(d.name for d in DIMS if d.takes_chips)


@dataclass(frozen=True)
class Option:
    """A schedule / strategy option: allowed values in search order, its neutral value, help."""

    name: str
    values: tuple
    neutral: object
    help: str


#: Strategy options beyond degrees. ``values`` is what the free search tries (first = tie winner).
OPTIONS: tuple[Option, ...] = (
    Option("zero_stage", ZERO_STAGES, 0, "ZeRO stage 0-3 over the dp x cp ranks (1 = distributed optimizer, 3 = FSDP)"),
    Option("cp_comm", CP_COMM, "ring", "context-parallel K/V exchange: ring (p2p, overlapped) | all_gather"),
    # Overlap flags (Megatron-LM arguments of the same names). The free search tries both values
    # only where the model gives "on" a cost as well as a gain; where "on" dominates (never
    # slower, same memory) trying "off" cannot change the optimum, so the search fixes it on.
    Option("overlap_grad_reduce", (True,), True, "hide the DP gradient reduction behind the last backward"),
    Option("overlap_param_gather", (True,), True, "hide the distributed optimizer's parameter all-gather"),
    # Megatron's tp_comm_overlap (TE userbuffers). Not dominant: the overlapped GEMMs lose the SMs
    # the exchange uses, so the free search tries both; neutral/default off keeps the results of
    # mappings that do not set it identical to before.
    Option("tp_comm_overlap", (False, True), False,
           "split TP all-gathers / reduce-scatters into chunks overlapped with their GEMMs (TE userbuffers)"),
    # Megatron-Core's --overlap-moe-expert-parallel-comm / DeepSeek-V3's DualPipe: the MoE
    # dispatch / combine all-to-alls of one micro-batch run under another micro-batch's
    # computation, which loses the SMs the communication kernels hold
    # (dfmodel.inter_chip.experts.overlapped_a2a_exposed_s). Not dominant (that SM cost), so the
    # free search tries both where ep > 1; off is neutral (today's results unchanged).
    Option("overlap_moe_expert_parallel_comm", (False, True), False,
           "hide MoE dispatch/combine all-to-alls under another micro-batch's compute (DualPipe / Megatron-Core)"),
    # Expert tensor parallelism (Megatron-Core --expert-tensor-parallel-size): 0 = the TP degree,
    # Megatron-LM's default (arguments.py sets it to tensor_model_parallel_size when unset): experts
    # TP-split like the dense MLP, ep carved out of dp x cp; 1 = experts whole, the ep group spans
    # the TP ranks (ep x etp x edp = tp x dp x cp, parallel_state.py), as NVIDIA's DeepSeek-V3
    # recipes run (ETP 1 with TP 2). Both are tried where valid (ep > 1, tp > 1, tp | ep, SP on).
    Option("etp", (0, 1), 0, "expert tensor parallelism: 0 = same as tp (Megatron default), 1 = experts unsplit"),
    # Offload to host memory (systems with a ``host`` block only). Offload only adds time, so
    # the free search tries it only for mappings that do not fit without it
    # (dfmodel.inter_chip.offload.variants); ``delayed`` only when the user fixes it.
    Option("offload_optimizer", ("none", "host"), "none",
           "optimizer state and step on the host CPU: none | host (ZeRO-Offload) | delayed (one-step delayed update)"),
    Option("offload_activations", (False, True), False,
           "copy saved activations to host memory in forward, prefetch them in backward"),
    Option("offload_weights", (False, True), False,
           "keep layer weights and gradients in host memory, streamed per layer (ZeRO-Infinity)"),
)
OPTION_NAMES = tuple(o.name for o in OPTIONS)


class Placed:
    """Mixin for mappings with a ``placement``: ``((name, ((dim, members), ...)), ...)``."""

    placement: tuple

    def group(self, name: str) -> tuple[tuple[str, int], ...]:
        # (the last entry of that name, as dict(placement)[name] gives, without building the dict:
        # the bounds' memo keys ask it ~10^5 times a search, 1 % of DeepSeek-V3 / 8192 dragonfly)
        for n, members in reversed(self.placement):
            if n == name:
                return members
        return ()

    def dims_report(self) -> dict[str, list[str]]:
        return {name: [f"{d}:{n}" for d, n in grp] for name, grp in self.placement}


@dataclass(frozen=True, order=True)
class Mapping(Placed):
    """Parallel degrees, their network placement and the training-schedule knobs.

    ``placement`` maps every name of :data:`DIMS` to ``(dim_name, members)`` tuples, innermost
    first (``tp``, ``pp``, ``dp`` first, as before cp/ep existed, so orderings are unchanged).
    Field order is the tie-break order of equally fast mappings: the fields that existed before
    cp/ep/ZeRO stages come first, so with cp = ep = 1 the winner is the one it always was.
    """

    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    interleave: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero_stage: int = 0
    placement: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = field(default=(), compare=True)
    cp: int = 1
    ep: int = 1
    cp_comm: str = "ring"
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    tp_comm_overlap: bool = False
    overlap_moe_expert_parallel_comm: bool = False
    etp: int = 0
    offload_optimizer: str = "none"
    offload_activations: bool = False
    offload_weights: bool = False

    @property
    def whole_experts(self) -> bool:
        """Expert TP 1 with TP > 1: experts unsplit, the ep group spans the TP ranks."""
        return self.etp == 1 and self.tp > 1

    @property
    def ep_outside_tp(self) -> int:
        """The part of the ep group carved out of the dp x cp ranks (ep / tp with expert TP 1)."""
        return self.ep // self.tp if self.whole_experts else self.ep

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (Megatron-Core expert_data_parallel_size, per pipeline
        stage): ``tp x dp x cp / (ep x etp)``; with expert TP = TP, ``dp x cp / ep``."""
        return max(1, self.dp_cp // self.ep_outside_tp)

    @property
    def distributed_optimizer(self) -> bool:
        """Megatron's distributed optimizer is ZeRO stage 1 (and is implied by 2 and 3)."""
        return self.zero_stage >= 1

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same weights (Megatron-Core's data-parallel group with context
        parallelism): gradients are reduced and ZeRO shards over them."""
        return self.dp * self.cp

    def options(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in OPTION_NAMES}


@dataclass(frozen=True)
class Knobs:
    """What the user fixed (None = search it). Positional order of the first eight is the
    historical one (``Knobs(tp, pp, dp, micro_batch, recompute, sequence_parallel, interleave,
    distributed_optimizer)``); new fields are keyword-only in practice."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    interleave: int | None = None
    distributed_optimizer: bool | None = None
    cp: int | None = None
    ep: int | None = None
    zero_stage: int | None = None
    cp_comm: str | None = None
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    etp: int | None = None
    offload_optimizer: str | None = None
    offload_activations: bool | None = None
    offload_weights: bool | None = None

    def fixed(self) -> dict[str, object]:
        """The knobs the user set."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


#: Every knob name, and the value meaning "not used" (accepted by every family).
KNOB_NAMES = tuple(f.name for f in fields(Knobs))
NEUTRAL: dict[str, object] = {
    "pp": 1, "cp": 1, "ep": 1, "recompute": "none", "sequence_parallel": False, "interleave": 1,
    "distributed_optimizer": False, **{o.name: o.neutral for o in OPTIONS},
}


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
