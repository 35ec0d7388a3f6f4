"""Per-kernel sharding over a tensor-parallel group as a MILP, and the per-chip graph it yields.

One-hot ``s[g, r]`` picks strategy ``r`` for every strategy group ``g`` (kernels sharing a
weight form one group); ``y[e, r, q] >= 0`` carries the layout conversion on edge ``e`` from the
producer's strategy ``r`` to the consumer's ``q`` with ``sum_q y[e,r,q] = s[u,r]`` and
``sum_r y[e,r,q] = s[v,q]`` (DESIGN.md section 5; tight, integral on trees). The layer's input
and output share one boundary layout (layers repeat). Kernel costs are roofline times per chip;
conversions are collective times over the TP group from the netmodels cost table.

Every conversion cost depends on at most two decisions, so the same objective is a sum of unary
and pairwise terms (:func:`pairwise_model`); :func:`solve_sharding` minimises it exactly by
variable elimination (:mod:`dfmodel.solvers.pairwise`, milliseconds, no MILP) and keeps the MILP
for problems whose elimination tables would be large, and as the tests' oracle. Results that do
not depend on where the group sits (layout tables, kernel times, the per-chip graph of a plan)
are memoised, so a search pays for them once per shape rather than once per placement.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import Kernel, KernelKind, Phase, Tensor
from dfmodel.inter_chip.strategies import Strategy, conversion, local_fraction, strategies
from dfmodel.system.processor import compute_time_s, memory_time_s
from dfmodel.system.schema import System

US = 1e6  # the MILP works in microseconds (DESIGN.md section 3: scale coefficients)


@dataclass(frozen=True)
class TPGroup:
    """Where a TP group lives: its size and ``(dim_name, members)`` placement, innermost first."""

    size: int
    placement: tuple[tuple[str, int], ...] = ()


@dataclass
class ShardingPlan:
    """Chosen strategy per kernel and the boundary layout, with the MILP's proof status."""

    strategy: dict[str, str]
    boundary_layout: str
    objective_s: float
    status: str = "optimal"
    backend: str = "closed_form"
    gap: float = 0.0


def is_weight_gradient(kernel: Kernel, t: Tensor) -> bool:
    """A graph output that is a weight gradient (of a matmul, or of a norm's scale and shift)."""
    return t.consumer is None and (kernel.phase == Phase.weight_grad or t.name.startswith("dW"))


def role(graph: DataflowGraph, t: Tensor) -> str:
    """``g`` for a gradient operand, ``x`` for an activation/saved value (used by wgrad rules)."""
    if t.producer is not None:
        return "g" if graph.kernel(t.producer).phase != Phase.forward else "x"
    return "g" if t.operand in ("g", "dy", "grad") or t.name.startswith("d") else "x"


def is_between_blocks(kernel: Kernel) -> bool:
    """Norms and residual adds: the kernels Megatron's sequence parallelism splits along the
    sequence (Korthikanti et al. 2022, sec. 4.2.2), replicated without it."""
    return kernel.group == "norm" or "residual" in kernel.name


def is_moe_routing(kernel: Kernel) -> bool:
    """An MoE layer's router GEMM, top-k routing, permute or unpermute (builders/moe.py's
    ``router`` group, forward and backward).

    Megatron-Core's ``MoELayer`` routes the sequence-parallel hidden states each TP rank holds
    (``self.router(hidden_states)`` on the ``[s/tp, b, h]`` shard; the router weight is not
    TP-split and its gradient is all-reduced over TP like the norms'), permutes its own tokens,
    and the alltoall dispatcher all-gathers the routed rows over TP only after the expert
    all-to-all (``gather_from_sequence_parallel_region``) and reduce-scatters the experts'
    output before the combine (``reduce_scatter_to_sequence_parallel_region``; core_r0.9
    token_dispatcher.py). Megatron-Core requires sequence parallelism for MoE with TP and EP
    (transformer_config.py: "When using expert parallelism and tensor parallelism, sequence
    parallelism must be used")."""
    return kernel.group == "router"


