"""The LLM mapping space: every :class:`~dfmodel.inter_chip.config.Mapping` the search visits.

Generated from the record tables of :mod:`dfmodel.inter_chip.config`: the chip-taking degrees
(``tp x cp x pp x dp = chips``), ``ep`` carved out of the ``dp x cp`` ranks (Megatron-Core), the
micro-batching and interleaving, recompute and sequence parallelism, every value of each
strategy option (:data:`~dfmodel.inter_chip.config.OPTIONS`) and every network placement.
"""

from __future__ import annotations

import itertools
import math
from functools import cache, partial

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
from dfmodel.graph.pipeline_layout import PipelineLayout
from dfmodel.inter_chip import offload
from dfmodel.inter_chip.offload import OFFLOAD_OPTIONS
from dfmodel.inter_chip import host_floor
from dfmodel.inter_chip import experts as moe_terms
from dfmodel.inter_chip.space import SpaceNode
from dfmodel.netmodels import inner_group, merge_groups, split_dims
from dfmodel.solvers.deadline import expired


def _choices(fixed, options):
    return [fixed] if fixed is not None else list(options)


def sp_options(knobs: Knobs, deg: dict[str, int], megatron_core: bool = True) -> list[bool]:
    """Sequence-parallel choices of a degree tuple: off without TP; with ``megatron_core`` (a chip
    that runs it: ``Chip.eager``) only on where tensor and expert parallelism are combined --
    Megatron-Core refuses the rest (transformer_config.py: "When using expert parallelism and
    tensor parallelism, sequence parallelism must be used"), and its MoE layer routes each TP
    rank's own sequence shard (sharding.is_moe_routing). Empty when the user fixed it off there
    (diagnose.py says why).

    >>> sp_options(Knobs(), {"tp": 4, "ep": 8}), sp_options(Knobs(), {"tp": 4, "ep": 1}), sp_options(Knobs(), {"tp": 1, "ep": 8})
    ([True], [False, True], [False])
    >>> sp_options(Knobs(sequence_parallel=False), {"tp": 2, "ep": 2}), sp_options(Knobs(), {"tp": 4, "ep": 8}, False)
    ([], [False, True])
    """
    if deg["tp"] == 1:
        return _choices(knobs.sequence_parallel, [False])
    allowed = [True] if megatron_core and deg.get("ep", 1) > 1 else [False, True]
    return [sp for sp in _choices(knobs.sequence_parallel, allowed) if sp in allowed]


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
    if getattr(model.model, "sliding_window", None) is not None:  # (the cp rank graph assumes full attention)
        if knobs.cp not in (None, 1):
            raise InputError(f"context parallelism with sliding-window attention (model.sliding_window) is not "
                             f"modelled; cp must be 1, got {knobs.cp}", source=getattr(model.workload, "source", None),
                             field="cp")
        return [1]
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


def interleaves(knobs: Knobs, pp: int, m: int, num_layers: int, layout: PipelineLayout | None = None) -> list[int]:
    """Virtual stages per pipeline stage: every ``v`` with ``v | L / pp`` (whole layers per
    chunk) and ``m % pp == 0`` (Megatron-LM's interleaved schedule). Published recipes use 5, 7,
    10, 12 (e.g. Llama 3 405B: 126 layers, pp 9 ... the layer count decides). With the
    workload's pipeline ``layout`` only its own ``v = stages / pp`` (none where ``pp`` does not
    divide its stage count)."""
    if layout is not None:
        v = layout.interleave(pp)
        ok = v is not None and knobs.interleave in (None, v) and (v == 1 or m % pp == 0)
        return [v] if ok else []
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


def tp_overlap_possible(system, placement: tuple) -> bool:
    """Whether the TP group of ``placement`` can run Megatron's ``tp_comm_overlap``: every network
    dimension it spans allows it (``NetworkDim.comm_gemm_overlap``: TE userbuffers need peer
    memory access, e.g. NVLink inside a DGX, never InfiniBand).

    >>> from dfmodel import load_system
    >>> s = load_system("dgx_h100")
    >>> tp_overlap_possible(s, (("tp", (("nvlink", 8),)),)), tp_overlap_possible(s, (("tp", (("ib", 2),)),))
    (True, False)
    """
    dims = {d.name: d for d in system.network}
    return all(dims[name].comm_gemm_overlap for name, _ in dict(placement).get("tp", ()))


def placements(system, deg: dict[str, int], etp: int = 0) -> list[tuple]:
    """Every network layout of the degrees, as ``placement`` tuples naming every dimension of
    the record (``tp``, ``pp``, ``dp`` first, then the rest; unplaced ones get ``()``). The ep
    group is the innermost ``ep`` of the dp x cp ranks, or with expert TP 1 (``etp``) the TP
    ranks times the innermost ``ep / tp`` of them."""
    chip = {"tp": deg["tp"], "pp": deg["pp"], "dp": deg["dp"]}
    chip.update({d: deg[d] for d in CHIP_DIMS if d not in chip and deg[d] > 1})
    # degree-1 names take no members: laying out only the others gives the same layouts in the
    # same order (a permutation's first occurrence of each relative order of the rest) with
    # far fewer nesting orders to try
    busy = {d: k for d, k in chip.items() if k > 1} or chip
    out = []
    for place in split_dims(system, busy):
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


