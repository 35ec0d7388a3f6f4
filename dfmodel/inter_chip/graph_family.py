"""Explicit graphs (``kind: graph``): tensor, pipeline and data parallelism of one pass.

The explicit graph is the work of **one pass** (its declared ``batch`` of samples: forward,
backward and weight-gradient kernels as written). A mapping puts ``tp x pp x dp = N`` chips to
work on it:

- **TP** shards every kernel over a group of ``tp`` chips with the generic sharding MILP
  (:func:`dfmodel.inter_chip.sharding.shard`: per-kernel strategies, layout conversions as
  explicit ``comm`` kernels with their collective times). The ``sequence_parallel`` knob is the
  MILP's ``tokens_split`` flag (the token-split layout ``T``: split the rows of activations,
  weights replicated, weight gradients all-reduced inside the group); when unset both are
  searched.
- **PP** splits the kernels of the sharded (per-chip) graph into an ordered partition of at most
  ``pp`` stages, each stage a difference of two down-sets (a chain of ideals ``{} = I_0 <= I_1 <=
  ... <= I_pp = V``: a consumer never runs in an earlier stage than its producer), minimising the
  slowest stage. This is a bottleneck path over the lattice of ideals (DESIGN.md section 5,
  "of the max objective a bottleneck path"), solved exactly by :func:`min_max_chain` (a
  Dijkstra on ``(ideal, stages used)`` with lazily costed edges and additive per-kernel lower
  bounds). Stages are down-sets of the *whole* pass, forward and backward alike (not layer
  blocks with their own backward as in 1F1B). Above :data:`MAX_IDEALS` ideals the graph is too
  wide for the exact path: ``pp > 1`` then raises InputError when fixed (use ``pp=1``) and is
  not searched otherwise.
- Stage time = the intra-chip pass (:func:`dfmodel.inter_chip.families.chip_time`, i.e.
  :func:`dfmodel.intra_chip.partition`) of the stage's kernels, cached by kernel set, **plus**
  the point-to-point transfer of the tensors crossing into the stage from earlier stages (one
  message of their bytes, ``p2p`` over the PP group from the system's collective-cost table;
  conservatively not overlapped with the stage's work). A stage whose memory does not fit costs
  ``inf``, so the partition found is the fastest one that fits.
- The graph's own ``comm`` kernels cost their collective of ``comm_bytes`` over the group their
  ``comm_group`` names (``tp``, ``pp``, ``dp``; anything else: all chips); they shard as
  pass-through kernels.
- **DP**: ``dp`` replicas each run their own pass; the weight gradients (graph outputs of
  ``weight_grad`` kernels) are all-reduced over the DP group (reduce-scatter + all-gather with
  ``distributed_optimizer``), the exposed part per the system's ``dp_overlap``
  (:func:`dfmodel.inter_chip.pipeline.dp_sync_time`, hidden behind the stage's backward and
  weight-gradient partitions).

Steady state: passes stream through the stages, one pass per stage per period, so

    iteration_time_s = max_s T_s + max_s (exposed DP sync_s + optimizer step_s)

per pass of the global work (``dp`` passes, ``dp * batch`` samples); ``samples_per_s = dp *
batch / iteration_time_s``; the single-pass latency (sum of the stage times, p2p included) is
reported in ``notes`` and ``pipeline``. The optimizer step is memory-bound Adam over the
stage's parameters (:data:`~dfmodel.inter_chip.llm.OPTIMIZER_BYTES_PER_PARAM` bytes of DRAM
traffic per parameter, divided by ``dp`` with ``distributed_optimizer``); explicit graphs name
no optimizer, so Adam (mixed precision) is assumed when the graph trains (has weight-gradient
outputs) and declares parameters; a graph without weight gradients is inference (no gradients,
sync, optimizer state or step).

Memory per chip of a stage (the worst stage is reported): ``weights`` = the parameters its
kernels own (``Kernel.params``, counted on forward kernels, divided by the TP split of their
weight) x bytes per element; ``gradients`` = the weight-gradient outputs it produces (their
per-chip bytes after sharding); ``optimizer`` = 12 bytes per parameter (fp32 master, momentum,
variance; Rajbhandari et al., ZeRO, SC 2020, sec. 3.1), divided by ``dp`` with
``distributed_optimizer``; ``activations`` = the intra-chip plan's peak of live intermediate
tensors plus the stage's boundary tensors (inputs read or received, outputs written or sent).
First-order simplification: when a weight's forward and weight-gradient kernels fall in
different stages each stage is charged what it holds (the parameters with the forward kernel,
the gradient with the weight-gradient kernel); moving the gradient to the owner is not modelled.

Breakdown (the LLM keys): the bottleneck stage's partitions under ``compute`` / ``memory`` /
``tp_comm`` (each partition under its dominant term; TP collectives are the network term),
its incoming p2p under ``pp_comm``, the exposed gradient sync under ``dp_comm``, the optimizer
step under ``optimizer``; ``bubble = 0`` (steady state), ``input = 0``. They add up to the
iteration time.

Knobs: ``tp``, ``pp``, ``dp``, ``sequence_parallel`` (see above) and ``distributed_optimizer``
(only when the graph trains) are honoured; ``micro_batch`` (the graph is written for its
batch), ``recompute`` (no recompute rules for arbitrary kernels) and ``interleave`` (stages
stream whole passes) raise InputError.

The outer search is :func:`dfmodel.inter_chip.families.run_search` (best-bound-first, valid
bounds: the compute floor of the pass over ``tp x pp`` chips plus the optimizer step of the
fewest parameters a chip can hold; once a candidate's sharding is known, the per-kernel stage
floors of its per-chip graph over ``pp``; ``exhaustive=True`` evaluates every candidate).

Speed: the stage search costs a stage lazily (A* with per-kernel lower bounds and an exact p2p
bound per edge). On kernel-by-kernel chips a kernel's own partition costs the same in every
stage, so when the closed form is exact for every kernel set (each tensor's edges of one size,
everything fitting in DRAM at once) a stage's time is the sum of its kernels' closed-form times
and the intra-chip pass runs only for the stages of the partition chosen (its result is checked
against the sum; on a mismatch every stage is costed by the intra-chip pass). Graphs of tens of
kernels and a few thousand ideals take seconds to a minute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from dfmodel.errors import InfeasibleError, InputError
from dfmodel.graph.builders.explicit import build_explicit
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind, Phase, Tensor
from dfmodel.inter_chip.config import Knobs, divisors
from dfmodel.inter_chip.family_api import ModelFamily
from dfmodel.inter_chip.family_base import (
    ChipTime,
    FamilyEvaluation,
    FamilyMemory,
    MisfitTracker,
    build_result,
    chip_time,
    empty_breakdown,
    peak_flops,
    reject_knobs,
    run_search,
)
from dfmodel.inter_chip.llm import OPTIMIZER_BYTES_PER_PARAM
from dfmodel.inter_chip.pipeline import dp_sync_time
from dfmodel.inter_chip.sharding import ShardedGraph, TPGroup, shard
from dfmodel.intra_chip.cost import combine_times
from dfmodel.algorithms import MAX_IDEALS, Chain, TooLarge, enumerate_ideals, min_max_chain, pack_masks
from dfmodel.netmodels import CostTable, split_dims
from dfmodel.result import Parallelism
from dfmodel.system.processor import achieved_rate_Fps, compute_time_s, memory_time_s
from dfmodel.system.schema import System

#: Mixed-precision Adam state per parameter: fp32 master, momentum, variance (ZeRO sec. 3.1).
OPTIMIZER_STATE_BYTES_PER_PARAM = 12.0


# --------------------------------------------------------------------------------------------
# Exact min-max ordered partition: a bottleneck path over the lattice of ideals
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Mapping, the sharded graph and its stages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class GraphMapping:
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    placement: tuple = ()

    def group(self, name: str):
        return dict(self.placement).get(name, ())

    def dims_report(self) -> dict[str, list[str]]:
        return {name: [f"{d}:{n}" for d, n in grp] for name, grp in self.placement}


def is_weight_grad_output(graph: DataflowGraph, t) -> bool:
    """A graph output produced by a weight-gradient kernel (after sharding: or by the comm kernel
    that reduces one, which inherits the phase)."""
    return t.consumer is None and t.producer is not None and graph.kernel(t.producer).phase == Phase.weight_grad


def stage_graph(graph: DataflowGraph, names: list[str]) -> DataflowGraph:
    """The graph of one stage: its kernels, and every tensor touching them, cut at the boundary.

    Like :meth:`DataflowGraph.subgraph`, except that a tensor arriving from a kernel of another
    stage is renamed ``name@producer``: the intra-chip pass groups tensors by (name, producer),
    and two different tensors of one name (e.g. a tensor and its all-gathered copy after
    sharding) would otherwise merge into one input.
    """
    keep = set(names)
    tensors = []
    for t in graph.tensors:
        pin, cin = t.producer in keep, t.consumer in keep
        if not pin and not cin:
            continue
        name = t.name if pin or t.producer is None else f"{t.name}@{t.producer}"
        tensors.append(Tensor(name, t.producer if pin else None, t.consumer if cin else None, t.bytes, t.operand,
                              t.shape))
    return DataflowGraph([k for k in graph.kernels if k.name in keep], tensors, name=f"{graph.name}[stage]",
                         meta=graph.meta)


@dataclass
class Prepared:
    """The per-chip graph of one TP sharding and what the stage search needs of it."""

    key: tuple
    sharded: ShardedGraph
    names: list[str]  # topological order: bit k of a mask is names[k]
    preds: list[int]
    lower: np.ndarray  # n x c per-kernel terms: any stage's time >= the largest component sum
    params: np.ndarray  # per-kernel parameters per chip
    inflow: list[tuple[int, int, float]]  # (producer bit, consumer mask, least bytes) per tensor
    network_s: dict[str, float]  # comm kernel -> collective time (sharding's and the graph's own)
    fast: dict[str, float] | None = None  # kernel-by-kernel: closed-form time of each kernel
    tensor_bytes: dict[tuple, float] = field(default_factory=dict)  # (name, producer) -> largest edge

    @property
    def graph(self) -> DataflowGraph:
        return self.sharded.graph

    def kernels(self, mask: int) -> list[str]:
        return [nm for k, nm in enumerate(self.names) if (mask >> k) & 1]


@dataclass
class StageEval:
    """One stage's time and memory. ``chip`` is None when the intra-chip pass was not run (the
    kernel-by-kernel fast path: ``chip_s`` is then the exact sum of the kernels' closed-form
    times, and ``memory.activations`` an upper estimate) or found nothing (``reason``)."""

    kernels: list[str]
    chip: ChipTime | None
    chip_s: float
    p2p_bytes: float
    p2p_s: float
    params: float
    grad_bytes: float
    memory: FamilyMemory
    fits: bool
    reason: str = ""

    @property
    def time_s(self) -> float:
        return self.chip_s + self.p2p_s


class GraphModel:
    family = "graph"

    def __init__(self, workload, system: System, *, solver: str = "auto", time_limit_s: float | None = None,
                 pp_fixed: bool = False):
        self.workload, self.system = workload, system
        self.solver, self.time_limit_s = solver, time_limit_s
        self.pp_fixed = pp_fixed
        self.precision = workload.precision
        peak_flops(system, self.precision, workload)
        self.graph = build_explicit(workload)
        self.costs = CostTable(system)
        self.N = system.num_chips
        self.chip = system.chip
        self.capacity = float(system.chip.memory.usable_bytes)  # capacity minus the reserve
        self.bpe = float(self.precision.bytes)
        g = self.graph
        self.grad_outputs = {(t.name, t.producer): t.bytes for t in g.tensors if is_weight_grad_output(g, t)}
        self.trains = bool(self.grad_outputs)
        self.params_total = g.params()
        self.kbk = system.chip.execution != "dataflow"
        floor = 0.0
        for k in g.kernels:
            if k.kind == KernelKind.comm or k.flop == 0:
                continue
            rate = achieved_rate_Fps(self.chip, k, self.precision)
            floor += k.flop / rate  # compute_time_s without padding: never more than a shard x tp
        self.compute_floor_s = floor
        self.misfits = MisfitTracker()
        self._sharded: dict[tuple, ShardedGraph | str] = {}
        self._prepared: dict[tuple, Prepared | str] = {}
        self._chip: dict[tuple, ChipTime | str] = {}
        self._stage: dict[tuple, StageEval] = {}
        self._chains: dict[tuple, tuple] = {}
        try:
            self.ideals = len(enumerate_ideals(len(g.kernels), self._preds(g, g.topological_names())))
        except TooLarge:
            self.ideals = None

    @property
    def smallest_misfit(self) -> str | None:
        return self.misfits.message

    @staticmethod
    def _preds(graph: DataflowGraph, names: list[str]) -> list[int]:
        idx = {nm: i for i, nm in enumerate(names)}
        preds = [0] * len(names)
        for t in graph.internal_tensors():
            preds[idx[t.consumer]] |= 1 << idx[t.producer]
        return preds

    # -- sharding -------------------------------------------------------------------------------
    def explicit_comm_s(self, m: GraphMapping) -> dict[str, float]:
        """Network time of the graph's own ``comm`` kernels: their collective of ``comm_bytes``
        over the group ``comm_group`` names (``tp``, ``pp`` or ``dp``; anything else: all chips)."""
        out = {}
        everyone = tuple((d.name, d.size) for d in self.system.network)
        for k in self.graph.kernels:
            if k.kind == KernelKind.comm:
                grp = m.group(k.comm_group) if k.comm_group in ("tp", "pp", "dp") else everyone
                out[k.name] = self.costs.time_s(k.collective, k.comm_bytes, grp) if grp and k.comm_bytes > 0 else 0.0
        return out

    def sharded(self, m: GraphMapping) -> ShardedGraph | str:
        sp = bool(m.sequence_parallel and m.tp > 1)
        key = (m.tp, m.group("tp"), sp)
        if key not in self._sharded:
            try:
                self._sharded[key] = shard(self.graph, self.system, TPGroup(m.tp, m.group("tp")), self.costs,
                                           sequence_parallel=sp, solver=self.solver, time_limit_s=self.time_limit_s)
            except InfeasibleError as e:
                self._sharded[key] = str(e)
        return self._sharded[key]

    def prepared_key(self, m: GraphMapping) -> tuple:
        own = self.explicit_comm_s(m)
        return (m.tp, m.group("tp"), bool(m.sequence_parallel and m.tp > 1), tuple(sorted(own.items())))

    def prepared(self, m: GraphMapping) -> Prepared:
        """The TP-sharded per-chip graph of ``m`` and its stage-search data (cached)."""
        key = self.prepared_key(m)
        if key not in self._prepared:
            sg = self.sharded(m)
            if isinstance(sg, str):
                self._prepared[key] = sg
            else:
                g = sg.graph
                net = {**sg.network_time_s, **dict(key[3])}
                names = g.topological_names()
                sharers: dict[str, int] = {}
                for k in g.kernels:
                    if k.weight:
                        sharers[k.weight] = sharers.get(k.weight, 0) + 1
                lower = np.array([self._kernel_floor_s(g.kernel(nm), net.get(nm, 0.0), sharers)
                                  for nm in names])
                params = np.array([g.kernel(nm).params for nm in names])
                idx = {nm: i for i, nm in enumerate(names)}
                flows: dict[tuple, list] = {}
                for t in g.internal_tensors():
                    f = flows.setdefault((t.name, t.producer), [1 << idx[t.producer], 0, math.inf])
                    f[1] |= 1 << idx[t.consumer]
                    f[2] = min(f[2], t.bytes)
                prep = Prepared(key, sg, names, self._preds(g, names), lower, params,
                                [tuple(f) for f in flows.values()], net)
                for t in g.tensors:
                    tk = (t.name, t.producer)
                    prep.tensor_bytes[tk] = max(prep.tensor_bytes.get(tk, 0.0), t.bytes)
                if self.kbk:
                    self._kernel_rows(prep)
                self._prepared[key] = prep
        p = self._prepared[key]
        if isinstance(p, str):
            raise InfeasibleError(p)
        return p

    def _kernel_rows(self, p: Prepared) -> None:
        """Kernel-by-kernel chips: exact per-kernel stage terms, and the fast path when it is exact.

        A kernel's own partition costs the same in any stage (its weights, collective and output
        do not depend on the stage) except that the intra-chip pass sizes a tensor by its largest
        edge among those it sees (:func:`stage_graph`); with every tensor's edges at their smallest
        size the closed-form rows are lower bounds in any stage, and exact when a tensor's edges all
        have one size
        (then a stage's time is the sum of its rows, provided every tensor and weight fits in
        DRAM at once, so no lifetime check can move the pass off the closed form)."""
        g = p.graph
        smallest: dict[tuple, float] = {}
        for t in g.tensors:
            tk = (t.name, t.producer)
            smallest[tk] = min(smallest.get(tk, math.inf), t.bytes)
        uniform = all(smallest[tk] == p.tensor_bytes[tk] for tk in smallest)
        full = (1 << len(p.names)) - 1
        if uniform:
            whole = self.chip_time(p, full)
        else:
            aux = DataflowGraph(g.kernels, [replace(t, bytes=smallest[(t.name, t.producer)]) for t in g.tensors],
                                name=f"{g.name}[smallest]", meta=g.meta)
            try:
                whole = chip_time(aux, self.system, p.network_s,
                                  solver=self.solver, time_limit_s=self.time_limit_s)
            except InfeasibleError:
                return
        if not (isinstance(whole, ChipTime) and whole.single_kernel and whole.method == "closed_form"):
            return
        row = {r["kernels"][0]: r["time_s"] for r in whole.rows}
        if len(row) != len(p.names):
            return
        p.lower = np.array([[max(p.lower[i, 0], row[nm])] for i, nm in enumerate(p.names)])
        parked = sum(p.tensor_bytes.values()) + sum(k.weight_bytes for k in g.kernels)
        if uniform and parked <= self.capacity:
            p.fast = row

    def _kernel_floor_s(self, k, network_s: float, sharers: dict[str, int]) -> list[float]:
        """Per-kernel lower-bound components of any stage's intra-chip time.

        Kernel-by-kernel chips: one component, the kernel's own partition ``combine(compute,
        weights + extra traffic, network) + overhead``. Dataflow chips: compute, memory (extra
        traffic and the kernel's share of its weight, read by every partition using it) and
        network; a partition costs at least ``combine`` of its sums (a fused partition's pace is
        at least the sum of its kernels' whole-chip times) and ``sum_p max(.) >= max(sum_p .)``,
        so with overlap the largest component sum bounds a stage; without overlap one component,
        their sum."""
        c = compute_time_s(self.chip, k, self.precision)
        if self.kbk:
            m = memory_time_s(self.chip, k.weight_bytes + k.extra_memory_bytes)
            return [float(combine_times(c, m, network_s, self.chip.overlap)) + self.chip.efficiency.kernel_overhead_s]
        m = memory_time_s(self.chip, k.extra_memory_bytes + k.weight_bytes / sharers.get(k.weight, 1))
        return [c, m, network_s] if self.chip.overlap else [c + m + network_s]

    def p2p_lower(self, p: Prepared, pp_group):
        """Edge bound for :func:`min_max_chain`: the p2p time of the tensors that must cross into
        the stage ``J' - J`` (produced in ``J``, read in the stage; least bytes per tensor)."""
        if not pp_group or not p.inflow:
            return None
        n = len(p.names)
        prod = pack_masks([f[0] for f in p.inflow], n)
        cons = pack_masks([f[1] for f in p.inflow], n)
        size = np.array([f[2] for f in p.inflow])
        memo: dict[float, float] = {}

        def bound(J: np.ndarray, Js: np.ndarray) -> np.ndarray:
            active = np.flatnonzero(np.any(prod & J, axis=1))
            if active.size == 0:
                return np.zeros(Js.shape[0])
            S = Js & ~J
            hit = np.any((S[:, None, :] & cons[None, active, :]) != 0, axis=2)
            totals = hit.astype(float) @ size[active]
            out = np.empty(totals.size)
            for i, b in enumerate(totals):
                if b not in memo:
                    memo[b] = self.costs.time_s("p2p", b, pp_group) if b > 0 else 0.0
                out[i] = memo[b]
            return out

        return bound

    # -- one stage --------------------------------------------------------------------------------
    def chip_time(self, p: Prepared, mask: int) -> ChipTime | str:
        key = (p.key, mask)
        if key not in self._chip:
            names = p.kernels(mask)
            sub = stage_graph(p.graph, names)
            net = {nm: p.network_s[nm] for nm in names if nm in p.network_s}
            try:
                self._chip[key] = chip_time(sub, self.system, net, solver=self.solver, time_limit_s=self.time_limit_s)
            except InfeasibleError as e:
                self._chip[key] = str(e)
        return self._chip[key]

    def stage(self, p: Prepared, mask: int, pp_group, opt_shard: int, *, exact: bool = False) -> StageEval:
        """Time (intra-chip + incoming p2p) and memory of the stage ``mask``. Without ``exact``,
        kernel-by-kernel chips whose closed form is exact for every kernel set
        (:attr:`Prepared.fast`) skip the intra-chip pass unless memory is in doubt: it fits when
        even every internal tensor live at once would, and does not when the state and boundary
        tensors alone do not."""
        key = (p.key, mask, pp_group, opt_shard, exact)
        if key in self._stage:
            return self._stage[key]
        g = p.graph
        names = p.kernels(mask)
        inside = set(names)
        received: dict[tuple, float] = {}
        boundary: dict[tuple, float] = {}
        grads: dict[tuple, float] = {}
        internal: set[tuple] = set()
        for t in g.tensors:
            prod_in, cons_in = t.producer in inside, t.consumer in inside
            if prod_in and cons_in:
                internal.add((t.name, t.producer))
            elif cons_in:
                key_t = (t.name, t.producer)
                boundary[key_t] = max(boundary.get(key_t, 0.0), t.bytes)
                if t.producer is not None:
                    received[key_t] = max(received.get(key_t, 0.0), t.bytes)
            elif prod_in:
                key_t = (t.name, t.producer, "out")
                if is_weight_grad_output(g, t):
                    grads[key_t] = max(grads.get(key_t, 0.0), t.bytes)
                else:
                    boundary[key_t] = max(boundary.get(key_t, 0.0), t.bytes)
        p2p_bytes = float(sum(received.values()))
        p2p_s = self.costs.time_s("p2p", p2p_bytes, pp_group) if p2p_bytes > 0 and pp_group else 0.0
        params = float(sum(p.params[k] for k in range(len(p.names)) if (mask >> k) & 1))
        grad_bytes = float(sum(grads.values()))
        state = OPTIMIZER_STATE_BYTES_PER_PARAM * params / opt_shard if self.trains else 0.0
        edge = float(sum(boundary.values()))
        mem = FamilyMemory(params * self.bpe, grad_bytes, state, edge, self.capacity)
        if not exact and p.fast is not None:
            chip_s = float(sum(p.fast[nm] for nm in names))
            # the intra-chip pass keeps a tensor (all edges of a name, at their largest) live at most once
            upper = float(sum(p.tensor_bytes[k] for k in internal))
            hi = FamilyMemory(params * self.bpe, grad_bytes, state, edge + upper, self.capacity)
            if hi.fits or not mem.fits:
                ev = StageEval(names, None, chip_s, p2p_bytes, p2p_s, params, grad_bytes, hi, hi.fits)
                self._stage[key] = ev
                return ev
        ct = self.chip_time(p, mask)
        if isinstance(ct, str):
            ev = StageEval(names, None, math.inf, p2p_bytes, p2p_s, params, grad_bytes, mem, False, f"intra-chip: {ct}")
        else:
            mem.activations_bytes += ct.peak_live_bytes
            ev = StageEval(names, ct, ct.time_s, p2p_bytes, p2p_s, params, grad_bytes, mem, mem.fits)
        self._stage[key] = ev
        return ev

    def chain(self, p: Prepared, m: GraphMapping, *, check_memory: bool = True, exact: bool = False) -> Chain | None:
        """The fastest ordered partition into at most ``m.pp`` stages (cached)."""
        pp_group = m.group("pp") if m.pp > 1 else ()
        opt_shard = m.dp if m.distributed_optimizer else 1
        key = (p.key, m.pp, pp_group, opt_shard, check_memory, exact or p.fast is None)
        if key not in self._chains:

            def cost(mask: int) -> float:
                st = self.stage(p, mask, pp_group, opt_shard, exact=exact)
                if math.isinf(st.chip_s) or (check_memory and not st.fits):
                    return math.inf
                return st.time_s

            try:
                self._chains[key] = (min_max_chain(len(p.names), p.preds, m.pp, cost, p.lower,
                                                   edge_lower=self.p2p_lower(p, pp_group)), None)
            except TooLarge as e:
                self._chains[key] = (None, str(e))
        chain, err = self._chains[key]
        if err is not None:
            raise TooLarge(err)
        return chain

    def exact_stages(self, p: Prepared, m: GraphMapping, chain: Chain) -> list[StageEval] | None:
        """The chain's stages through the intra-chip pass; None when that disagrees with the fast
        path (then the caller repeats the partition with exact stage costs)."""
        pp_group = m.group("pp") if m.pp > 1 else ()
        opt_shard = m.dp if m.distributed_optimizer else 1
        out = []
        for mask in chain.stages:
            st = self.stage(p, mask, pp_group, opt_shard, exact=True)
            fast = self.stage(p, mask, pp_group, opt_shard)
            if st.chip is None or not st.fits or not math.isclose(st.chip_s, fast.chip_s, rel_tol=1e-9, abs_tol=1e-15):
                return None
            out.append(st)
        return out

    # -- search interface ---------------------------------------------------------------------
    def optimizer_s(self, params_per_chip: float, opt_shard: int) -> float:
        """Memory-bound Adam step over a chip's parameters (0 when the graph does not train)."""
        if not self.trains or params_per_chip <= 0:
            return 0.0
        return memory_time_s(self.chip, OPTIMIZER_BYTES_PER_PARAM * params_per_chip / opt_shard)

    def memory_floor_bytes(self, m: GraphMapping) -> float:
        """Model state of the lightest possible worst chip: every parameter and gradient split
        evenly over the ``tp x pp`` chips of a replica (a chip of a TP group holds at least
        ``1/tp`` of its stage's share, and the worst stage at least ``1/pp`` of the total)."""
        share = m.tp * m.pp
        opt_shard = m.dp if m.distributed_optimizer else 1
        state = OPTIMIZER_STATE_BYTES_PER_PARAM / opt_shard if self.trains else 0.0
        return (self.params_total * (self.bpe + state) + sum(self.grad_outputs.values())) / share

    def lower_bound_s(self, m: GraphMapping) -> float:
        """``max stage >= mean stage``: the pass's compute floor (no padding) split over the
        ``tp x pp`` chips of a replica (plus one kernel overhead per kernel on kernel-by-kernel
        chips), plus the optimizer step of the fewest parameters a chip can hold."""
        over = len(self.graph.kernels) * self.chip.efficiency.kernel_overhead_s if self.kbk else 0.0
        opt_shard = m.dp if m.distributed_optimizer else 1
        return (self.compute_floor_s / m.tp + over) / m.pp + \
            self.optimizer_s(self.params_total / (m.tp * m.pp), opt_shard)

    def refined_bound_s(self, m: GraphMapping) -> float | None:
        """Once the candidate's sharding is solved: the per-kernel stage floors of the sharded
        graph over ``pp`` stages, plus the optimizer step of its parameters over ``pp``."""
        p = self._prepared.get(self.prepared_key(m))
        if not isinstance(p, Prepared):
            return None
        opt_shard = m.dp if m.distributed_optimizer else 1
        return float(p.lower.sum(axis=0).max()) / m.pp + self.optimizer_s(float(p.params.sum()) / m.pp, opt_shard)

    def describe(self, m: GraphMapping) -> str:
        extra = (", sequence parallel" if m.sequence_parallel and m.tp > 1 else "") + \
            (", distributed optimizer" if m.distributed_optimizer else "")
        return f"tp {m.tp} x pp {m.pp} x dp {m.dp}{extra}"

    def _misfit(self, m: GraphMapping, msg: str, shortfall: float = math.inf,
                mem: FamilyMemory | None = None) -> FamilyEvaluation:
        msg = f"{self.describe(m)}: {msg}"
        self.misfits.add(shortfall, msg)
        mem = mem or FamilyMemory(0.0, 0.0, 0.0, 0.0, self.capacity)
        return FamilyEvaluation(m, math.inf, empty_breakdown(), mem, False, True, reason=msg)

    def evaluate(self, m: GraphMapping) -> FamilyEvaluation:
        try:
            p = self.prepared(m)
        except InfeasibleError as e:
            return self._misfit(m, f"sharding: {e}")
        pp_group = m.group("pp") if m.pp > 1 else ()
        opt_shard = m.dp if m.distributed_optimizer else 1
        try:
            chain = self.chain(p, m)
        except TooLarge as e:
            if self.pp_fixed:
                raise InputError(f"the sharded graph is too wide for the exact stage partition ({e}); use pp=1",
                                 field="pp") from None
            return self._misfit(m, f"stage partition: {e}")
        if chain is None:
            return self._no_fit(p, m, pp_group, opt_shard)
        stages = self.exact_stages(p, m, chain)
        if stages is None:  # the fast path was wrong about a stage: cost every stage exactly
            chain = self.chain(p, m, exact=True)
            if chain is None:
                return self._no_fit(p, m, pp_group, opt_shard)
            stages = [self.stage(p, mask, pp_group, opt_shard, exact=True) for mask in chain.stages]
        dp_group = m.group("dp")
        exposed, opt, sync = [], [], []
        for st in stages:
            s = 0.0
            if m.dp > 1 and st.grad_bytes > 0:
                if m.distributed_optimizer:
                    s = self.costs.time_s("reduce_scatter", st.grad_bytes, dp_group) + \
                        self.costs.time_s("all_gather", st.grad_bytes, dp_group)
                else:
                    s = self.costs.time_s("all_reduce", st.grad_bytes, dp_group)
            sync.append(s)
            exposed.append(dp_sync_time(st.grad_bytes, s, st.chip.backward_s, self.system.dp_overlap) if s > 0 else 0.0)
            opt.append(self.optimizer_s(st.params, opt_shard))
        times = [st.time_s for st in stages]
        b = max(range(len(stages)), key=lambda i: (times[i], -i))
        x = max(range(len(stages)), key=lambda i: (exposed[i] + opt[i], -i))
        total = times[b] + exposed[x] + opt[x]
        br = empty_breakdown()
        for k, v in stages[b].chip.parts_s.items():
            br[k] += v
        br.update(pp_comm=stages[b].p2p_s, dp_comm=exposed[x], optimizer=opt[x])
        worst = max(stages, key=lambda st: st.memory.total_bytes).memory
        proven = p.sharded.plan.status == "optimal" and all(st.chip.proven_optimal for st in stages)
        detail = {"stages": stages, "bottleneck": b, "exposed_s": exposed, "sync_s": sync, "optimizer_s": opt,
                  "latency_s": float(sum(times)), "chain": chain, "prepared": p}
        return FamilyEvaluation(m, total, br, worst, True, proven, stages[b].chip, detail)

    def _no_fit(self, p: Prepared, m: GraphMapping, pp_group, opt_shard) -> FamilyEvaluation:
        """No stage partition fits: report the worst stage of the fastest partition ignoring memory."""
        relaxed = self.chain(p, m, check_memory=False)
        if relaxed is None:
            whole = self.stage(p, (1 << len(p.names)) - 1, pp_group, opt_shard, exact=True)
            return self._misfit(m, whole.reason or "no stage partition runs on a chip")
        stages = [self.stage(p, mask, pp_group, opt_shard, exact=True) for mask in relaxed.stages]
        worst = max(stages, key=lambda st: st.memory.shortfall_bytes)
        where = f"stage {stages.index(worst)} of {len(stages)}" if len(stages) > 1 else "the one stage"
        return self._misfit(m, f"{where} {worst.memory.summary()}", worst.memory.shortfall_bytes, worst.memory)


# --------------------------------------------------------------------------------------------
# Candidates and entry point
# --------------------------------------------------------------------------------------------

_WHY = {
    "micro_batch": "an explicit graph is written for its own batch (the workload's batch field); it cannot be "
                   "re-split into micro-batches",
    "recompute": "an explicit graph has no recompute rules (recompute must be 'none')",
    "interleave": "an explicit graph's stages stream whole passes; there is no interleaving (interleave must be 1)",
}


def candidates(model: GraphModel, knobs: Knobs):
    N = model.N
    for name in ("tp", "pp", "dp"):
        v = getattr(knobs, name)
        if v is not None and N % v:
            raise InputError(f"must divide the {N} chips, got {v}", field=name)
    fixed = [getattr(knobs, n) for n in ("tp", "pp", "dp")]
    if all(v is not None for v in fixed) and math.prod(fixed) != N:
        raise InputError(f"tp x pp x dp = {math.prod(fixed)} but the system has {N} chips", field="tp/pp/dp")
    if knobs.distributed_optimizer and not model.trains:
        raise InputError("the graph has no weight gradients (no training step), so there is no optimizer to shard",
                         field="distributed_optimizer")
    if knobs.pp is not None and knobs.pp > 1 and model.ideals is None:
        raise InputError(f"the graph has more than {MAX_IDEALS} down-sets, too many for the exact stage partition; "
                         "use pp=1", field="pp")
    n_kernels = len(model.graph.kernels)
    found = False
    for tp in divisors(N):
        if knobs.tp is not None and tp != knobs.tp:
            continue
        for pp in divisors(N // tp):
            if knobs.pp is not None and pp != knobs.pp:
                continue
            if knobs.pp is None and pp > 1 and (pp > n_kernels or model.ideals is None):
                continue
            dp = N // (tp * pp)
            if knobs.dp is not None and dp != knobs.dp:
                continue
            sps = [knobs.sequence_parallel] if knobs.sequence_parallel is not None else \
                ([False, True] if tp > 1 else [False])
            dists = [knobs.distributed_optimizer] if knobs.distributed_optimizer is not None else \
                ([False, True] if dp > 1 and model.trains else [False])
            for lay in split_dims(model.system, {"tp": tp, "pp": pp, "dp": dp}):
                place = tuple((k, tuple(lay[k])) for k in ("tp", "pp", "dp"))
                for sp in sps:
                    for dist in dists:
                        found = True
                        yield GraphMapping(tp, pp, dp, bool(sp), bool(dist), place)
    if not found:
        raise InfeasibleError(f"graph: no tp x pp x dp mapping of {N} chips fits the fixed knobs and the network")


def solve_graph(workload, system: System, knobs: Knobs, *, solver: str = "auto", time_limit_s: float | None = None,
                exhaustive: bool = False):
    """Fastest mapping of an explicit graph (see the module doc); raises InputError for knobs it
    cannot honour and InfeasibleError (naming the shortfall) when nothing fits."""
    reject_knobs(knobs, "an explicit graph", ("tp", "pp", "dp", "sequence_parallel", "distributed_optimizer"), _WHY)
    model = GraphModel(workload, system, solver=solver, time_limit_s=time_limit_s,
                       pp_fixed=knobs.pp is not None and knobs.pp > 1)
    best, stats = run_search(model, candidates(model, knobs), exhaustive=exhaustive)
    return to_result(model, best, stats)


def to_result(model: GraphModel, ev: FamilyEvaluation, stats):
    m: GraphMapping = ev.mapping
    w, system = model.workload, model.system
    d = ev.detail
    stages: list[StageEval] = d["stages"]
    p: Prepared = d["prepared"]
    stage_of = {k: i for i, st in enumerate(stages) for k in st.kernels}
    sharding = {}
    for k in p.graph.kernels:
        where = f" (stage {stage_of[k.name]})" if m.pp > 1 else ""
        if k.name in p.sharded.network_time_s:
            sharding[k.name] = f"{k.collective} over the TP group ({m.tp} chips){where}"
        elif k.kind == KernelKind.comm:
            grp = k.comm_group if k.comm_group in ("tp", "pp", "dp") else "all chips"
            sharding[k.name] = f"the graph's {k.collective} over {grp}{where}"
        else:
            sharding[k.name] = f"{p.sharded.plan.strategy.get(k.name, 'rep')}{where}"
    flop = model.graph.total_flop() * m.dp
    ideals = d["chain"].ideals
    notes = [
        f"explicit graph: one pass = batch {w.batch}; {model.describe(m)}: each of {m.dp} replica(s) streams its own "
        f"pass through {len(stages)} stage(s) of {m.tp} chip(s); iteration = one pass per replica "
        f"({m.dp * w.batch} samples)",
        f"steady state: iteration = slowest stage {max(st.time_s for st in stages):.4g} s + exposed DP sync + "
        f"optimizer step; single-pass latency (sum of stages, p2p included) {d['latency_s']:.4g} s",
        "stages: the fastest ordered partition of the sharded graph's kernels into at most pp down-set "
        "differences (exact bottleneck path over the ideal lattice"
        + (f", {ideals} ideals" if ideals else "") + f", {d['chain'].evaluated} stage sets costed)",
        "breakdown: the bottleneck stage's partitions -> compute / memory / tp_comm (dominant term), its incoming "
        "p2p -> pp_comm, exposed weight-gradient sync -> dp_comm, Adam step -> optimizer; bubble 0 (steady state)",
    ]
    if model.trains:
        notes.append(
            ("optimizer: Adam assumed (explicit graphs name none): "
             f"{OPTIMIZER_STATE_BYTES_PER_PARAM:g} B/param state, {OPTIMIZER_BYTES_PER_PARAM:g} B/param step traffic"
             + (f", sharded over dp {m.dp}" if m.distributed_optimizer else ""))
            if model.params_total > 0 else
            "the graph has weight gradients but declares no params: no optimizer state or step")
    else:
        notes.append("no weight-gradient outputs: inference (no gradient sync, optimizer state or step)")
    notes.append("samples_per_s = tokens_per_s = dp x batch / iteration")
    if len(stages) < m.pp:
        notes.append(f"only {len(stages)} of the {m.pp} stages hold kernels (more would not be faster)")
    if model.ideals is None:
        notes.append(f"the graph has more than {MAX_IDEALS} down-sets: only pp = 1 was searched")
    par = Parallelism(tp=m.tp, pp=m.pp, dp=m.dp, micro_batch=w.batch, num_micro_batches=1,
                      sequence_parallel=bool(m.sequence_parallel and m.tp > 1),
                      distributed_optimizer=m.distributed_optimizer, dims=m.dims_report())
    pipeline = {
        "schedule": "steady-state streaming of whole passes (no bubble)",
        "latency_s": d["latency_s"],
        "bottleneck_stage": d["bottleneck"],
        "ideals": ideals,
        "stages": [
            {"kernels": st.kernels, "time_s": st.time_s, "chip_s": st.chip_s, "p2p_in_s": st.p2p_s,
             "p2p_in_bytes": st.p2p_bytes, "params_per_chip": st.params, "grad_bytes": st.grad_bytes,
             "dp_sync_s": d["sync_s"][i], "dp_exposed_s": d["exposed_s"][i], "optimizer_s": d["optimizer_s"][i],
             "memory_bytes": st.memory.to_dict()}
            for i, st in enumerate(stages)
        ],
        "tp_comm_s": dict(p.sharded.network_time_s),
        "graph_comm_s": {k: v for k, v in p.network_s.items() if k not in p.sharded.network_time_s},
    }
    return build_result(workload=w, system=system, ev=ev, stats=stats, useful_flop=flop, samples=m.dp * w.batch,
                        parallelism=par, sharding=sharding, intra_per="pass (bottleneck stage)", notes=notes,
                        pipeline=pipeline)


__all__ = ["solve_graph", "GraphModel", "GraphMapping", "min_max_chain", "enumerate_ideals", "candidates",
           "MAX_IDEALS"]


class GraphFamily(ModelFamily):
    """``kind: graph`` behind the common family interface (:mod:`dfmodel.inter_chip.family_api`)."""

    kind = "graph"
    model_class = GraphModel
    candidates_fn = staticmethod(candidates)
    result_fn = staticmethod(to_result)
    solve_fn = staticmethod(solve_graph)

    def model(self, workload, system, *, solver="auto", time_limit_s=None, knobs=None) -> GraphModel:
        pp_fixed = knobs is not None and knobs.pp is not None and knobs.pp > 1
        return GraphModel(workload, system, solver=solver, time_limit_s=time_limit_s, pp_fixed=pp_fixed)