def megatron_options(kernel: Kernel, names: list[str], sequence_parallel: bool,
                     moe_dispatcher: bool = False) -> list[str]:
    """The strategies Megatron-LM's tensor parallelism uses, among ``names``.

    - linear layers (matmuls with weights) are column- or row-parallel: their weights are always
      split over the TP group (Shoeybi et al. 2019, sec. 3), never replicated, so a token-split
      matmul that would hold the whole weight on every member (and blow its memory) is excluded;
    - norms and residual adds are sequence-split with sequence parallelism and replicated
      without it, exactly the layouts :mod:`dfmodel.inter_chip.memory` counts, so time and
      memory come from the same layouts.
    - with ``moe_dispatcher`` (a chip that runs Megatron-Core itself: ``Chip.eager``), an MoE
      layer's router, routing, permute and unpermute run on each member's own sequence shard
      (:func:`is_moe_routing`), as Megatron-Core's MoE layer does with sequence parallelism,
      which it requires once tensor and expert parallelism are combined; elsewhere (compiled
      and dataflow stacks) they keep every valid option, like the attention cores;
    Attention cores, activations and the vocabulary-parallel head keep every valid option.

    >>> from dfmodel.graph.kernel import Kernel, KernelKind
    >>> ln = Kernel("fwd.ln1", KernelKind.reduction, {"m": 8, "n": 4}, flop=1, output_bytes=1, group="norm")
    >>> megatron_options(ln, ["tok", "rep"], True), megatron_options(ln, ["rep"], False)
    (['tok'], ['rep'])
    """
    if moe_dispatcher and sequence_parallel and is_moe_routing(kernel):
        kept = [n for n in names if n == "tok"]
    elif kernel.kind == KernelKind.matmul and kernel.weight_bytes > 0:
        kept = [n for n in names if n in ("col", "row")]
    elif is_between_blocks(kernel):
        kept = [n for n in names if n == ("tok" if sequence_parallel else "rep")]
    else:
        kept = names
    return kept or names


class ShardingProblem:
    """Everything the sharding MILP and its oracle need about one graph on one TP group."""

    def __init__(self, graph: DataflowGraph, system: System, group: TPGroup, cost_table, *, tokens_split: bool,
                 megatron_layouts: bool = False, whole_experts: bool = False, memo: dict | None = None):
        self.graph, self.system, self.group, self.costs = graph, system, group, cost_table
        #: results that do not depend on the group's placement, shared by the problems of one
        #: system (:func:`shard`'s ``memo``): kernel times per strategy, sharded graphs per plan
        self.memo = memo
        if memo is not None and memo.setdefault("__system__", system) is not system:
            raise ValueError("a sharding memo serves one system")
        self.tokens_split = tokens_split and group.size > 1
        self.megatron_layouts = megatron_layouts
        #: Megatron-Core's MoE dispatcher layouts (:func:`megatron_options`): on eager-framework chips
        self.moe_dispatcher = megatron_layouts and system.chip.eager
        #: expert TP 1 (MoE): grouped expert GEMMs split their experts over the group, whole
        self.whole_experts = whole_experts and self.tokens_split
        self.precision = graph.meta.get("precision", "bf16")
        self.groups: dict[str, list[Kernel]] = defaultdict(list)
        for k in graph.kernels:
            self.groups[k.weight or k.name].append(k)
        self.group_of = {k.name: (k.weight or k.name) for k in graph.kernels}
        self.boundaries = ("R", "T") if self.tokens_split else ("R",)
        # memo tables: strategy lists per kernel, input tensors per kernel, collective times
        self._strategies: dict[str, dict[str, Strategy]] = {}
        self._comm: dict[tuple, float] = {}
        self._conv: dict[tuple, float | None] = {}
        self._roles: dict[Tensor, str] = {}
        self._compute: dict[str, float] = {}  # unsplit compute seconds per kernel
        self._kernel = {k.name: k for k in graph.kernels}
        self._inputs: dict[str, list[Tensor]] = defaultdict(list)
        for e in graph.tensors:
            if e.consumer is not None:
                self._inputs[e.consumer].append(e)

    @cached_property
    def options(self) -> dict[str, list[str]]:
        """Strategy names valid for every kernel of each group (the weight is split once)."""
        out = {}
        for g, ks in self.groups.items():
            names = [s.name for s in strategies(ks[0], tokens_split=self.tokens_split,
                                                whole_experts=self.whole_experts)]
            for k in ks[1:]:
                valid = {s.name for s in strategies(k, tokens_split=self.tokens_split, whole_experts=self.whole_experts)}
                names = [n for n in names if n in valid]
            if ks[0].group == "vocab_embedding":  # always vocabulary-parallel (strategies.py)
                names = [n for n in names if n != "rep"]
            if "expert" in names:  # Megatron-Core with expert TP 1: the experts are never TP-split
                names = ["expert"]
            if self.megatron_layouts and self.group.size > 1:
                names = megatron_options(ks[0], names, self.tokens_split, self.moe_dispatcher)
            out[g] = names if self.group.size > 1 else ["rep"]
        return out

    def strategy(self, kernel: Kernel, name: str) -> Strategy:
        table = self._strategies.get(kernel.name)
        if table is None:
            table = self._strategies[kernel.name] = {
                s.name: s for s in strategies(kernel, tokens_split=self.tokens_split, whole_experts=self.whole_experts)}
        return table[name]

    def comm_time_s(self, collective: str | None, message_bytes: float) -> float:
        if collective is None or self.group.size == 1:
            return 0.0
        key = (collective, message_bytes)
        hit = self._comm.get(key)
        if hit is None:
            hit = self._comm[key] = self.costs.time_s(collective, message_bytes, self.group.placement)
        return hit

    def conversion_s(self, src: str, dst: str, full_bytes: float) -> float | None:
        key = (src, dst, full_bytes)
        if key not in self._conv:
            c = conversion(src, dst, full_bytes, self.group.size)
            self._conv[key] = None if c is None else self.comm_time_s(c.collective, c.message_bytes)
        return self._conv[key]

    def role(self, t: Tensor) -> str:
        """:func:`role` of ``t``, memoised (tensors are frozen and hashable)."""
        r = self._roles.get(t)
        if r is None:
            r = self._roles[t] = role(self.graph, t)
        return r

    def in_layout(self, kernel: Kernel, name: str, t: Tensor) -> str:
        return self.strategy(kernel, name).input_layout(self.role(t))

    def kernel_time_s(self, kernel: Kernel, name: str) -> float | None:
        """Roofline time of ``kernel`` per chip under strategy ``name`` (its conversions are
        charged on its edges, including the all-reduce of a token-split weight gradient)."""
        s = self.strategy(kernel, name)
        t = self.group.size
        chip = self.system.chip
        full = self._compute.get(kernel.name)  # (the same for each of the kernel's strategies)
        if full is None:
            full = self._compute[kernel.name] = compute_time_s(chip, kernel, self.precision)
        compute = full / (t if s.splits_work else 1)
        in_bytes = sum(e.bytes * local_fraction(self.in_layout(kernel, name, e), t) for e in self._inputs[kernel.name])
        out_bytes = kernel.output_bytes * local_fraction(s.output, t)
        weight_bytes = kernel.weight_bytes / (t if s.splits_weight else 1)
        memory = memory_time_s(chip, in_bytes + out_bytes + weight_bytes + kernel.extra_memory_bytes)
        return max(compute, memory)

    def group_time_s(self, g: str, name: str) -> float | None:
        times = [self.kernel_time_s(k, name) for k in self.groups[g]]
        return None if any(x is None for x in times) else sum(times)

    def output_layouts(self, e: Tensor, name: str, boundary: str) -> tuple[str, str]:
        """(held, wanted) layouts of a graph output. Activations and gradients leave in the
        boundary layout; a weight gradient stays split like its weight (S), and is all-reduced
        when its kernel split tokens (every member holds a partial sum)."""
        kernel = self._kernel[e.producer]
        s = self.strategy(kernel, name)
        if not is_weight_gradient(kernel, e):
            return s.output, boundary
        if s.splits_weight:
            return "S", "S"
        held = "P" if s.output in ("T", "P") else "R"
        return held, "R"

    def evaluate(self, choice: dict[str, str], boundary: str) -> float | None:
        """Objective of a full assignment (group -> strategy); None if infeasible. The oracle."""
        total = self._kernels_total_s(choice)
        if total is None:
            return None
        for e in self.graph.tensors:
            cost = self.edge_cost_s(e, choice.get(self.group_of.get(e.producer)), choice.get(self.group_of.get(e.consumer)), boundary)
            if cost is None:
                return None
            total += cost
        return total

    def _kernels_total_s(self, choice: dict[str, str]) -> float | None:
        """Sum of the groups' kernel times under ``choice`` (in its order), memoised with the
        problem's memo: it does not depend on the placement."""
        key = ("total", self.graph.content_key, self.group.size, self.tokens_split, self.whole_experts,
               tuple(choice.items()))
        memo = self.memo if self.memo is not None else {}
        if key not in memo:
            total = 0.0
            for g, name in choice.items():
                gt = self.group_time_s(g, name)
                if gt is None:
                    total = None
                    break
                total += gt
            memo[key] = total
        return memo[key]

    def edge_cost_s(self, e: Tensor, r: str | None, q: str | None, boundary: str) -> float | None:
        src, dst = self.edge_layouts(e, r, q, boundary)
        return self.conversion_s(src, dst, e.bytes)

    def edge_layouts(self, e: Tensor, r: str | None, q: str | None, boundary: str) -> tuple[str, str]:
        """Layout an edge's tensor is produced in and the layout its consumer needs."""
        if e.consumer is None:
            return self.output_layouts(e, r, boundary)
        src = boundary if e.producer is None else self.strategy(self._kernel[e.producer], r).output
        return src, self.in_layout(self._kernel[e.consumer], q, e)