def degree_tuples(model, knobs: Knobs):
    """Every chip-taking degree tuple of the record as ``{"tp", "cp", "ep", "pp", "dp"}`` (fixed
    knobs fixed): ``tp x cp x pp x dp = chips``, tp splitting the heads (and KV heads), ep carved
    out as :func:`ep_degrees` allows. Checks the offload knobs against the system first."""
    system, w = model.system, model.workload
    n, L = system.num_chips, w.model.num_layers
    heads = w.model.num_heads
    kv = getattr(w.model, "num_kv_heads", heads) or heads
    offload.check_knobs(knobs, system, source=getattr(w, "source", None))
    for cp in cp_degrees(model, knobs):
        max_tp = max(d for d in divisors(heads) if d <= n // cp)
        for tp, pp, dp in degree_triples(n, knobs, max_tp=max_tp, max_pp=L, batch=w.training.global_batch, cp=cp):
            if heads % tp or (kv % tp and tp % kv):
                continue
            for ep in ep_degrees(model, knobs, dp * cp, tp):
                yield {"tp": tp, "cp": cp, "ep": ep, "pp": pp, "dp": dp}


def llm_candidates(model, knobs: Knobs):
    """Every valid mapping of an LLM workload (fixed knobs fixed, the rest enumerated)."""
    system, w = model.system, model.workload
    L, batch = w.model.num_layers, w.training.global_batch
    upfront = offload.host_step_can_win(system)
    fixed_mb = knobs.micro_batch or getattr(w.training, "micro_batch", None)
    for deg in degree_tuples(model, knobs):
        tp, cp, ep, pp, dp = (deg[d] for d in ("tp", "cp", "ep", "pp", "dp"))
        places_of = {0: placements(system, deg)}
        per_dp = batch // dp
        for mb in _choices(fixed_mb, divisors(per_dp)):
            if per_dp % mb:
                continue
            m = per_dp // mb
            for v in interleaves(knobs, pp, m, L, getattr(model, "pipeline_layout", None)):
                for rc in _choices(knobs.recompute, RECOMPUTE):
                    for spar in sp_options(knobs, deg, system.chip.eager):
                        for opts in option_values(knobs, deg, upfront):
                            etp = opts.get("etp", 0)
                            if etp == 1 and tp > 1 and not spar:
                                continue  # Megatron-Core: expert TP 1 with TP needs SP
                            if etp not in places_of:
                                places_of[etp] = placements(system, deg, etp)
                            for place in places_of[etp]:
                                if opts.get("tp_comm_overlap") and not tp_overlap_possible(system, place):
                                    continue
                                yield Mapping(tp, pp, dp, mb, m, v, rc, bool(spar), placement=place,
                                              cp=cp, ep=ep, **opts)


def symmetric_dims(system) -> list[list[str]]:
    """Groups of network dimensions identical in every field but their name (e.g. the x, y, z
    rings of a TPU torus): the cost model reads a dimension's properties, never its name or
    position, so relabelling identical dimensions maps a placement to one that costs the same."""
    groups: dict[str, list[str]] = {}
    for d in system.network:
        sig = repr(sorted((k, v) for k, v in d.model_dump().items() if k != "name"))
        groups.setdefault(sig, []).append(d.name)
    return [names for names in groups.values() if len(names) > 1]


def canonical_placement(placement: tuple, classes: list[list[str]]) -> tuple:
    """The smallest relabelling of ``placement`` over permutations of each class of identical dims.

    >>> p = (("tp", (("y", 2),)), ("dp", (("x", 2),)))
    >>> canonical_placement(p, [["x", "y"]])
    (('tp', (('x', 2),)), ('dp', (('y', 2),)))
    """
    options = []
    for perms in itertools.product(*(itertools.permutations(c) for c in classes)):
        rename = {a: b for c, perm in zip(classes, perms) for a, b in zip(c, perm)}
        options.append(tuple((g, tuple((rename.get(d, d), n) for d, n in grp)) for g, grp in placement))
    return min(options)


#: the stages of a micro-batch group's refine on dataflow chips, each ``(comm, plans)`` of
#: ``LLMModel.pass_floor_s``, cheapest first: the group is re-queued under each stage's bound and
#: asks the next one only if it reaches the top again below the cutoff. Without the plan floors'
#: shortest paths first (plans False): on DeepSeek-V3 / 512 dragonfly it puts 4133 of the 6990
#: groups refined above the optimum, the plan floors 5452. Never with the TP collectives (comm
#: True, one floor per TP group of every placement): a third stage with them was 1.3-1.5 CPU s
#: there and at 8192 for 72 and 89 groups pruned, which the sub groups' refines
#: (:meth:`_sub_node`, with them, per recompute and SP) prune as well
_DATAFLOW_REFINES = ((False, False), (False, True))
#: the stages of a sub group's refine (:meth:`LLMSpace._sub_node`) on dataflow chips, as
#: :data:`_DATAFLOW_REFINES`: first its recompute's and SP's floor without the TP collectives
#: (its micro-batch group's refine took it already: a memo look-up), then with them
_DATAFLOW_SUB_REFINES = ((False, True), (True, True))


def _refine_stage(node, refine, stages: tuple, stage: int | None) -> tuple[bool, bool]:
    """The ``(comm, plans)`` floor flags of a group's refine at ``stage`` of ``stages`` (None: the
    full floor in one step, as on GPUs), leaving the next, costlier stage as ``node.refine`` for
    when the group reaches the top again below the cutoff."""
    if stage is None:
        return True, True
    if stage + 1 < len(stages):
        node.refine = partial(refine, stage + 1)
    return stages[stage]


def _pipeline_s(m: int, pp: int, v: int, stage_s: float, last_s: float = 0.0) -> float:
    """A group's 1F1B bound ``(M + (pp - 1) / v) T`` on its mean stage time ``T``, or with plain
    1F1B's last stage at least ``last_s`` (``pipeline_time = (M - 1) T* + sum T``, ``T* >=
    T_last``, ``sum T >= pp T``) ``(M - 1) last_s + pp T`` when that is larger."""
    if v == 1 and pp > 1 and last_s > stage_s:
        return (m - 1) * last_s + pp * stage_s
    return (m + (pp - 1) / v) * stage_s


class LLMSpace:
    """The mapping space of :func:`llm_candidates` as a tree of :class:`SpaceNode` groups (lazy
    branch and bound, :mod:`dfmodel.inter_chip.space`), placements distinct up to relabelling
    identical network dimensions (as :func:`~dfmodel.inter_chip.llm_family.distinct_up_to_symmetry`).

    Levels: ``roots()`` gives one group per (cp, tp, pp, dp, ep); it expands into one group per
    micro-batch size, which expands into one leaf group per (interleave, recompute, ZeRO stage,
    sequence parallelism), whose bound and memory floor are the model's own ``lower_bound_s`` /
    ``memory_floor_bytes`` (they read no other knob; MoE adds the exposed all-to-alls of its
    cheapest placement, :meth:`_exposed_ep_s`; the pre-solve memory screen
    ``memory_before_blocks`` is applied when the group is reached), and which expands into its
    mappings (the other options x placements).

    A root's bound relaxes the inner knobs independently: ``LLMModel.lower_bound_s`` is
    ``(M + (pp - 1) / v) F(mb, rc) / (tp cp pp) + opt(zero)`` with ``F(mb, rc) >= mb F(1, none)``
    (every kernel's FLOP is linear in the micro-batch and recompute only adds; test_search.py
    checks both), so the largest ``v``, ``mb F(1, rc_min)``, the cheapest optimizer step over
    the ZeRO stages and (MoE) the cheapest exposed all-to-alls give a bound below every child's (a degree root: also the least over the
    micro-batch sizes). Its memory floor is the least over the ZeRO stages of the children's
    (the floor does not read interleave or recompute; a degree root takes the smallest
    micro-batch, whose activations in flight are the fewest). Counts are
    products of the knob choices, so pruned groups are counted without building a mapping.
    """

    def __init__(self, model, knobs: Knobs):
        self.model, self.knobs = model, knobs
        self.system = model.system
        self._classes = symmetric_dims(self.system)
        self._places: dict[tuple, list[tuple]] = {}
        self._ep_memo: dict[tuple, tuple] = {}
        self._probe_memo: dict[int, tuple[dict, dict[tuple, Mapping]]] = {}  # (_probe)
        self.roots_built: list[SpaceNode] = []
        # offload (dfmodel.inter_chip.offload): enumerated up front only where the host's step
        # can beat the chip's; otherwise a group pruned for memory is relieved by its offloaded twin
        self.upfront = offload.host_step_can_win(self.system)
        self.relief_on = self.system.host is not None and not self.upfront
        self._bounds_off = False  # leanest(): groups built to pick a mapping, not to be searched
        #: (least host floor, host share per chip) of the offloaded twins dropped because their
        #: state cannot fit the host (None: none dropped): what an infeasibility message adds
        self.host_short: tuple[float, float] | None = None

    def __iter__(self):
        """Every mapping of the space (what ``search(..., exhaustive=True)`` enumerates), relief
        groups aside."""
        for root in self.roots():
            yield from mappings_under(root)

    # -- pieces shared by a degree tuple ---------------------------------------------------------
    def placements(self, deg: dict[str, int], etp: int = 0) -> list[tuple]:
        """Placements of the degrees, one per class of twins under relabelling identical dims."""
        key = (tuple(sorted(deg.items())), etp)
        if key not in self._places:
            places, seen = [], set()
            for p in placements(self.system, deg, etp):
                c = canonical_placement(p, self._classes) if self._classes else p
                if c not in seen:
                    seen.add(c)
                    places.append(p)
            self._places[key] = places
        return self._places[key]

    @staticmethod
    def _key(o: dict) -> tuple:
        """The options the model's bound and memory floor read: (ZeRO stage, expert TP, offload,
        tp_comm_overlap: the TP-collective floor holds without it only)."""
        return (o["zero_stage"], o.get("etp", 0), o.get("offload_optimizer", "none"),
                o.get("offload_activations", False), o.get("offload_weights", False), o.get("tp_comm_overlap", False))

    def _by_key(self, opts: list[dict]) -> dict[tuple, list[dict]]:
        """``opts`` grouped by :meth:`_key`, keys in order of first appearance, each group in
        ``opts``' order (one pass: a leaf group per key); memoised on the list's identity (kept
        alive by the memo), so each group's list is one object (:meth:`_relief_opts`' key)."""
        memo = self.__dict__.setdefault("_by_key_memo", {})
        if id(opts) not in memo:
            out: dict[tuple, list[dict]] = {}
            for o in opts:
                out.setdefault(self._key(o), []).append(o)
            memo[id(opts)] = (opts, out)
        return memo[id(opts)][1]

    def _probe(self, deg, mb, m, v, rc, key, sp: bool = False) -> Mapping:
        """A mapping with the knobs the bound and floor read (placement and the rest neutral),
        memoised on exactly those arguments (Mapping is frozen, so one object serves every
        group asking for it: building its 21 fields cost 7% of DeepSeek-V3 / 1024 H100's search).
        Two levels: per degree dict (one object per degree tuple, shared by every group under its
        root; held by the memo, so its id is never reused while the entry lives), then the rest:
        reading five degrees into every key cost 3% of DeepSeek-V3 / 64 B200's search."""
        per_deg = self._probe_memo.get(id(deg))
        if per_deg is None:
            per_deg = self._probe_memo[id(deg)] = (deg, {})
        memo_key = (mb, m, v, rc, key, sp)
        hit = per_deg[1].get(memo_key)
        if hit is None:
            zero, etp, oo, oa, ow, ub = key
            hit = per_deg[1][memo_key] = Mapping(
                deg["tp"], deg["pp"], deg["dp"], mb, m, v, rc, sp, zero_stage=zero, cp=deg["cp"], ep=deg["ep"],
                etp=etp, offload_optimizer=oo, offload_activations=oa, offload_weights=ow, tp_comm_overlap=ub)
        return hit

    def _pairs(self, tp: int, sps, opts, places_by) -> list[tuple]:
        """(sequence parallelism, options, placements) that make valid mappings: expert TP 1 with
        TP needs SP (Megatron-Core); tp_comm_overlap only where the TP group can run it
        (:func:`tp_overlap_possible`)."""
        return [(spar, o, self._overlap_places(places_by[o.get("etp", 0)]) if o.get("tp_comm_overlap")
                 else places_by[o.get("etp", 0)])
                for spar in sps for o in opts if not (o.get("etp", 0) == 1 and tp > 1 and not spar)]

    def _pair_count(self, tp: int, sps, opts, places_by) -> int:
        """Mappings per (interleave, recompute) of :meth:`_pairs`: what a group's count reads
        (:meth:`_pairs_counted`)."""
        return self._pairs_counted(tp, sps, opts, places_by)[1]

    def _pairs_counted(self, tp: int, sps, opts, places_by) -> tuple[list[tuple], int]:
        """:meth:`_pairs` and the mappings they make, memoised on the option list's and the
        placements' identity (both kept alive by the memo, so an id is never reused while its
        entry lives): every micro-batch group of a degree tuple counts the same lists (building
        the pairs each time was 10% of DeepSeek-V3 / 512 B200's search), and every leaf group of
        one option list shares its pairs (read only, :meth:`_mappings`)."""
        memo = self.__dict__.setdefault("_pairs_memo", {})
        key = (tp, tuple(bool(x) for x in sps), id(opts), id(places_by))
        hit = memo.get(key)
        if hit is None:
            pairs = self._pairs(tp, sps, opts, places_by)
            hit = memo[key] = (opts, places_by, pairs, sum(len(pl) for _, _, pl in pairs))
        return hit[2], hit[3]

    def _overlap_places(self, places: list[tuple]) -> list[tuple]:
        memo = self.__dict__.setdefault("_overlap_memo", {})
        key = id(places)  # the lists live as long as the space (self._places)
        if key not in memo:
            memo[key] = (places, [p for p in places if tp_overlap_possible(self.system, p)])
        return memo[key][1]

    def _relief_opts(self, deg, opts) -> list[dict]:
        """The offloaded twins of ``opts`` (:func:`~dfmodel.inter_chip.offload.variants`; they
        read the options and dp x cp only, so they are memoised on those)."""
        # (keyed on the list's identity, kept alive by the memo: the option lists are built once
        # per degree tuple and filtered once per group kind, _mine; hashing their items cost more)
        key = (deg["tp"], deg["pp"], deg["dp"], deg["cp"], deg["ep"], id(opts))
        memo = self.__dict__.setdefault("_twins", {})
        if key not in memo:
            memo[key] = (opts, self._relief_opts_of(deg, opts))
        return memo[key][1]

    def _mine(self, opts: list[dict], ub: bool, oa: bool) -> list[dict]:
        """The options of ``opts`` with this tp_comm_overlap and activation offload, one list
        object per (``opts``, ub, oa) (:meth:`_relief_opts` is memoised on it)."""
        key = (id(opts), ub, oa)
        memo = self.__dict__.setdefault("_mine_memo", {})
        if key not in memo:
            memo[key] = (opts, [o for o in opts if o.get("tp_comm_overlap", False) == ub
                                and o.get("offload_activations", False) == oa])
        return memo[key][1]

    def _relief_opts_of(self, deg, opts) -> list[dict]:
        out, seen = [], set()
        for o in opts:
            probe = Mapping(deg["tp"], deg["pp"], deg["dp"], 1, 1, cp=deg["cp"], ep=deg["ep"], **o)
            for twin in offload.variants(probe, self.knobs, self.system):
                t = {**o, **{n: getattr(twin, n) for n in OFFLOAD_OPTIONS}}
                k = tuple(sorted(t.items()))
                if k not in seen and self._host_may_fit(twin):
                    seen.add(k)
                    out.append(t)
        return out

    def _host_may_fit(self, twin: Mapping) -> bool:
        """Whether ``twin``'s offloaded state may fit its host share (:mod:`host_floor`); the
        least host floor of the twins dropped is kept for the no-mapping message."""
        need = host_floor.host_floor_bytes(self.model, twin)
        share = host_floor.host_share_bytes(self.system)
        if share is None or need <= share:
            return True
        self._note_host_short(need, share)
        return False

    def _relief(self, build, deg, opts, *args):
        """``build`` (a node builder taking ``opts`` and ``relief``) on the offloaded twins, or
        None when there are none."""
        twins = self._relief_opts(deg, opts)
        return build(*args, twins, False) if twins else None

    # -- the tree --------------------------------------------------------------------------------
    def roots(self) -> list[SpaceNode]:
        """One group per degree tuple (cp, tp, pp, dp, ep)."""
        model, knobs = self.model, self.knobs
        w = model.workload
        L, batch = w.model.num_layers, w.training.global_batch
        rcs = _choices(knobs.recompute, RECOMPUTE)
        fixed_mb = knobs.micro_batch or getattr(w.training, "micro_batch", None)
        out = []
        layout = getattr(model, "pipeline_layout", None)
        for deg in degree_tuples(model, knobs):
            per_dp = batch // deg["dp"]
            mbs = []  # (micro-batch, micro-batches, interleaves)
            for mb in _choices(fixed_mb, divisors(per_dp)):
                if per_dp % mb == 0 and (vs := interleaves(knobs, deg["pp"], per_dp // mb, L, layout)):
                    mbs.append((mb, per_dp // mb, vs))
            if not mbs:
                continue
            opts = option_values(knobs, deg, self.upfront)
            places_by = {e: self.placements(deg, e) for e in dict.fromkeys(o.get("etp", 0) for o in opts)}
            if not any(places_by.values()):
                continue
            sps = sp_options(knobs, deg, self.model.system.chip.eager)
            if not sps:
                continue
            node = self._root(deg, mbs, rcs, sps, places_by, opts, self.relief_on)
            if node is not None:
                out.append(node)
        self.roots_built = out
        return out

    def _root(self, deg, mbs, rcs, sps, places_by, opts, relief: bool) -> SpaceNode | None:
        """A degree group: the bound and floor of its micro-batch groups, least over them."""
        tp, cp, pp = deg["tp"], deg["cp"], deg["pp"]
        per_leaf = len(rcs) * self._pair_count(tp, sps, opts, places_by)
        if not per_leaf:
            return None
        model = self.model
        f1 = min(model.compute_floor_s(1, rc) for rc in rcs)
        keys = self._keys(opts)
        # bound: (M + (pp-1)/v) mb F(1) = per_dp F(1) + (pp-1) mb F(1) / v, least over the
        # (mb, v) pairs; the optimizer step at its cheapest ZeRO stage / offload
        avg_s = f1 / (tp * cp * pp)
        probes = [self._probe(deg, mbs[0][0], mbs[0][1], 1, rcs[0], k, sp) for k in keys for sp in sps]
        opt_s = self._opt_min_s(deg, opts, probes)
        # (compute only: the per-kernel floors of every root's blocks and micro-batches cost more
        # up front than they prune -- a 1 s limit needs the roots in ~0.1 s; the micro-batch
        # groups add them, _pass_floor_min)
        pipe_s = min((m + (pp - 1) / max(vs)) * (mb * avg_s + self._ep_layers_s(deg, mb, m, rcs, places_by, opts))
                     + self._p2p_floor_s(deg, mb, m, vs) for mb, m, vs in mbs)
        # floor: the activations in flight, mb min(pp - i, M) = min((pp - i) mb, batch / dp),
        # never shrink with mb (memory.memory_lower_bound_bytes), so the smallest mb's
        floor = min(model.memory_floor_bytes(p) for p in probes)
        count = sum(len(vs) for _, _, vs in mbs) * per_leaf
        fixed = (("tp", tp), ("pp", pp), ("dp", deg["dp"]), ("cp", cp), ("ep", deg["ep"]))
        return SpaceNode((pipe_s + opt_s) * (1 - 1e-12), floor, count, fixed,
                         partial(self._expand_degrees, deg, mbs, rcs, sps, places_by, opts, relief, floor),
                         relief=partial(self._relief, self._root, deg, opts, deg, mbs, rcs, sps, places_by)
                         if relief else None)

    def _opt_floor_s(self, p: Mapping) -> float:
        """``LLMModel.optimizer_s`` at the fewest parameters a chip holds, memoised on the fields
        it reads (degrees, expert TP, ZeRO stage, offload): every micro-batch group of a degree
        tuple asks it again for the same probes."""
        key = (p.tp, p.pp, p.dp, p.cp, p.ep, p.etp, p.zero_stage, p.offload_optimizer, p.offload_activations,
               p.offload_weights)
        memo = self.__dict__.setdefault("_opt_memo", {})
        if key not in memo:
            memo[key] = self.model.optimizer_s(p, self.model.params_per_chip_floor(p))
        return memo[key]

    def _keys(self, opts: list[dict]) -> list[tuple]:
        """The distinct :meth:`_key` of ``opts``, in order of first appearance; memoised on the
        list's identity (kept alive by the memo): each group builder asks it of its option list."""
        memo = self.__dict__.setdefault("_keys_memo", {})
        hit = memo.get(id(opts))
        if hit is None:
            hit = memo[id(opts)] = (opts, list(dict.fromkeys(self._key(o) for o in opts)))
        return hit[1]

    def _opt_min_s(self, deg, opts: list[dict], probes: list[Mapping]) -> float:
        """Least :meth:`_opt_floor_s` over ``probes`` (``opts``' keys at one micro-batching):
        it reads the degrees and the key only, so the least is memoised on the degrees and the
        option list's identity, shared by every micro-batch, recompute and SP group."""
        memo = self.__dict__.setdefault("_opt_min_memo", {})
        key = (deg["tp"], deg["pp"], deg["dp"], deg["cp"], deg["ep"], id(opts))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = (opts, min(self._opt_floor_s(p) for p in (probes() if callable(probes) else probes)))
        return hit[1]

    def _offload_floor_min_s(self, opts: list[dict], probes: list[Mapping]) -> float:
        """Least ``LLMModel.offload_stage_floor_s`` over ``probes`` (``opts``' keys): 0 without
        computing any when some key offloads nothing (its floor is 0, every floor >= 0)."""
        if not all(k[2] != "none" or k[3] or k[4] for k in self._keys(opts)):
            return 0.0
        return min(self.model.offload_stage_floor_s(p) for p in (probes() if callable(probes) else probes))

    def _pass_floor_min(self, deg, mb, m, rcs, sps, keys, comm: bool = True, plans: bool = True) -> float:
        """Least ``LLMModel.pass_floor_s / pp`` (per-kernel traffic and forced TP collectives) over
        a group's recompute, sequence parallelism, expert TP and tp_comm_overlap choices: a
        stage's mean time of every mapping in the group is at least this. The floor grows with
        recompute (it only adds kernels) and drops the layer's TP collectives under
        tp_comm_overlap, so the least recompute and overlap on (when offered) stand for all.
        ``comm``, ``plans``: as ``LLMModel.pass_floor_s``'s (False: weaker, cheaper floors)."""
        if self._bounds_off:
            return 0.0
        # (dataflow chips: full recompute may keep every layer's stash in SRAM where "none" keeps
        # only some, so its floor can be lower: take the least over every recompute there)
        dataflow = self.model.system.chip.execution == "dataflow"
        rcs_min = ["none"] if "none" in rcs and not dataflow else list(rcs)
        ub = any(k[5] for k in keys) and deg["tp"] > 1
        best = None
        for rc in rcs_min:
            for sp in sps:
                for etp in dict.fromkeys(k[1] for k in keys):
                    pf = self.model.pass_floor_s(self._probe(deg, mb, m, 1, rc, (0, etp, "none", False, False, ub), bool(sp)),
                                                 comm=comm, plans=plans)
                    if pf is None:
                        return 0.0
                    best = pf if best is None else min(best, pf)
        return 0.0 if best is None else best / deg["pp"]

    def _expand_degrees(self, deg, mbs, rcs, sps, places_by, opts, relief, floor_bytes: float = 0.0) -> list[SpaceNode]:
        """One group per micro-batch size (bound and floor as the root's, for that size;
        ``floor_bytes``: the root's, which each of them starts with, :meth:`_micro_batch_node`)."""
        out = []
        for mb, m, vs in mbs:
            node = self._micro_batch_node(deg, mb, m, vs, rcs, sps, places_by, opts, relief, floor_bytes)
            if node is not None:
                out.append(node)
        return out

    def _micro_batch_node(self, deg, mb, m, vs, rcs, sps, places_by, opts, relief,
                          parent_floor_bytes: float = 0.0) -> SpaceNode | None:
        """A micro-batch group. Its own memory floor (least over its ZeRO stages / options and
        recompute / SP choices) is its ``screen``, computed when the group first reaches the top
        of the queue below the cutoff, not when it is built: it starts with its parent's floor
        (``parent_floor_bytes``, a floor of every mapping under the parent), so the ~40% of the
        groups the cutoff prunes never pay for it (DeepSeek-V3 / 512 H100: 3247 of 8307). The
        refine asks the floor first and leaves the bound as it is when the floor does not fit:
        the search then prunes the group for memory (relief: its offloaded twins) as before."""
        model = self.model
        tp, cp, pp = deg["tp"], deg["cp"], deg["pp"]
        per_leaf = len(rcs) * self._pair_count(tp, sps, opts, places_by)
        if not per_leaf:
            return None
        f1 = min(model.compute_floor_s(1, rc) for rc in rcs)
        keys = self._keys(opts)
        # (built only when asked: the optimizer floor is memoised per option list, and the memory
        # floor is deferred to the screen, which the groups the cutoff prunes never reach)
        probes = cache(lambda: [self._probe(deg, mb, m, 1, rcs[0], k, sp) for k in keys for sp in sps])
        opt_s = self._opt_min_s(deg, opts, probes)
        ep_s = self._ep_layers_s(deg, mb, m, rcs, places_by, opts)
        p2p_s = self._p2p_floor_s(deg, mb, m, vs)

        def bound_with(stage_s: float, last_s: float = 0.0) -> float:
            return (_pipeline_s(m, pp, max(vs), stage_s + ep_s, last_s) + p2p_s + opt_s) * (1 - 1e-12)

        compute_s = mb * f1 / (tp * cp * pp)
        floor = cache(partial(self._micro_batch_floor_bytes, deg, mb, m, rcs, keys, sps))  # (asked by refine and screen)
        fixed = (("tp", tp), ("pp", pp), ("dp", deg["dp"]), ("micro_batch", mb), ("num_micro_batches", m),
                 ("cp", cp), ("ep", deg["ep"]))
        capacity = self.system.chip.memory.capacity_bytes

        def refine(stage: int | None = None) -> float:  # (stage: of _DATAFLOW_REFINES; None: the full floor)
            # (the floor first: a group that cannot fit is pruned, not refined)
            if floor() > capacity:
                return 0.0
            comm, plans = _refine_stage(node, refine, _DATAFLOW_REFINES, stage)
            return bound_with(max(compute_s, self._pass_floor_min(deg, mb, m, rcs, sps, keys, comm, plans)),
                              self._last_stage_min_s(deg, mb, m, vs, rcs, sps, keys, ep_s))

        # compute only until the group reaches the top: the per-kernel / TP floors then (refine);
        # on dataflow chips in the stages of _DATAFLOW_REFINES, cheapest first
        staged = self.model.system.chip.execution == "dataflow"
        node = SpaceNode(bound_with(compute_s), floor() if self._bounds_off else parent_floor_bytes,
                         len(vs) * per_leaf, fixed,
                         partial(self._expand_micro_batch, deg, mb, m, vs, rcs, sps, places_by, opts, relief, floor),
                         screen=None if self._bounds_off else floor,
                         relief=partial(self._relief, self._micro_batch_node, deg, opts, deg, mb, m, vs, rcs, sps,
                                        places_by) if relief else None,
                         refine=None if self._bounds_off else partial(refine, 0) if staged else refine)
        return node

    def _micro_batch_floor_bytes(self, deg, mb, m, rcs, keys, sps) -> float:
        """A micro-batch group's memory floor: the least over its options (``keys``) of the
        model's floor, and over its recompute and SP choices of their activation floors. Neither
        floor reads tp_comm_overlap and the model's reads no SP (``LLMModel.memory_floor_bytes``),
        so each option key without it stands for both, and ``min_sp max(f, a_sp) = max(f, min_sp
        a_sp)``: the same value from fewer probes (one per option and SP was 5 % of DeepSeek-V3 /
        512 dragonfly's serial search)."""
        model = self.model
        out = math.inf
        acts_by_offload: dict[bool, float] = {}  # (the activation floor reads no other option: once per offload choice)
        for key in dict.fromkeys(k[:5] + (False,) for k in keys):
            oa = key[3]
            if oa not in acts_by_offload:
                probes = [self._probe(deg, mb, m, 1, rcs[0], key, sp) for sp in sps]
                acts_by_offload[oa] = min(model.activation_floor_bytes(p, rc) for p in probes for rc in rcs)
            floor = model.memory_floor_bytes(self._probe(deg, mb, m, 1, rcs[0], key, sps[0]))
            out = min(out, max(floor, acts_by_offload[oa]))
        return out

    def _last_stage_min_s(self, deg, mb, m, vs, rcs, sps, keys, ep_stage_s: float) -> float:
        """Least per-micro-batch time of plain 1F1B's last stage over a group's recompute, SP,
        expert TP and tp_comm_overlap choices (``LLMModel.last_stage_floor_min_s``; it grows with
        recompute, which only adds kernels, so the least recompute stands for all on GPUs), with
        the group's all-to-alls per MoE layer (``ep_stage_s`` per stage, :meth:`_ep_layers_s`).
        0 unless every mapping of the group runs plain 1F1B on GPUs with pp > 1 (MoE models)."""
        model = self.model
        if (self._bounds_off or max(vs) != 1 or deg["pp"] <= 1 or model.num_experts <= 1
                or model.system.chip.execution == "dataflow"):
            return 0.0
        ep_layer_s = ep_stage_s * deg["pp"] / model.num_moe_layers if model.num_moe_layers else 0.0
        rcs_min = ["none"] if "none" in rcs else list(rcs)
        best = None
        for rc in rcs_min:
            for sp in sps:
                for etp, ub in dict.fromkeys((k[1], k[5]) for k in keys):
                    probe = self._probe(deg, mb, m, 1, rc, (0, etp, "none", False, False, ub), bool(sp))
                    last = model.last_stage_floor_min_s(probe, ep_layer_s)
                    if last is None:
                        return 0.0
                    best = last if best is None else min(best, last)
        return 0.0 if best is None else best

    def _expand_micro_batch(self, deg, mb, m, vs, rcs, sps, places_by, opts, relief, floor=None) -> list[SpaceNode]:
        """Leaf groups per (interleave, recompute, ZeRO stage / expert TP / offload, sequence
        parallelism): the model's bound and floor read exactly these knobs (and the degrees and
        micro-batching); the pre-solve memory screen (``LLMModel.memory_before_blocks``) is the
        group's ``screen``, computed only if the group is reached.
        Between the micro-batch group and its leaves sits one group per (recompute, sequence
        parallelism, tp_comm_overlap): the knobs the per-kernel and TP floors read
        (:meth:`_sub_node`), so most leaves are pruned without being built. ``floor``: the
        group's deferred memory floor (computed by its screen), each sub group's first floor."""
        out = []
        parent_floor = 0.0 if floor is None else floor()
        # (offloaded twins: the groups with activations on the chip apart from those offloading
        # them, so the former's activation floor prunes them before their leaves are built)
        oas = list(dict.fromkeys(o.get("offload_activations", False) for o in opts))
        for rc in rcs:
            for spar in sps:
                for ub in dict.fromkeys(o.get("tp_comm_overlap", False) for o in opts):
                    for oa in oas:
                        node = self._sub_node(deg, mb, m, vs, rc, spar, ub, places_by, opts, relief, oa, parent_floor)
                        if node is not None:
                            out.append(node)
        return out

    def _sub_node(self, deg, mb, m, vs, rc, spar, ub, places_by, opts, relief, oa=False,
                  parent_floor_bytes: float = 0.0) -> SpaceNode | None:
        """The leaves of one (recompute, SP, tp_comm_overlap, activation offload): bound with the
        largest interleave, the cheapest optimizer step and the least exposed all-to-alls over
        its options (each leaf's bound reads the same floors with its own v and options, never less).
        Its own memory floor is deferred to its screen as a micro-batch group's is
        (:meth:`_micro_batch_node`; it starts with the parent's, ``parent_floor_bytes``), and so
        are the probes it is taken on: a third of these groups lie above the optimum, and
        building their probes was 8% of DeepSeek-V3 / 512 H100's search."""
        model = self.model
        tp, cp, pp = deg["tp"], deg["cp"], deg["pp"]
        mine = self._mine(opts, ub, oa)
        count = len(vs) * self._pair_count(tp, [spar], mine, places_by)
        if not count:
            return None
        keys = self._keys(mine)
        probes = cache(lambda: [self._probe(deg, mb, m, 1, rc, k, bool(spar)) for k in keys])
        # (offloaded twins: a stage is never shorter than its layers' host transfers, least over
        # the options; LLMModel.lower_bound_s holds it for each leaf)
        compute_s = model.compute_floor_s(mb, rc) / (tp * cp * pp)
        off_s = self._offload_floor_min_s(mine, probes)
        opt_s = self._opt_min_s(deg, mine, probes)
        ep_s = self._ep_layers_s(deg, mb, m, [rc], places_by, mine)
        p2p_s = self._p2p_floor_s(deg, mb, m, vs)

        def bound_with(work_s: float, last_s: float = 0.0) -> float:
            # (host transfers hide behind a layer's whole pass, all-to-alls included:
            # LLMModel.offload_ep_overlap_s)
            stage_s = work_s + ep_s if off_s <= work_s else max(work_s + ep_s, off_s)
            return (_pipeline_s(m, pp, max(vs), stage_s, last_s) + p2p_s + opt_s) * (1 - 1e-12)

        # (rc and SP fixed: their activations)
        floor = cache(lambda: max(parent_floor_bytes, min(model.leaf_floor_bytes(p) for p in probes())))
        fixed = (("tp", tp), ("pp", pp), ("dp", deg["dp"]), ("micro_batch", mb), ("num_micro_batches", m),
                 ("recompute", rc), ("sequence_parallel", bool(spar)), ("tp_comm_overlap", ub), ("cp", cp),
                 ("ep", deg["ep"]))
        capacity = self.system.chip.memory.capacity_bytes

        def refine(stage: int | None = None) -> float:  # (stage: of _DATAFLOW_SUB_REFINES; None: the full floor)
            # (the floor first: a group that cannot fit is pruned, not refined)
            if floor() > capacity:
                return 0.0
            comm, plans = _refine_stage(node, refine, _DATAFLOW_SUB_REFINES, stage)
            return bound_with(max(compute_s, self._pass_floor_min(deg, mb, m, [rc], [spar], keys, comm, plans)),
                              self._last_stage_min_s(deg, mb, m, vs, [rc], [spar], keys, ep_s))

        staged = self.model.system.chip.execution == "dataflow"
        node = SpaceNode(bound_with(compute_s), floor() if self._bounds_off else parent_floor_bytes, count, fixed,
                         partial(self._expand_sub, deg, mb, m, vs, rc, spar, places_by, mine, relief),
                         screen=None if self._bounds_off else floor,
                         relief=partial(self._relief_sub, deg, mb, m, vs, rc, spar, ub, places_by, mine) if relief else None,
                         refine=None if self._bounds_off else partial(refine, 0) if staged else refine)
        return node

    def _expand_sub(self, deg, mb, m, vs, rc, spar, places_by, mine, relief) -> list[SpaceNode]:
        """One leaf group per (interleave, ZeRO stage / expert TP / offload)."""
        out = []
        by_key = self._by_key(mine)
        for v in vs:
            for key, same in by_key.items():
                node = self._leaf(deg, mb, m, v, rc, key, spar, places_by, same, relief)
                if node is not None:
                    out.append(node)
        return out

    def _relief_sub(self, deg, mb, m, vs, rc, spar, ub, places_by, mine) -> SpaceNode | None:
        """The offloaded twins of every mapping of a group pruned for memory: a group whose
        children, one group per activation offload over the twins' options (:meth:`_sub_node`),
        are built only when it reaches the top of the queue below the cutoff. Its bound is each
        child's without the optimizer step and host-transfer floors (:meth:`_twin_pipeline_s`:
        both >= 0 and the children's bound grows with them), refined with the per-kernel floor
        as theirs are: on DeepSeek-V3 / 512 H100 4083 of the 9115 twin groups lie above the
        optimum on it and were built for nothing. Counted as its children (no mapping is built)."""
        twins = self._relief_opts(deg, mine)
        parts = []  # (the twins of one activation offload, their mappings)
        for oa in dict.fromkeys(o.get("offload_activations", False) for o in twins):
            mine_t = self._mine(twins, ub, oa)
            count = len(vs) * self._pair_count(deg["tp"], [spar], mine_t, places_by)
            if count:
                parts.append((mine_t, count))
        if not parts:
            return None
        args = (deg, mb, m, vs, rc, spar, places_by)
        knobs = (("tp", deg["tp"]), ("pp", deg["pp"]), ("dp", deg["dp"]), ("micro_batch", mb),
                 ("num_micro_batches", m), ("recompute", rc), ("sequence_parallel", bool(spar)), ("tp_comm_overlap", ub))
        return SpaceNode(min(self._twin_pipeline_s(*args, t, False) for t, _ in parts), 0.0,
                         sum(c for _, c in parts), knobs,
                         partial(self._relief_subs, deg, mb, m, vs, rc, spar, ub, places_by, mine),
                         refine=None if self._bounds_off else
                         lambda: min(self._twin_pipeline_s(*args, t, True) for t, _ in parts))

    def _twin_pipeline_s(self, deg, mb, m, vs, rc, spar, places_by, mine, refined: bool) -> float:
        """:meth:`_sub_node`'s bound of the group of options ``mine`` without its optimizer step
        and host-transfer floors (a lower bound on it): the compute floor (``refined``: or the
        per-kernel floor, :meth:`_pass_floor_min`) and the exposed all-to-alls per stage."""
        tp, cp, pp = deg["tp"], deg["cp"], deg["pp"]
        stage_s = self.model.compute_floor_s(mb, rc) / (tp * cp * pp)
        if refined:
            stage_s = max(stage_s, self._pass_floor_min(deg, mb, m, [rc], [spar], self._keys(mine)))
        ep_s = self._ep_layers_s(deg, mb, m, [rc], places_by, mine)
        return ((m + (pp - 1) / max(vs)) * (stage_s + ep_s) + self._p2p_floor_s(deg, mb, m, vs)) * (1 - 1e-12)

    def _relief_subs(self, deg, mb, m, vs, rc, spar, ub, places_by, mine) -> list[SpaceNode]:
        """The children of :meth:`_relief_sub`'s group, their per-kernel floors taken at once
        (memoised, shared with the pruned group's): each joins the queue under its own bound."""
        twins = self._relief_opts(deg, mine)
        subs = [self._sub_node(deg, mb, m, vs, rc, spar, ub, places_by, twins, False, oa)
                for oa in dict.fromkeys(o.get("offload_activations", False) for o in twins)]
        subs = [x for x in subs if x is not None]
        for x in subs:
            while x.refine is not None:  # (every stage of a staged refine)
                refine, x.refine = x.refine, None
                x.bound_s = max(x.bound_s, refine())
        return subs

    def _leaf(self, deg, mb, m, v, rc, key, spar, places_by, mine, relief) -> SpaceNode | None:
        pairs, count = self._pairs_counted(deg["tp"], [spar], mine, places_by)
        if not count:
            return None
        model = self.model
        probe = self._probe(deg, mb, m, v, rc, key, bool(spar))  # (offloaded activations: SP shrinks them)
        bound, floor = 0.0 if self._bounds_off else model.lower_bound_s(probe), model.leaf_floor_bytes(probe)
        ep_s = self._exposed_ep_s(deg, mb, m, v, rc, places_by, mine)
        if ep_s and not self._bounds_off and offload.uses_offload(probe):  # (host transfers hide behind the all-to-alls too)
            ep_s = max(0.0, ep_s - model.offload_ep_overlap_s(probe, self._ep_layers_s(deg, mb, m, [rc], places_by, mine)))
        last_s = self._last_stage_bound_s(deg, mb, m, v, rc, places_by, mine, probe)
        zero2_s = 0.0
        if not self._bounds_off and key[0] == 2:  # ZeRO-2's per-micro-batch reduce-scatters over the pipeline bound
            opt_s = model.optimizer_s(probe, model.params_per_chip_floor(probe))
            pipeline_s = last_s - opt_s if last_s > bound + ep_s else bound - opt_s + ep_s
            zero2_s = model.zero2_exposed_floor_s(probe, pipeline_s)
        bound = last_s + zero2_s if last_s > bound + ep_s else bound + (ep_s + zero2_s)
        fixed = (("tp", deg["tp"]), ("pp", deg["pp"]), ("dp", deg["dp"]), ("micro_batch", mb),
                 ("num_micro_batches", m), ("interleave", v), ("recompute", rc),
                 ("sequence_parallel", bool(spar)), ("zero_stage", key[0]), ("cp", deg["cp"]),
                 ("ep", deg["ep"]))
        return SpaceNode(bound, floor, count, fixed, partial(self._mappings, deg, mb, m, v, rc, pairs),
                         leaf=True, screen=partial(self._screen, deg, mb, m, v, rc, key, bool(spar)),
                         host_screen=partial(self._host_screen, deg, mb, m, v, rc, key, bool(spar))
                         if (key[2] != "none" or key[3] or key[4]) and not self._bounds_off else None,
                         relief=partial(self._relief_leaf, deg, mb, m, v, rc, spar, places_by, mine)
                         if relief else None)

    def _last_stage_bound_s(self, deg, mb, m, v, rc, places_by, mine, probe) -> float:
        """``LLMModel.last_stage_bound_s`` of a leaf group of an MoE model in plain 1F1B (its
        cheapest placement's all-to-alls per layer, from :meth:`_ep_layers_s`); 0 elsewhere.
        (Not the two-stage split bound, ``LLMModel.split_stage_floor_s``: on a leaf's cheapest TP
        group without the TP collectives it pruned nothing on DeepSeek-V3 / 512 dragonfly and cost
        8192 0.7 CPU s; each mapping's own-group pre-solve bound holds it.)"""
        if self._bounds_off or v != 1 or deg["pp"] <= 1 or self.model.num_experts <= 1:
            return 0.0
        n_moe = self.model.num_moe_layers
        ep_layer_s = self._ep_layers_s(deg, mb, m, [rc], places_by, mine) * deg["pp"] / n_moe if n_moe else 0.0
        return self.model.last_stage_bound_s(probe, ep_layer_s)

    def _relief_leaf(self, deg, mb, m, v, rc, spar, places_by, mine) -> SpaceNode | None:
        """The offloaded twins of a leaf group pruned for memory, as one group per option key
        under a parent that is never pruned itself (each leaf is screened when reached)."""
        twins = self._relief_opts(deg, mine)
        leaves = [self._leaf(deg, mb, m, v, rc, key, spar, places_by, same, False)
                  for key, same in self._by_key(twins).items()]
        leaves = [x for x in leaves if x is not None]
        if not leaves:
            return None
        return SpaceNode(min(x.bound_s for x in leaves), min(x.floor_bytes for x in leaves),
                         sum(x.count for x in leaves), leaves[0].knobs[:8], lambda: leaves)

    def _ep_layers_s(self, deg, mb, m, rcs, places_by, opts) -> float:
        """Least exposed MoE all-to-all time of a stage's share of the layers, ``L ep_s / pp``,
        over the recompute choices, expert-TP placements and the all-to-all overlap option (0
        without experts): what a group adds to the mean stage time of every mapping in it
        (:meth:`_exposed_ep_s`)."""
        if deg["ep"] <= 1:
            return 0.0
        overlap = self._a2a_overlap_offered(opts)
        # (places_by is one dict per degree tuple, kept alive by the memo: its identity stands for
        # the degrees' placements; hashing them on every call cost more than the floor)
        key = (id(places_by), deg["tp"], deg["cp"], deg["ep"], deg["pp"], deg["dp"], mb, tuple(rcs), overlap)
        hit = self._ep_memo.get(key)
        if hit is None:
            rc = next((r for r in rcs if r != "full"), rcs[0])  # full recompute repeats the forward pair
            # LLMModel._ep_comm without overlap: forward pair, backward pair (+ the forward again
            # under full recompute), increasing in the pair's time: the cheapest pair's
            p = self._ep_pair_min_s(deg, mb, places_by)
            ep_s = 0.0 if p is None else p + (p + (p if rc == "full" else 0.0))
            # overlapped, at least the share of the SMs the communication kernels hold stays
            # exposed (experts.overlapped_a2a_exposed_s: max(a - c, f a) >= f a), and the
            # unpaired warm-up / cool-down micro-batches whole (experts.with_unpaired, increasing)
            if overlap and moe_terms.a2a_overlap_applies(ep=deg["ep"], num_micro_batches=m):
                ep_s *= moe_terms.with_unpaired(moe_terms.a2a_sm_fraction(), pp=deg["pp"], num_micro_batches=m)
            hit = self._ep_memo[key] = (places_by, self.model.num_moe_layers * ep_s / deg["pp"])
        return hit[1]

    def _ep_pair_min_s(self, deg, mb, places_by) -> float | None:
        """Least ``LLMModel.ep_pair_s`` (one dispatch + combine) over the ep groups of the
        placements ``places_by`` at micro-batch ``mb`` (it reads the ep group and the tokens
        only, so the distinct ep groups stand for every placement); None without placements."""
        tokens = mb * (self.model.model.seq_len // deg["cp"]) // deg["tp"]
        memo = self.__dict__.setdefault("_ep_pair_min_memo", {})
        key = (id(places_by), tokens)
        hit = memo.get(key)
        if hit is None:
            groups = dict.fromkeys(dict(place)["ep"] for pl in places_by.values() for place in pl)
            pairs = [self.model.ep_pair_s(g, tokens) for g in groups]
            hit = memo[key] = (places_by, min(pairs) if pairs else None)
        return hit[1]

    def _a2a_overlap_offered(self, opts: list[dict]) -> bool:
        """Whether some option of ``opts`` overlaps the all-to-alls (memoised on the list's
        identity, kept alive by the memo)."""
        memo = self.__dict__.setdefault("_a2a_overlap_memo", {})
        hit = memo.get(id(opts))
        if hit is None:
            hit = memo[id(opts)] = (opts, any(o.get("overlap_moe_expert_parallel_comm", False) for o in opts))
        return hit[1]

    def _p2p_floor_s(self, deg, mb, m, vs) -> float:
        """Least exposed pipeline p2p of a group whose interleaves are ``vs``
        (``LLMModel.p2p_floor_s``, what each leaf's ``lower_bound_s`` holds: nonzero only when
        every mapping runs plain 1F1B, ``max(vs) == 1``; a group's bound takes the largest ``v``)."""
        if self._bounds_off or max(vs) != 1 or deg["pp"] <= 1:
            return 0.0
        key = (deg["tp"], deg["pp"], deg["dp"], deg["cp"], deg["ep"], mb, m)  # (what the Mapping reads)
        memo = self.__dict__.setdefault("_p2p_memo", {})
        if key not in memo:
            memo[key] = self.model.p2p_floor_s(Mapping(deg["tp"], deg["pp"], deg["dp"], mb, m, 1, cp=deg["cp"],
                                                       ep=deg["ep"]))
        return memo[key]

    def _exposed_ep_s(self, deg, mb, m, v, rc, places_by, opts) -> float:
        """What the MoE token all-to-alls add to the pipeline bound of every mapping of a leaf
        group: ``LLMModel._ep_comm`` is exposed on every MoE layer's forward and backward (it
        reads the micro-batch, cp, tp, ep, recompute and the ep group, nothing solved; with the
        overlap option at least the SM share :func:`~dfmodel.inter_chip.experts.a2a_sm_fraction`
        of it), so each stage's time grows by its layers x that, and the 1F1B bound
        ``(M + (pp - 1)/v) x mean stage time`` by ``(M + (pp - 1)/v) L ep_s / pp`` with the
        cheapest placement's ``ep_s``. For DeepSeek-V3 the all-to-alls are comparable to a
        layer's compute, so this is most of the gap a compute-only bound leaves."""
        if deg["ep"] <= 1:
            return 0.0
        return (m + (deg["pp"] - 1) / v) * self._ep_layers_s(deg, mb, m, [rc], places_by, opts) * (1 - 1e-12)

    def _screen(self, deg, mb, m, v, rc, key, sp) -> float:
        """``memory_before_blocks`` of the group's mappings (it reads no other option) when it
        exceeds the chip's capacity, else a value within it (``LLMModel.screen_bytes``)."""
        return self.model.screen_bytes(self._probe(deg, mb, m, v, rc, key, sp), self.system.chip.memory.capacity_bytes)

    def _host_screen(self, deg, mb, m, v, rc, key, sp) -> bool:
        """False when ``memory_before_blocks``' host bytes (a floor of every mapping of the
        group, test_host_floor.py) exceed the chip's host share: what activation offload moves
        at 128K context can be the host's limit where the model state is not."""
        b = self.model.memory_before_blocks(self._probe(deg, mb, m, v, rc, key, sp))
        if b.host_fits:
            return True
        self._note_host_short(b.host_bytes, b.host_capacity_bytes)
        return False

    def _note_host_short(self, need: float, share: float) -> None:
        if self.host_short is None or need < self.host_short[0]:
            self.host_short = (need, share)

    @staticmethod
    def _mappings(deg, mb, m, v, rc, pairs) -> list[Mapping]:
        tp, pp, dp, cp, ep = deg["tp"], deg["pp"], deg["dp"], deg["cp"], deg["ep"]
        return [Mapping(tp, pp, dp, mb, m, v, rc, bool(spar), placement=place, cp=cp, ep=ep, **o)
                for spar, o, places in pairs for place in places]

    def seeds(self, capacity_bytes: float, evaluate, tries: int = 24, keep: int = 12, scan: int = 128, eps: int = 3,
              per_pp: int = 3):
        """MoE recipe incumbents evaluated before the search expands any group (deterministic;
        dense models: none). Published MoE runs take a large expert parallelism, TP within the
        NVLink domain and the pipeline depth that fits without full recomputation (DeepSeek-V3:
        EP 64, PP 16, arXiv:2412.19437 sec. 3.2; Megatron-Bridge's DeepSeek-V3 H100 recipe: TP 2,
        PP 16, EP 64). So of the first ``scan`` roots in
        :func:`~dfmodel.inter_chip.experts.recipe_order`, for each of the ``eps`` largest expert-
        parallel degrees and each pipeline depth, the least-bound leaf at the lightest recompute
        whose pre-solve memory screen fits (smallest micro-batch, no interleaving, ZeRO 1), with
        the all-to-all overlap, SP, expert TP 1 and the recipes' overlap flags where offered.
        Yields the fitting evaluations (at most ``keep``, after at most ``tries`` evaluations).
        Only the cutoff changes: the search proves the same optimum with or without them."""
        if self.model.num_experts <= 1:
            return
        fast, fast_name = self.system.network[0].size, self.system.network[0].name
        pool = [r for r in self.roots_built if r.floor_bytes <= capacity_bytes]
        offloaded = not pool and self.relief_on
        if offloaded:
            # nothing fits on the chip without offload (DeepSeek-V3 on 64 GPUs): the recipes'
            # layouts among the offloaded twins (ZeRO-3 / ZeRO-Offload ranks, any ZeRO stage)
            pool = self._relief_roots(capacity_bytes, tries=len(self.roots_built))
        roots = sorted((r for r in pool if dict(r.knobs)["ep"] > 1),
                       key=lambda r: moe_terms.recipe_order(dict(r.knobs), fast))[:scan]
        leaves_of = {}

        def leaves(root):
            if id(root) not in leaves_of:
                group = min(root.expand(), key=lambda g: dict(g.knobs)["micro_batch"])
                kx = [(dict(x.knobs), x) for x in leaf_nodes(group)]
                leaves_of[id(root)] = sorted(((k, x) for k, x in kx if k["interleave"] == 1
                                              and (k["zero_stage"] in (0, 1, 3) or offloaded)),
                                             key=lambda p: (p[0]["zero_stage"] != 1, not p[0]["sequence_parallel"]))
            return leaves_of[id(root)]

        def fitting(group):
            """Leaves that pass the memory screen: the lightest recompute first, then the
            narrowest TP (``group`` is in recipe order); of one root's, the least bound. A leaf
            whose bound is infinite (no partition plan of some phase fits the SRAM on any TP
            group: dataflow_floor) cannot run: evaluating it to learn so took 2.7 of DeepSeek-V3 /
            8192 dragonfly's 6 CPU s of seeds (TP 2: a softmax needs 384 MiB alone)."""
            for rc in RECOMPUTE:
                for root in group:
                    fit = [leaf for k, leaf in leaves(root) if k["recompute"] == rc and leaf.bound_s < math.inf
                           and (k["zero_stage"] != 3 or offloaded)
                           and leaf.floor_bytes <= capacity_bytes and leaf.screen() <= capacity_bytes]
                    # (ZeRO-3 where no ZeRO 0 / 1 leaf of this recompute fits: DeepSeek-V3 on 8192
                    # dragonfly chips runs best without recompute under ZeRO-3, 122 s, where the
                    # ZeRO-1 seed needs selective recompute, 145 s, and the cutoff stays there)
                    fit = fit or [leaf for k, leaf in leaves(root) if k["recompute"] == rc and k["zero_stage"] == 3
                                  and leaf.bound_s < math.inf and leaf.floor_bytes <= capacity_bytes
                                  and leaf.screen() <= capacity_bytes]
                    if fit:
                        yield min(fit, key=lambda x: x.bound_s)

        def pick(leaf):  # TP on the fast domain, the cheapest all-to-alls, the recipes' flags
            return min(leaf.expand(), key=lambda c: (not c.overlap_moe_expert_parallel_comm,
                                                     moe_terms.members_off(c.group("tp"), fast_name),
                                                     sum(self.model._ep_comm(c)), c.etp != 1,
                                                     -sum(bool(getattr(c, f)) for f in moe_terms.RECIPE_OVERLAPS)))

        # per expert-parallel degree (the ``eps`` largest with a fitting seed) and pipeline depth
        # (shallowest first): the first candidate of ``fitting`` whose evaluation fits (the
        # screen is a floor: a screened-in leaf may still not fit), at most ``per_pp`` tried
        done = 0
        for ep in sorted({dict(r.knobs)["ep"] for r in roots}, reverse=True):
            groups: dict[int, list] = {}
            for r in roots:  # (in recipe order: the narrowest TP first)
                if dict(r.knobs)["ep"] == ep:
                    groups.setdefault(dict(r.knobs)["pp"], []).append(r)
            found = False
            for pp in sorted(groups):
                for n, leaf in enumerate(fitting(groups[pp])):
                    if tries <= 0 or keep <= 0 or expired():
                        return
                    if n >= per_pp:
                        break
                    tries -= 1
                    ev = evaluate(pick(leaf))
                    if ev is None:  # the deadline passed
                        return
                    if not isinstance(ev, Exception) and ev.fits:
                        keep, found = keep - 1, True
                        yield ev
                        break
            done += found
            if done >= eps:
                return

    def leanest(self, capacity_bytes: float) -> Mapping | None:
        """A mapping likely to fit in memory (an incumbent for a time-limited search): of the
        roots whose floor fits, the smallest micro-batch then floor, with full recompute, sequence
        parallelism and the most sharded ZeRO stage allowed; when no root fits, or that mapping's
        pre-solve memory screen does not, the same pick among the offloaded twins of the leanest
        roots (:meth:`_relief_roots`), the most offloaded first."""
        fits = [r for r in self.roots_built if r.floor_bytes <= capacity_bytes]
        lean = self._leanest_of(fits) if fits else None
        if lean is None or not self.model.memory_before_blocks(lean).fits:
            # nothing fits on the chip by the floors (a model too large for the chips without
            # offload, e.g. DeepSeek-V3 on 64 GPUs): the leanest of the offloaded twins
            lean = self._leanest_of(self._relief_roots(capacity_bytes)) or lean
        return lean

    def _leanest_of(self, roots: list[SpaceNode]) -> Mapping | None:
        """:meth:`leanest`'s pick among ``roots``."""
        if not roots:
            return None
        self._bounds_off = True  # (the groups built here only pick a mapping: no time bounds needed)
        try:
            root = min(roots, key=lambda r: r.floor_bytes)  # its floor is its smallest micro-batch's
            group = min(root.expand(), key=lambda g: (dict(g.knobs)["micro_batch"], g.floor_bytes))
            leaves = [c for node in leaf_nodes(group) for c in node.expand()]  # in the tree's order
        finally:
            self._bounds_off = False
        rank = {"full": 0, "selective": 1, "none": 2}
        # (offloaded twins: the optimizer and activations on the host leave the least on the chip)
        return min(leaves, key=lambda x: (rank.get(x.recompute, 3), x.offload_optimizer == "none",
                                          not x.offload_activations, -x.zero_stage, not x.sequence_parallel))

    def _relief_roots(self, capacity_bytes: float, tries: int = 8) -> list[SpaceNode]:
        """When no degree group fits on the chip (a model too large for the chips without
        offload, e.g. DeepSeek-V3 on 64 GPUs): the offloaded twins of the ``tries`` leanest
        groups whose floor fits, for :meth:`leanest` to take an incumbent from."""
        out = []
        self._bounds_off = True
        try:
            twins = [r.relief() for r in sorted((r for r in self.roots_built if r.relief is not None),
                                                key=lambda r: r.floor_bytes)[:tries]]
        finally:
            self._bounds_off = False
        for twin in twins:
            if twin is not None and twin.floor_bytes <= capacity_bytes:
                out.append(twin)
        return out


def leaf_nodes(group: SpaceNode) -> list[SpaceNode]:
    """The leaf groups (those whose children are mappings) under ``group``, in the tree's order,
    however many group levels lie between."""
    found, todo = [], [group]
    while todo:
        node = todo.pop(0)
        if node.leaf:
            found.append(node)
        else:
            todo[:0] = node.expand()
    return found


def mappings_under(node: SpaceNode):
    """Every mapping under ``node`` (a group of the space), in the tree's order."""
    for child in node.expand():
        if node.leaf:
            yield child
        else:
            yield from mappings_under(child)


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


__all__ = ["llm_candidates", "degree_tuples", "LLMSpace", "symmetric_dims", "canonical_placement", "degree_triples", "validate_knobs", "interleaves", "placements", "DIM_NAMES"]
