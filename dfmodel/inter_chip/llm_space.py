"""The LLM mapping space: every :class:`~dfmodel.inter_chip.config.Mapping` the search visits.

Generated from the record tables of :mod:`dfmodel.inter_chip.config`: the chip-taking degrees
(``tp x cp x pp x dp = chips``), ``ep`` carved out of the ``dp x cp`` ranks (Megatron-Core), the
micro-batching and interleaving, recompute and sequence parallelism, every value of each
strategy option (:data:`~dfmodel.inter_chip.config.OPTIONS`) and every network placement.
"""

from __future__ import annotations

from dfmodel.errors import InputError
from dfmodel.inter_chip.config import (
    CHIP_DIMS,
    DIM_NAMES,
    OFFLOAD_OPTIMIZER,
    OPTIONS,
    RECOMPUTE,
    Knobs,
    Mapping,
    divisors,
)
from dfmodel.algorithms import interleaved_split_accounts
from dfmodel.inter_chip import offload
from dfmodel.inter_chip.offload import OFFLOAD_OPTIONS
from dfmodel.netmodels import inner_group, merge_groups, split_dims


def _choices(fixed, options):
    return [fixed] if fixed is not None else list(options)


def degree_triples(num_chips: int, knobs: Knobs, *, max_tp: int, max_pp: int, batch: int, cp: int = 1):
    """(tp, pp, dp) with tp*cp*pp*dp = num_chips honouring fixed knobs and divisibility."""
    if num_chips % cp:
        return
    chips = num_chips // cp
    for tp in _choices(knobs.tp, divisors(chips)):
        if tp > max_tp or chips % tp:
            continue
        for pp in _choices(knobs.pp, divisors(chips // tp)):
            if pp > max_pp or (chips // tp) % pp:
                continue
            dp = chips // (tp * pp)
            if knobs.dp is not None and dp != knobs.dp:
                continue
            if batch % dp:
                continue
            yield tp, pp, dp


#: Shortest sequence for which the *free* search tries cp > 1. Context parallelism is the
#: long-context tool (Llama 3: cp 16 at 128K; NeMo recipes: cp 2 at 8K, none below); on short
#: sequences it splits the same work as dp, and trying it multiplies the inner solves (new
#: per-rank graphs) for GPT-3-style 2K workloads by ~5x. A fixed ``cp`` is always honoured.
CP_FREE_MIN_SEQ_LEN = 8192


def cp_degrees(model, knobs: Knobs) -> list[int]:
    """Context-parallel degrees: the sequence splits into ``2 cp`` equal chunks (Megatron-Core's
    load-balanced causal split: rank ``r`` holds chunks ``r`` and ``2cp - 1 - r``)."""
    s, n = model.model.seq_len, model.system.num_chips
    if knobs.cp is None and s < CP_FREE_MIN_SEQ_LEN:
        return [1]
    return [c for c in _choices(knobs.cp, divisors(n)) if s % (2 * c) == 0 or c == 1]


def ep_degrees(model, knobs: Knobs, dp_cp: int, tp: int = 1) -> list[int]:
    """Expert-parallel degrees dividing the expert count: divisors of the dp x cp ranks (expert
    TP = TP), and with expert TP 1 (``etp``) also multiples of ``tp`` whose ``ep / tp`` divides
    them (the ep group spans the TP ranks: Megatron-Core, ep x etp x edp = tp x dp x cp)."""
    experts = model.num_experts
    if experts <= 1:
        if knobs.ep not in (None, 1):
            raise InputError(f"the workload has no experts to split (no model.moe block); ep must be 1, got {knobs.ep}",
                             source=getattr(model.workload, "source", None), field="ep")
        return [1]
    options = set(divisors(dp_cp)) if knobs.etp != 1 else set()
    if knobs.etp != 0 and tp > 1:
        options |= {tp * e for e in divisors(dp_cp)}
    return [e for e in _choices(knobs.ep, sorted(options)) if experts % e == 0
            and any(_etp_valid(v, tp, e, dp_cp) for v in ((knobs.etp,) if knobs.etp is not None else (0, 1)))]


def _etp_valid(etp: int, tp: int, ep: int, dp_cp: int) -> bool:
    """Expert TP 0 (= tp): ep carved out of dp x cp; 1: the ep group is the TP ranks times
    ``ep / tp`` of the dp x cp ranks (with tp = 1 the two are the same)."""
    if etp == 0 or tp == 1:
        return dp_cp % ep == 0
    return ep % tp == 0 and dp_cp % (ep // tp) == 0


def interleaves(knobs: Knobs, pp: int, m: int, num_layers: int) -> list[int]:
    """Virtual stages per pipeline stage: every ``v`` with ``v | L / pp`` (whole layers per
    chunk) and ``m % pp == 0`` (Megatron-LM's interleaved schedule). Published recipes use 5, 7,
    10, 12 (e.g. Llama 3 405B: 126 layers, pp 9 ... the layer count decides)."""
    if knobs.interleave is not None:
        v = knobs.interleave
        # a fixed v may split unevenly as Megatron-Core does (embedding / loss counted as layers)
        ok = v == 1 or (pp > 1 and m % pp == 0 and interleaved_split_accounts(num_layers, pp, v) is not None)
        return [v] if ok else []
    if pp == 1 or m % pp or num_layers % pp:
        return [1]
    return divisors(num_layers // pp)


def option_values(knobs: Knobs, deg: dict[str, int], offload_upfront: bool = False) -> list[dict[str, object]]:
    """Every combination of strategy options valid for these degrees (fixed knobs fixed).

    The historical ``distributed_optimizer`` knob fixes the ZeRO stage (True = 1, False = 0)
    unless ``zero_stage`` is given (:func:`validate_knobs` rejects a contradiction). Free
    offload options stay off here unless ``offload_upfront``: the search adds offloaded twins
    of the mappings that do not fit (:func:`dfmodel.inter_chip.offload.variants`)."""
    fixed = {o.name: getattr(knobs, o.name) for o in OPTIONS}
    if fixed["zero_stage"] is None and knobs.distributed_optimizer is not None:
        fixed["zero_stage"] = 1 if knobs.distributed_optimizer else 0
    combos: list[dict[str, object]] = [{}]
    for opt in OPTIONS:
        values = _choices(fixed[opt.name], opt.values)
        if fixed[opt.name] is None:
            if opt.name == "zero_stage" and deg["dp"] * deg["cp"] == 1:
                values = [0]  # nothing to shard over
            if opt.name in ("cp_comm", "tp_comm_overlap") and deg[opt.name[:2]] == 1:
                values = [opt.neutral]  # nothing to exchange / overlap
            if opt.name == "overlap_moe_expert_parallel_comm" and deg["ep"] == 1:
                values = [opt.neutral]  # no all-to-alls to hide
            if opt.name == "etp" and (deg["ep"] == 1 or deg["tp"] == 1):
                values = [opt.neutral]  # nothing TP-split to keep whole / the same thing
            if opt.name in OFFLOAD_OPTIONS and not offload_upfront:
                # (fixed weight offload needs the optimizer on the host: offload.check_knobs)
                values = ["host"] if opt.name == "offload_optimizer" and knobs.offload_weights else [opt.neutral]
        if opt.name == "etp":
            values = [v for v in values if _etp_valid(v, deg["tp"], deg["ep"], deg["dp"] * deg["cp"])]
        combos = [{**c, opt.name: v} for c in combos for v in values]
    return [c for c in combos if offload.valid_options(c, deg["dp"] * deg["cp"])]


def placements(system, deg: dict[str, int], etp: int = 0) -> list[tuple]:
    """Every network layout of the degrees, as ``placement`` tuples naming every dimension of
    the record (``tp``, ``pp``, ``dp`` first, then the rest; unplaced ones get ``()``). The ep
    group is the innermost ``ep`` of the dp x cp ranks, or with expert TP 1 (``etp``) the TP
    ranks times the innermost ``ep / tp`` of them."""
    chip = {"tp": deg["tp"], "pp": deg["pp"], "dp": deg["dp"]}
    chip.update({d: deg[d] for d in CHIP_DIMS if d not in chip and deg[d] > 1})
    out = []
    for place in split_dims(system, chip):
        groups = {d: tuple(place.get(d, ())) for d in CHIP_DIMS}
        if deg["ep"] > 1:
            whole = etp == 1 and deg["tp"] > 1
            outside = deg["ep"] // deg["tp"] if whole else deg["ep"]
            ep = inner_group(system, merge_groups(system, groups["cp"], groups["dp"]), outside)
            if ep is None:
                continue
            groups["ep"] = merge_groups(system, groups["tp"], ep) if whole else ep
        order = ("tp", "pp", "dp") + tuple(d for d in DIM_NAMES if d not in ("tp", "pp", "dp"))
        out.append(tuple((d, groups.get(d, ())) for d in order))
    return out


def llm_candidates(model, knobs: Knobs):
    """Every valid mapping of an LLM workload (fixed knobs fixed, the rest enumerated)."""
    system, w = model.system, model.workload
    n, L = system.num_chips, w.model.num_layers
    batch = w.training.global_batch
    heads = w.model.num_heads
    kv = getattr(w.model, "num_kv_heads", heads) or heads
    offload.check_knobs(knobs, system, source=getattr(w, "source", None))
    upfront = offload.host_step_can_win(system)
    for cp in cp_degrees(model, knobs):
        max_tp = max(d for d in divisors(heads) if d <= n // cp)
        for tp, pp, dp in degree_triples(n, knobs, max_tp=max_tp, max_pp=L, batch=batch, cp=cp):
            if heads % tp or (kv % tp and tp % kv):
                continue
            for ep in ep_degrees(model, knobs, dp * cp, tp):
                deg = {"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": dp}
                places_of = {0: placements(system, deg)}
                per_dp = batch // dp
                fixed_mb = knobs.micro_batch or getattr(w.training, "micro_batch", None)
                for mb in _choices(fixed_mb, divisors(per_dp)):
                    if per_dp % mb:
                        continue
                    m = per_dp // mb
                    for v in interleaves(knobs, pp, m, L):
                        for rc in _choices(knobs.recompute, RECOMPUTE):
                            for spar in _choices(knobs.sequence_parallel, [False, True] if tp > 1 else [False]):
                                for opts in option_values(knobs, deg, upfront):
                                    etp = opts.get("etp", 0)
                                    if etp == 1 and tp > 1 and not spar:
                                        continue  # Megatron-Core: expert TP 1 with TP needs SP
                                    if etp not in places_of:
                                        places_of[etp] = placements(system, deg, etp)
                                    for place in places_of[etp]:
                                        yield Mapping(tp, pp, dp, mb, m, v, rc, bool(spar), placement=place,
                                                      cp=cp, ep=ep, **opts)


def validate_knobs(knobs: Knobs, num_chips: int) -> None:
    """One-line InputError for a knob no mapping can take (before any search)."""
    for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "interleave"):
        v = getattr(knobs, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"must be a positive integer, got {v!r}", field=name)
    if knobs.recompute is not None and knobs.recompute not in RECOMPUTE:
        raise InputError(f"must be one of {', '.join(RECOMPUTE)}, got {knobs.recompute!r}", field="recompute")
    for opt in OPTIONS:
        v = getattr(knobs, opt.name)
        allowed = tuple(dict.fromkeys((*opt.values, opt.neutral, *((False, True) if isinstance(opt.neutral, bool) else ()))))
        if opt.name == "zero_stage":
            allowed = (0, 1, 2, 3)
        if opt.name == "offload_optimizer":
            allowed = OFFLOAD_OPTIMIZER
        if v is not None and (v not in allowed or type(v) is not type(opt.neutral)):
            raise InputError(f"must be one of {', '.join(map(str, allowed))}, got {v!r}", field=opt.name)
    if knobs.zero_stage is not None and knobs.distributed_optimizer is not None:
        if (knobs.zero_stage >= 1) != knobs.distributed_optimizer:
            raise InputError(f"ZeRO stage {knobs.zero_stage} {'shards' if knobs.zero_stage else 'does not shard'} "
                             f"the optimizer but distributed_optimizer is {knobs.distributed_optimizer}; set one of them",
                             field="zero_stage")
    for name in CHIP_DIMS:
        v = getattr(knobs, name)
        if v is not None and num_chips % v:
            raise InputError(f"must divide the {num_chips} chips, got {v}", field=name)
    fixed = {n: getattr(knobs, n) for n in CHIP_DIMS if getattr(knobs, n) is not None}
    if len(fixed) == len(CHIP_DIMS) or (len(fixed) == len(CHIP_DIMS) - 1 and "cp" not in fixed):
        total = 1
        for v in fixed.values():
            total *= v
        if total != num_chips:
            names = " x ".join(fixed)
            raise InputError(f"{names} = {total} but the system has {num_chips} chips",
                             field="/".join(n for n in ("tp", "pp", "dp") if n in fixed) if "cp" not in fixed else "/".join(fixed))


__all__ = ["llm_candidates", "degree_triples", "validate_knobs", "interleaves", "placements", "DIM_NAMES"]