def build_milp(problem: ShardingProblem):
    """The sharding MILP as a backend-neutral model plus a decoder of its solution."""
    from dfmodel.solvers import MILPModel

    cols_cost: list[float] = []
    integer: list[bool] = []
    index: dict[tuple, int] = {}

    def var(key, cost, is_int):
        index[key] = len(cols_cost)
        cols_cost.append(cost)
        integer.append(is_int)
        return index[key]

    for g, names in problem.options.items():
        for i, name in enumerate(names):
            gt = problem.group_time_s(g, name)
            if gt is not None:
                # tiny preference for earlier strategies makes ties reproducible across back-ends
                var(("s", g, name), gt * US + 1e-6 * i, True)
    for L in problem.boundaries:
        var(("b", L), 0.0, True)

    rows: list[dict[int, float]] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coefs: dict[int, float], lower: float, upper: float):
        rows.append(coefs)
        lo.append(lower)
        hi.append(upper)

    for g, names in problem.options.items():
        row({index[("s", g, n)]: 1.0 for n in names if ("s", g, n) in index}, 1.0, 1.0)
    row({index[("b", L)]: 1.0 for L in problem.boundaries}, 1.0, 1.0)

    for ei, e in enumerate(problem.graph.tensors):
        gu = problem.group_of.get(e.producer)
        gv = problem.group_of.get(e.consumer)
        left = [("s", gu, r) for r in problem.options[gu]] if gu else [("b", L) for L in problem.boundaries]
        right = [("s", gv, q) for q in problem.options[gv]] if gv else None
        left = [k for k in left if k in index]
        if right is None:  # graph output: cost depends on the producer's strategy and boundary
            right = [("b", L) for L in problem.boundaries]
        right = [k for k in right if k in index]
        ys: dict[tuple, int] = {}
        for lk in left:
            for rk in right:
                if gu and gv and gu == gv and lk != rk:
                    continue
                r = lk[2] if lk[0] == "s" else None
                q = rk[2] if (rk[0] == "s") else None
                boundary = lk[1] if lk[0] == "b" else (rk[1] if rk[0] == "b" else "R")
                cost = problem.edge_cost_s(e, r, q, boundary)
                if cost is None:
                    continue
                ys[(lk, rk)] = var(("y", ei, lk, rk), cost * US, False)
        for lk in left:
            coefs = {j: 1.0 for (a, _), j in ys.items() if a == lk}
            coefs[index[lk]] = coefs.get(index[lk], 0.0) - 1.0
            row(coefs, 0.0, 0.0)
        for rk in right:
            coefs = {j: 1.0 for (_, b), j in ys.items() if b == rk}
            coefs[index[rk]] = coefs.get(index[rk], 0.0) - 1.0
            row(coefs, 0.0, 0.0)

    n = len(cols_cost)
    data, ri, ci = [], [], []
    for i, coefs in enumerate(rows):
        for j, v in coefs.items():
            ri.append(i)
            ci.append(j)
            data.append(v)
    A = sp.csr_matrix((data, (ri, ci)), shape=(len(rows), n))
    model = MILPModel(
        c=np.array(cols_cost),
        A=A,
        row_lo=np.array(lo),
        row_hi=np.array(hi),
        lb=np.zeros(n),
        ub=np.ones(n),
        integrality=np.array(integer, dtype=bool),
    )

    def decode(x: np.ndarray) -> tuple[dict[str, str], str]:
        choice = {}
        for (kind, *rest), j in index.items():
            if kind == "s" and x[j] > 0.5:
                choice[rest[0]] = rest[1]
        boundary = next(L for L in problem.boundaries if x[index[("b", L)]] > 0.5)
        return choice, boundary

    return model, decode


def structure_key(problem: ShardingProblem) -> tuple:
    """Everything the strategy options and edge layouts of ``problem`` depend on -- kernel
    kinds, phases, groups, weights, names, tensor endpoints and operands, the layout rules --
    but not sizes nor the group's placement (those only change costs)."""
    kernels = tuple((k.name, k.kind, k.phase, k.group, k.weight, k.weight_bytes > 0, bool(getattr(k, "expert", False)),
                     "b" in k.dims) for k in problem.graph.kernels)
    tensors = tuple((e.name, e.producer, e.consumer, e.operand) for e in problem.graph.tensors)
    return (kernels, tensors, problem.tokens_split, problem.whole_experts, problem.megatron_layouts,
            problem.moe_dispatcher, problem.group.size > 1)


#: layout tables of recently seen structures (:func:`_layout_terms`), oldest first
_LAYOUTS: "OrderedDict[tuple, tuple]" = OrderedDict()
_LAYOUTS_KEPT = 64


def _layout_terms(problem: ShardingProblem):
    """``(groups, domains, terms)`` of :func:`pairwise_model` with each term's cells as
    ``(held, wanted)`` layout pairs: one ``(tensor index, i, j, cells)`` per edge, where ``i``
    and ``j`` are variables (``len(groups)`` is the boundary layout), ``cells[a][b]`` the
    layouts at values ``a`` of ``i`` and ``b`` of ``j`` (``cells[a]`` when ``i == j``).
    Memoised by :func:`structure_key`: every block of one shape shares them."""
    key = structure_key(problem)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    groups = list(problem.options)
    where = {g: i for i, g in enumerate(groups)}
    domains = [list(enumerate(problem.options[g])) for g in groups] + [list(enumerate(problem.boundaries))]
    b = len(groups)
    lay = problem.edge_layouts
    terms = []
    for ei, e in enumerate(problem.graph.tensors):
        gu = problem.group_of.get(e.producer)
        gv = problem.group_of.get(e.consumer)
        if gu is not None and gv is not None:
            iu, iv = where[gu], where[gv]
            if iu == iv:  # both ends in one group: they share its strategy
                terms.append((ei, iu, iu, [lay(e, r, r, "R") for _, r in domains[iu]]))
            else:
                terms.append((ei, iu, iv, [[lay(e, r, q, "R") for _, q in domains[iv]] for _, r in domains[iu]]))
        elif gv is not None:  # a layer input, arriving in the boundary layout
            iv = where[gv]
            terms.append((ei, b, iv, [[lay(e, None, q, L) for _, q in domains[iv]] for L in problem.boundaries]))
        elif gu is not None:  # a layer output, leaving in the boundary layout
            iu = where[gu]
            terms.append((ei, iu, b, [[lay(e, r, None, L) for L in problem.boundaries] for _, r in domains[iu]]))
        else:
            terms.append((ei, b, b, [lay(e, None, None, L) for L in problem.boundaries]))
    out = _LAYOUTS[key] = (groups, domains, terms)
    while len(_LAYOUTS) > _LAYOUTS_KEPT:
        _LAYOUTS.popitem(last=False)
    return out


def _group_times(problem: ShardingProblem, groups, domains) -> list[list]:
    """Each group's kernel seconds per strategy of its domain (None: some kernel cannot run
    it). They do not depend on the placement: memoised."""
    key = ("group_times", problem.graph.content_key, problem.group.size, problem.tokens_split,
           problem.whole_experts, problem.megatron_layouts)
    memo = problem.memo if problem.memo is not None else {}
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = [[problem.group_time_s(g, name) for _, name in dom] for g, dom in zip(groups, domains[:-1])]
    return hit


def _strategy_times(problem: ShardingProblem, groups, domains) -> tuple[np.ndarray, ...]:
    """Unary terms: each group's kernel time per strategy (microseconds, with the MILP's
    tie-break), the boundary's zeros last. They do not depend on the placement: memoised."""
    key = ("times", problem.graph.content_key, problem.group.size, problem.tokens_split, problem.whole_experts,
           problem.megatron_layouts)
    memo = problem.memo if problem.memo is not None else {}
    hit = memo.get(key)
    if hit is None:
        out = []
        for dom, times in zip(domains[:-1], _group_times(problem, groups, domains)):
            out.append(np.array([np.inf if gt is None else gt * US + 1e-6 * i  # the MILP's tie-break (build_milp)
                                 for (i, _), gt in zip(dom, times)], dtype=float))
        out.append(np.zeros(len(domains[-1])))
        hit = memo[key] = tuple(out)
    return hit


def pairwise_model(problem: ShardingProblem):
    """The sharding problem as unary + pairwise terms over one variable per strategy group and
    one for the boundary layout (the last), with the MILP's objective to the last term.

    Every edge's conversion cost depends on at most two decisions (its producer's and its
    consumer's strategies, or one of them and the boundary layout), which is why the MILP's
    flow variables ``y`` are integral; here they are simply the table of those costs, and
    :func:`dfmodel.solvers.pairwise.minimise` finds the exact optimum without a MILP.
    Returns ``(groups, domains, unary, pairs)``; ``domains[i]`` lists ``(index in options,
    strategy name)`` of group ``i`` (the boundary's last). A strategy some kernel of its group
    cannot run (no time) costs ``inf``, as the MILP leaves its column out.
    """
    groups, domains, _ = _layout_terms(problem)
    return (groups, domains) + _pairwise_tables(problem, groups, domains, *_conversion_slots(problem))


def _pairwise_tables(problem: ShardingProblem, groups, domains, slots, slot_terms) -> tuple[list, dict]:
    """(unary, pairs) of :func:`pairwise_model` on ``problem``'s placement: each cell's
    conversion seconds (microseconds) read from the slots' times, summed in the edges' order
    (the same floats, added in the same order, as cell by cell)."""
    unary = list(_strategy_times(problem, groups, domains))
    us = _slot_times_us(problem, slots)
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for i, j, idx in slot_terms:
        table = us[idx]
        if i == j:
            unary[i] = unary[i] + table
        else:
            pairs[(i, j)] = pairs[(i, j)] + table if (i, j) in pairs else table
    return unary, pairs


#: :func:`_conversion_slots`' first two slots: no collective (0 s) and no valid conversion
_FREE, _IMPOSSIBLE = 0, 1


def _conversion_slots(problem: ShardingProblem) -> tuple[list, list]:
    """The placement-free half of the pair tables: ``(slots, slot_terms)``, ``slots`` the
    distinct ``(collective, message bytes)`` the cells convert by (after :data:`_FREE` and
    :data:`_IMPOSSIBLE`), ``slot_terms`` one ``(i, j, cell slot indices)`` per edge in the
    graph's order, ``i <= j``. Memoised per graph content and group size: a layer sharded on
    each of its TP placements (DeepSeek-V3 / 8192 dragonfly: 1122 shardings of 460 contents)
    derives its layouts' conversions once and asks the cost table only for their times."""
    key = ("slots", problem.graph.content_key, problem.group.size, problem.tokens_split, problem.whole_experts,
           problem.megatron_layouts)
    memo = problem.memo if problem.memo is not None else {}
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _build_conversion_slots(problem)
    return hit


def _build_conversion_slots(problem: ShardingProblem) -> tuple[list, list]:
    """:func:`_conversion_slots` computed."""
    _, _, terms = _layout_terms(problem)
    slots: list = [None, None]
    where: dict = {}
    size = problem.group.size

    def slot(held_wanted, full_bytes) -> int:
        c = conversion(held_wanted[0], held_wanted[1], full_bytes, size)
        if c is None:
            return _IMPOSSIBLE
        if c.collective is None:
            return _FREE
        k = (c.collective, c.message_bytes)
        if k not in where:
            where[k] = len(slots)
            slots.append(k)
        return where[k]

    out = []
    for ei, i, j, cells in terms:
        nbytes = problem.graph.tensors[ei].bytes
        if i == j:
            out.append((i, i, np.array([slot(c, nbytes) for c in cells], dtype=np.intp)))
            continue
        idx = np.array([[slot(c, nbytes) for c in row] for row in cells], dtype=np.intp)
        out.append((i, j, idx) if i < j else (j, i, np.ascontiguousarray(idx.T)))
    return slots, out


def _slot_times(problem: ShardingProblem, slots) -> list:
    """Seconds of each conversion slot on ``problem``'s placement (None: impossible), once per problem."""
    hit = problem.__dict__.get("_slot_times")
    if hit is None or hit[0] is not slots:
        hit = problem.__dict__["_slot_times"] = (slots, [0.0, None] + [problem.comm_time_s(c, b) for c, b in slots[2:]])
    return hit[1]


def _slot_times_us(problem: ShardingProblem, slots) -> np.ndarray:
    """:func:`_slot_times` in microseconds, ``inf`` for impossible (the pair tables' cells)."""
    return np.array([np.inf if t is None else t * US for t in _slot_times(problem, slots)], dtype=float)


def _objective_s(problem: ShardingProblem, groups, domains, x: list[int], slots, slot_terms) -> float | None:
    """``problem.evaluate(choice, boundary)`` of the assignment ``x`` (indices into the
    domains, the boundary's last) read from the memoised tables: the same floats, summed in
    the same order (each group's kernels, then each edge's conversion), without re-deriving
    layouts or kernel times."""
    total = 0.0
    for i, times in enumerate(_group_times(problem, groups, domains)):
        if times[x[i]] is None:
            return None
        total += times[x[i]]
    conv = _slot_times(problem, slots)
    for i, j, idx in slot_terms:
        cost = conv[int(idx[x[i]] if i == j else idx[x[i], x[j]])]
        if cost is None:
            return None
        total += cost
    return total


def solve_exact(problem: ShardingProblem) -> tuple[dict[str, str], str] | None:
    """Optimal (group -> strategy, boundary) by variable elimination over :func:`pairwise_model`;
    None when nothing is feasible. Raises ``TooLarge`` when the elimination would need a big
    table (then the MILP solves it)."""
    found = _solve_exact(problem)
    return None if found is None else found[:2]


def _solve_exact(problem: ShardingProblem) -> tuple[dict[str, str], str, float | None] | None:
    """:func:`solve_exact` with the optimum's objective (:meth:`ShardingProblem.evaluate`'s)."""
    from dfmodel.solvers.pairwise import minimise

    groups, domains, _ = _layout_terms(problem)
    if any(not d for d in domains):
        return None
    slots, slot_terms = _conversion_slots(problem)
    unary, pairs = _pairwise_tables(problem, groups, domains, slots, slot_terms)
    x, value = minimise([len(d) for d in domains], unary, pairs)
    if not np.isfinite(value):
        return None
    choice = {g: domains[i][x[i]][1] for i, g in enumerate(groups)}
    return choice, domains[-1][x[-1]][1], _objective_s(problem, groups, domains, x, slots, slot_terms)


#: ``solve_sharding`` methods: exact elimination when small, else the MILP (``auto``); or either
SHARDING_METHODS = ("auto", "exact", "milp")


def solve_sharding(problem: ShardingProblem, *, solver: str = "auto", time_limit_s: float | None = None,
                   method: str = "auto") -> ShardingPlan:
    """Optimal strategies for every kernel (group size 1: everything replicated, no solve).

    ``method``: ``auto`` solves exactly by variable elimination (:func:`solve_exact`, no MILP)
    unless its tables would be large, then by the MILP on ``solver``; ``exact`` and ``milp``
    force one (the MILP is the oracle of the tests).
    """
    if method not in SHARDING_METHODS:
        raise ValueError(f"method must be one of {', '.join(SHARDING_METHODS)}, got {method!r}")
    if problem.group.size == 1:
        choice = {g: "rep" for g in problem.groups}
        return ShardingPlan(
            {k.name: "rep" for k in problem.graph.kernels}, "R", problem.evaluate(choice, "R") or 0.0
        )
    from dfmodel.algorithms import TooLarge
    from dfmodel.errors import InfeasibleError
    from dfmodel.solvers import check_available

    check_available(solver)  # a solver asked for by name must exist even when no MILP is needed
    if method in ("auto", "exact"):
        try:
            found = _solve_exact(problem)
        except TooLarge:
            if method == "exact":
                raise
        else:
            if found is None:
                raise InfeasibleError(f"sharding of {problem.graph.name} on TP {problem.group.size}: infeasible "
                                      "(no strategy assignment has a valid layout on every edge)")
            choice, boundary, objective_s = found
            per_kernel = {k.name: choice[problem.group_of[k.name]] for k in problem.graph.kernels}
            return ShardingPlan(per_kernel, boundary, objective_s, "optimal", "exact", 0.0)
    from dfmodel.solvers import solve

    model, decode = build_milp(problem)
    res = solve(model, solver=solver, time_limit_s=time_limit_s)
    if res.x is None:
        raise InfeasibleError(f"sharding of {problem.graph.name} on TP {problem.group.size}: {res.status} {res.message}")
    choice, boundary = decode(res.x)
    per_kernel = {k.name: choice[problem.group_of[k.name]] for k in problem.graph.kernels}
    return ShardingPlan(per_kernel, boundary, problem.evaluate(choice, boundary), res.status, res.backend, res.gap)


@dataclass
class ShardedGraph:
    """The per-chip graph after sharding, with explicit communication kernels."""

    graph: DataflowGraph
    network_time_s: dict[str, float]  # comm kernel -> collective time
    plan: ShardingPlan
    comm: list[tuple[str, str, float, float]] = field(default_factory=list)  # name, collective, bytes, s

    @property
    def tp_comm_s(self) -> float:
        return float(sum(self.network_time_s.values()))


def _scaled_kernel(k: Kernel, s: Strategy, t: int) -> Kernel:
    work = t if s.splits_work else 1
    weight = t if s.splits_weight else 1
    dims = dict(k.dims)
    if s.splits_work and s.split_dim in dims:
        dims[s.split_dim] = max(1, dims[s.split_dim] // t)
    return replace(
        k,
        dims=dims,
        flop=k.flop / work,
        output_bytes=k.output_bytes * local_fraction(s.output, t),
        weight_bytes=k.weight_bytes / weight,
        params=k.params / weight,
        extra_memory_bytes=k.extra_memory_bytes / work,
    )


def comm_phase(graph: DataflowGraph, e: Tensor, collective: str, moe_dispatcher: bool = False) -> Phase:
    """The phase in which the layout conversion of edge ``e`` runs; every reader of the same
    tensor in that phase shares it (one collective, not one per reader).

    A tensor is converted when it is produced (forward for a forward output), except that a
    forward activation a backward kernel must all-gather is gathered again in the backward:
    Megatron's sequence parallelism saves the sequence-sharded input of a column-parallel
    linear and re-gathers it for the weight gradient (Korthikanti et al. 2022, sec. 4.2.2;
    Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication.backward``, Transformer
    Engine ``_Linear.backward`` with ``sequence_parallel``), which is also what
    :mod:`dfmodel.inter_chip.memory` counts as saved. So a Megatron SP layer runs 4 TP
    collectives forward (AG, RS per block) and 6 backward (AG of the output gradient, AG of the
    saved input, RS of the input gradient per block). A gradient reaching the layer's boundary
    (no producer) is converted in its reader's phase. With ``moe_dispatcher`` (Megatron-Core
    running: :attr:`ShardingProblem.moe_dispatcher`) the routed rows its MoE dispatcher gathers
    (:func:`is_moe_routing`) are gathered once: Megatron-Core's expert linears do no TP
    communication of their own (TE ``Linear`` with ``is_expert``: ``explicit_expert_comm`` sets
    ``parallel_mode=None``) and save the gathered rows for their weight gradient, which
    :func:`dfmodel.inter_chip.memory.moe_mla_activation_delta_bytes` counts (``experts_gathered``).
    """
    if e.producer is None:
        return Phase.forward if graph.kernel(e.consumer).phase == Phase.forward else Phase.backward
    producer = graph.kernel(e.producer)
    if producer.phase == Phase.forward and e.consumer is not None and collective == "all_gather" \
            and graph.kernel(e.consumer).phase != Phase.forward and not (moe_dispatcher and is_moe_routing(producer)):
        return Phase.backward
    return producer.phase


def apply_sharding(problem: ShardingProblem, plan: ShardingPlan) -> ShardedGraph:
    """Per-chip kernels and tensors, with a ``comm`` kernel on every edge that converts layouts.

    The per-chip graph depends on the plan, not on where the group sits: it is built once per
    (graph, plan, group size) when the problem has a memo, and only the collectives' times are
    computed for each placement."""
    t = problem.group.size
    g = problem.graph
    key = ("sharded", g.content_key, g.name, tuple(plan.strategy.items()), plan.boundary_layout, t,
           problem.tokens_split, problem.whole_experts, problem.megatron_layouts)
    memo = problem.memo if problem.memo is not None else {}
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _sharded_graph(problem, plan)
    sharded, comms = hit
    net: dict[str, float] = {}
    comm_rows = []
    for name, collective, message_bytes in comms:
        net[name] = time_s = problem.comm_time_s(collective, message_bytes)
        comm_rows.append((name, collective, message_bytes, time_s))
    return ShardedGraph(sharded, net, plan, comm_rows)


def _sharded_graph(problem: ShardingProblem, plan: ShardingPlan) -> tuple[DataflowGraph, list[tuple[str, str, float]]]:
    """The per-chip graph of :func:`apply_sharding` and its ``(comm kernel, collective, bytes)``."""
    t = problem.group.size
    g = problem.graph
    kernels = [_scaled_kernel(k, problem.strategy(k, plan.strategy[k.name]), t) for k in g.kernels]
    tensors: list[Tensor] = []
    comms = []
    done: dict[tuple, str] = {}  # one collective per (tensor, conversion, phase): see comm_phase
    for i, e in enumerate(g.tensors):
        r = plan.strategy.get(e.producer) if e.producer else None
        q = plan.strategy.get(e.consumer) if e.consumer else None
        src, dst = problem.edge_layouts(e, r, q, plan.boundary_layout)
        conv = conversion(src, dst, e.bytes, t)
        if conv is None or conv.collective is None or t == 1:
            tensors.append(replace(e, bytes=e.bytes * local_fraction(dst, t)))
            continue
        phase = comm_phase(g, e, conv.collective, problem.moe_dispatcher)
        key = (e.name, e.producer, src, dst, phase)
        if key in done:  # another reader of the same converted tensor in the same phase
            tensors.append(replace(e, producer=done[key], bytes=e.bytes * local_fraction(dst, t)))
            continue
        name = done[key] = f"comm{i}.{conv.collective}.{e.name}"
        comms.append((name, conv.collective, conv.message_bytes))
        kernels.append(
            Kernel(
                name,
                KernelKind.comm,
                {},
                flop=0.0,
                output_bytes=e.bytes * local_fraction(dst, t),
                phase=phase,
                group="tp_comm",
                collective=conv.collective,
                comm_bytes=conv.message_bytes,
                comm_group="tp",
            )
        )
        tensors.append(replace(e, consumer=name, bytes=e.bytes * local_fraction(src, t)))
        tensors.append(replace(e, producer=name, bytes=e.bytes * local_fraction(dst, t)))
    return DataflowGraph(kernels, tensors, name=f"{g.name}/tp{t}", meta={**g.meta, "tp": t}), comms


def shard(graph: DataflowGraph, system: System, group: TPGroup, cost_table, *, sequence_parallel: bool = True,
          solver: str = "auto", time_limit_s: float | None = None, megatron_layouts: bool = False,
          whole_experts: bool = False, memo: dict | None = None) -> ShardedGraph:
    """Optimal sharding of ``graph`` over ``group`` and the per-chip graph it yields.

    ``sequence_parallel`` allows the token-split layout ``T`` (Megatron sequence parallelism and
    token-split matmuls); without it layouts are replicated, feature-split or partial.
    ``megatron_layouts`` restricts the choice to Megatron-LM's layouts (:func:`megatron_options`).
    ``whole_experts``: expert TP 1 (the grouped expert GEMMs split their experts, never TP-split).
    ``memo``: a dict kept across calls on one system (the search's); what does not depend on the
    group's placement is then computed once (the returned per-chip graphs may be shared: read only).
    """
    problem = ShardingProblem(graph, system, group, cost_table, tokens_split=sequence_parallel,
                              megatron_layouts=megatron_layouts, whole_experts=whole_experts, memo=memo)
    return apply_sharding(problem, solve_sharding(problem, solver=solver, time_limit_s=time_limit_s))


def plan_free_params(graph: DataflowGraph, system: System, tp: int, *, sequence_parallel: bool = True,
                     megatron_layouts: bool = False, whole_experts: bool = False) -> tuple[float, float] | None:
    """(parameters, MoE expert parameters) per chip of ``graph`` sharded on ``tp`` chips when every
    sharding plan gives the same, else None. A kernel's parameters per chip read only whether its
    strategy splits the weight (:func:`_scaled_kernel`), so when every option of each weighted
    group agrees on that, the per-chip graph's ``params()`` and expert parameters are these
    (the same sums, to the bit: communication kernels hold none), whatever the group's placement
    picks (it changes only the collectives' costs). Megatron's layouts split every linear weight,
    column- or row-parallel, so this holds for them, with no sharding solved."""
    problem = ShardingProblem(graph, system, TPGroup(tp), None, tokens_split=sequence_parallel,
                              megatron_layouts=megatron_layouts, whole_experts=whole_experts)
    options = problem.options
    scaled = []
    for k in graph.kernels:
        splits = {problem.strategy(k, n).splits_weight for n in options[problem.group_of[k.name]]}
        if not splits or (k.params and len(splits) > 1):  # (no option: the solve reports it)
            return None
        scaled.append(k.params / (tp if splits.pop() else 1))
    return (float(sum(scaled)),
            float(sum(p for p, k in zip(scaled, graph.kernels) if getattr(k, "expert", False))))
