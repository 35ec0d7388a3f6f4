"""Best-bound-first search over the outer mapping space, with valid lower bounds and pruning.

Every candidate :class:`Mapping` gets a cheap lower bound (:meth:`LLMModel.lower_bound_s`) and,
before any inner solve, an exact memory check; candidates are visited in increasing bound order
and evaluated until the next bound is no better than the best time found. Each evaluation's inner
solves (sharding MILP, intra-chip partitions) are cached by the knobs they depend on. The best
mapping is optimal over the whole space within the model when every inner solve was proven.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import gc
import heapq
import itertools
import math
import time
from functools import partial
from dataclasses import dataclass, field

from dfmodel.cli_format import fmt_bytes
from dfmodel.errors import InfeasibleError, TimeLimitError
# the LLM mapping space lives in llm_space; re-exported here for existing imports
from dfmodel.inter_chip.llm_space import degree_triples, llm_candidates, validate_knobs  # noqa: F401
from dfmodel.inter_chip.space import SpaceNode
from dfmodel.solvers.deadline import (DeadlineExpired, deadline_scope, expired, grace_scope, interruptible_seconds,
                                      time_left_s)


@dataclass
class SearchStats:
    """What the search did, and how sure its answer is.

    ``status`` is ``optimal`` (every candidate that could beat the winner was evaluated and
    every inner solve proven) or ``time_limit`` (the deadline cut the search, or an inner
    solve stopped at its limit); then ``lower_bound_s`` is the smallest bound any unexplored
    or unproven candidate still had and ``gap`` = (best - bound) / best, as a MILP reports.
    ``ruled_out`` counts candidates whose lower bound was below the winner's time but which
    could not run (``memory``: over the chip's capacity, ``infeasible``: an inner pass found no
    plan, e.g. SRAM). ``runners_up`` are the next-best fitting evaluations, best first.
    """

    candidates: int = 0
    evaluated: int = 0
    pruned_bound: int = 0
    pruned_memory: int = 0
    wall_s: float = 0.0
    proven_optimal: bool = True
    #: every inner solve of every evaluation was proven (``proven_optimal`` also needs the search
    #: not cut: a parallel worker cut after its share's bound passed the winner proved its share)
    inner_proven: bool = True
    notes: list[str] = field(default_factory=list)
    status: str = "optimal"
    lower_bound_s: float | None = None
    gap: float = 0.0
    timed_out: bool = False
    ruled_out: dict[str, int] = field(default_factory=dict)
    runners_up: list = field(default_factory=list)
    why_not: dict[str, dict] = field(default_factory=dict)

    @property
    def pruned(self) -> int:
        return self.pruned_bound + self.pruned_memory


@dataclass(frozen=True)
class Progress:
    """A snapshot handed to ``search(progress=...)`` callbacks (at most ~10 per second)."""

    candidates: int
    evaluated: int
    pruned: int
    open: int  # candidates still in the queue
    best_s: float | None
    bound_s: float | None
    elapsed_s: float

    @property
    def gap(self) -> float | None:
        if self.best_s is None or self.bound_s is None or self.best_s <= 0:
            return None
        return max(0.0, (self.best_s - self.bound_s) / self.best_s)

    @property
    def done(self) -> int:
        return self.evaluated + self.pruned


_OPTIONS: contextvars.ContextVar[dict] = contextvars.ContextVar("dfmodel_search_options", default={})


@contextlib.contextmanager
def search_options(*, alternatives: int | None = None, progress=None, parallel=None):
    """Defaults for every :func:`search` run inside the block (``optimize`` sets them once,
    whichever family's solver runs the search); ``parallel`` runs a space's search instead of
    the serial one (:func:`dfmodel.inter_chip.parallel_search.parallel_search` on N workers)."""
    token = _OPTIONS.set({"alternatives": alternatives, "progress": progress, "parallel": parallel})
    try:
        yield
    finally:
        _OPTIONS.reset(token)


#: The cyclic collector's oldest-generation threshold while a search runs (CPython's default 10):
#: high enough that no full collection runs. :func:`search` builds millions of long-lived
#: objects (memos, groups, probes) and almost no cycles, and each full collection walks them
#: all: 15 of them were 5 of DeepSeek-V3 / 512 H100's 18 serial CPU s, and freed 63 objects.
FULL_GC_PAUSED_THRESHOLD = 1 << 30


@contextlib.contextmanager
def full_gc_paused():
    """Only the young generations are collected inside the block (cycles among new objects
    still are); the thresholds are restored on exit, when the next full collection frees
    whatever long-lived cycles the search left."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1], FULL_GC_PAUSED_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def search(model, candidates, *, exhaustive: bool = False, alternatives: int | None = None,
           time_limit_s: float | None = None, progress=None):
    """Best evaluation over ``candidates`` (an iterable of mappings), with statistics.

    Candidates are visited in increasing lower-bound order; the search stops when the next bound
    is no better than the ``alternatives + 1``-th best time found (so the runners-up it reports
    are exactly the next best, not whatever it happened to see). ``exhaustive=True`` evaluates
    everything (the oracle the tests compare against).

    ``time_limit_s`` (default: the model's ``time_limit_s``) caps the whole search: a deadline
    (:mod:`dfmodel.solvers.deadline`) that every inner MILP also honours. When it passes, the
    best mapping so far is returned with ``stats.status == "time_limit"``, the smallest bound
    left open and the relative gap; :class:`~dfmodel.errors.TimeLimitError` if nothing was
    evaluated yet. ``progress`` is called with a :class:`Progress` about ten times a second.
    """
    opts = _OPTIONS.get()
    if alternatives is None:
        alternatives = opts.get("alternatives") or 0
    if progress is None:
        progress = opts.get("progress")
    if time_limit_s is None:
        time_limit_s = getattr(model, "time_limit_s", None)
    with deadline_scope(time_limit_s), full_gc_paused():
        if opts.get("parallel") is not None and hasattr(candidates, "roots") and not exhaustive:
            return opts["parallel"](model, candidates, keep=max(0, int(alternatives)) + 1, progress=progress,
                                    limit_s=time_limit_s)
        return _search(model, candidates, exhaustive=exhaustive, keep=max(0, int(alternatives)) + 1,
                       progress=progress, limit_s=time_limit_s)


def _search(model, candidates, *, exhaustive: bool, keep: int, progress, limit_s: float | None = None,
            share=None):
    """Best-bound-first branch and bound. ``candidates`` is an iterable of mappings (each
    screened and bounded up front), or a space with ``roots()`` (:mod:`dfmodel.inter_chip.space`):
    groups of mappings with a bound and memory floor valid for all of them, expanded only when
    they reach the top of the queue below the cutoff."""
    t0 = time.perf_counter()
    stats = SearchStats()
    ledger = _Ledger()
    reporter = _Reporter(progress, t0)
    if share is not None:  # a worker of parallel_search: it reads these at the end
        share.stats, share.ledger = stats, ledger
    heap = []
    capacity = model.system.chip.memory.capacity_bytes
    floors = {"smallest": None}
    enumeration_cut = False
    # Under a deadline, an incumbent is taken early once a quarter of the time is gone (the best-bound
    # candidate seen, else the leanest in memory, which is the likeliest to fit) so that a cut
    # search still returns a mapping, as a MILP solver's primal heuristics do.
    limit_left = time_left_s()
    dive_at = None if limit_left is None or exhaustive else time.perf_counter() + 0.25 * limit_left
    dived: dict = {}  # mapping -> its evaluation (or the InfeasibleError it raised)
    seq = itertools.count()
    space = candidates if hasattr(candidates, "roots") and not exhaustive else None
    # optional: candidates to try when one does not fit in memory (LLM offload variants,
    # dfmodel.inter_chip.offload.variants); they join the space only then
    relief = getattr(model, "memory_relief", None)
    pending: list = []

    def admit(node) -> None:
        """A group onto the queue, or pruned with all its mappings when its floor cannot fit
        (then its relief group -- the same mappings offloaded to host memory -- joins instead)."""
        if node.count <= 0:
            return
        if node.floor_bytes > capacity:
            prune_group(node, node.bound_s, node.floor_bytes)
            return
        heapq.heappush(heap, (node.bound_s, next(seq), False, node))

    def prune_group(node, bound_s: float, need_bytes: float) -> None:
        stats.pruned_memory += node.count
        small = floors["smallest"]
        floors["smallest"] = need_bytes if small is None else min(small, need_bytes)
        ledger.ruled_out(node, bound_s, "memory", need_bytes, node.count)
        other = node.relief() if node.relief is not None else None
        if other is not None:
            stats.candidates += other.count
            admit(other)

    if space is not None:
        for node in space.roots():
            stats.candidates += max(0, node.count)
            admit(node)
    else:
        best_seen = leanest = None
        leanness = getattr(model, "leanness", None)  # optional: sorts candidates by memory they need
        def stream():
            for m in candidates:
                yield m
                while pending:
                    yield pending.pop()

        for i, m in enumerate(stream()):
            if i % 64 == 0:
                if expired():
                    enumeration_cut = True
                    break
                if dive_at is not None and best_seen is not None and time.perf_counter() >= dive_at:
                    # until one fits: the best bound once, then the leanest seen whenever it changes
                    for _, _, cand in (best_seen, leanest):
                        if cand not in dived and not expired():
                            ev = _try_evaluate(model, cand)
                            if ev is None:
                                break
                            dived[cand] = ev
                            if not isinstance(ev, InfeasibleError) and ev.fits:
                                dive_at = None
                                break
            stats.candidates += 1
            floor = model.memory_floor_bytes(m)
            if floor > capacity and not exhaustive:
                stats.pruned_memory += 1
                floors["smallest"] = floor if floors["smallest"] is None else min(floors["smallest"], floor)
                ledger.ruled_out(m, model.lower_bound_s(m), "memory", floor)
                if relief is not None:
                    pending.extend(relief(m))
                continue
            bound = model.lower_bound_s(m)
            heap.append((bound, next(seq), False, m))
            if best_seen is None or bound < best_seen[0]:
                best_seen = (bound, i, m)
            lean = leanness(m) if leanness else floor
            if leanest is None or lean < leanest[0]:
                leanest = (lean, i, m)
            if i % 256 == 0:
                reporter.maybe(stats, len(heap), None, None)
        heapq.heapify(heap)
    smallest_floor = floors["smallest"]
    if not heap and stats.candidates == 0 and not enumeration_cut:
        from dfmodel.inter_chip.diagnose import no_mapping_message  # names the failed constraint

        raise InfeasibleError(no_mapping_message(model))
    top: list = []  # the ``keep`` best fitting evaluations, best first
    unproven_bound = math.inf  # smallest bound of an evaluated candidate whose inner solve was cut
    worst_memory = None
    inner_failure = None
    queue = heap
    if enumeration_cut:  # the incumbent taken early is all there is; the heap still bounds the rest
        queue = [(b, i, True, m) for b, i, _, m in heap if m in dived]
        heapq.heapify(queue)
    recent_eval_s: list[float] = []  # durations of the last evaluations (to respect the deadline)
    # recipe incumbents (MoE: LLMSpace.seeds) before any group is expanded: the cutoff prunes
    # from the start and a search cut by its deadline still returns a sensible mapping
    def accept(ev, m, bound: float) -> None:  # a fitting evaluation of mapping m (bound: its search bound)
        nonlocal unproven_bound
        if not ev.proven_optimal:
            stats.proven_optimal = stats.inner_proven = False
            # an inner solve stopped at gap g: the mapping's true time is >= (1 - g) x its time
            unproven_bound = min(unproven_bound, max(bound, ev.iteration_time_s * (1.0 - _inner_gap(ev))))
        ledger.evaluated(m, ev.iteration_time_s)
        _insert(top, ev, keep)
        if share is not None:
            share.publish(top)

    seeded: set = set(getattr(space, "seeded", ()))  # (a parallel worker's: those evaluated before the fork)
    presolve = None if exhaustive else getattr(model, "presolve_bound_s", None)
    presolved: set = set()
    for ev in (space.seeds(capacity, partial(_try_evaluate, model)) if hasattr(space, "seeds") else ()):
        stats.evaluated += 1
        seeded.add(ev.mapping)
        accept(ev, ev.mapping, 0.0)

    def admit_mappings(ms) -> None:  # candidates joining during the search (memory relief)
        for extra in ms:
            stats.candidates += 1
            floor = model.memory_floor_bytes(extra)
            if floor > capacity and not exhaustive:
                stats.pruned_memory += 1
                ledger.ruled_out(extra, model.lower_bound_s(extra), "memory", floor)
                continue
            heapq.heappush(queue, (model.lower_bound_s(extra), next(seq), False, extra))

    # (a parallel worker: groups another worker handed to it join its queue as they arrive, and
    # once more before it ends, at its last head or when its queue runs out)
    while queue or (share is not None and _push(queue, seq, share.finish())):
        if share is not None and _push(queue, seq, share.arrived(queue[0][0])):
            continue
        if space is not None and dive_at is not None and time.perf_counter() >= dive_at:
            dive_at = None
            if not any(ev.fits for ev in top):  # no incumbent yet: the leanest mapping, once
                lean = space.leanest(capacity)
                if lean is not None:
                    # the first incumbent may finish up to half a second (at most half the limit)
                    # past the deadline: the limit holds "within a second", as a MILP solver's does
                    with grace_scope(min(0.5, 0.5 * (limit_s or limit_left))):
                        ev = _try_evaluate(model, lean)
                    if ev is not None:
                        dived[lean] = ev
        head = queue[0][3]
        if not exhaustive and head not in dived and _no_time_for(recent_eval_s):
            stats.timed_out = True
            break
        bound, i, refined, m = queue[0]
        cutoff = top[-1].iteration_time_s if len(top) >= keep else None
        best_s = top[0].iteration_time_s if top else None
        if share is not None:  # the keep-th best (and the best) over every worker's evaluations
            cutoff, best_s = share.cutoff(cutoff), share.best(best_s)
        # the winner's proof first: a candidate is screened against the best time, not the keep-th;
        # one proven slower than the best waits (_SCREENED) until every bound below the best is closed
        screen_s = cutoff if refined is _SCREENED or best_s is None or keep == 1 else best_s
        if cutoff is not None and bound >= cutoff and not exhaustive:
            if share is not None and _push(queue, seq, share.finish()):
                continue
            stats.pruned_bound += _count(queue)
            ledger.bounded(queue)
            queue = []
            break
        heapq.heappop(queue)
        if isinstance(m, SpaceNode) and m.refine is not None and not exhaustive:
            finer = bound
            while m.refine is not None and finer <= bound:  # its costlier bound, once: re-queued when tighter
                refine, m.refine = m.refine, None  # (a refine may leave a costlier stage in m.refine)
                finer = refine()
            if finer > bound:
                m.bound_s = finer
                heapq.heappush(queue, (finer, next(seq), False, m))
                continue
        if isinstance(m, SpaceNode):  # a group below the cutoff: its children join the queue
            if m.screen is not None:
                need = m.screen()
                if need > capacity:
                    prune_group(m, bound, need)
                    continue
            if getattr(m, "host_screen", None) is not None and not m.host_screen():
                stats.pruned_memory += m.count  # its host cannot hold what it offloads
                ledger.ruled_out(m, bound, "memory", None, m.count)
                continue
            children = m.expand()
            if m.leaf:  # mappings with exactly this bound and floor
                for child in children:
                    heapq.heappush(queue, (bound, next(seq), False, child))
            else:
                for child in children:
                    admit(child)
            continue
        if m in seeded:  # evaluated before the search began
            continue
        if not refined and not exhaustive:
            # lazy bound tightening: once this candidate's inner blocks are solved (for another
            # candidate), its exact stage times give a tighter bound; re-queue it with that
            finer = model.refined_bound_s(m)
            if finer is not None and finer > bound:
                heapq.heappush(queue, (finer, i, True, m))
                continue
            if finer is None and presolve is not None and m not in presolved:
                # optional (LLM MoE): the mapping's own bound before its blocks are solved, once;
                # re-queued unrefined, so solved blocks can still tighten it later
                presolved.add(m)
                pre = presolve(m, cutoff_s=screen_s)  # (past the cutoff: it may skip its costlier terms)
                if pre is not None and pre > bound:
                    heapq.heappush(queue, (pre, i, False, m))
                    continue
        try:
            t_eval, cut_s = time.perf_counter(), interruptible_seconds()
            # (a space's groups were screened for memory already)
            ev = dived.pop(m) if m in dived else _evaluate_below(model, m, screen_s, screen=not exhaustive,
                                                                  screen_memory=space is None)
            # what of it could not be cut short (its MILP solves and intra-chip DPs stop at the deadline)
            recent_eval_s[:] = (recent_eval_s + [time.perf_counter() - t_eval - (interruptible_seconds() - cut_s)])[-8:]
            if ev is None and screen_s != cutoff:  # slower than the best: a runner-up at most, evaluated
                # once the winner is proven; its bound: the one the model proved (else the best)
                proven = getattr(model, "proven_bound_s", None)
                heapq.heappush(queue, (screen_s if proven is None else max(screen_s, proven), i, _SCREENED, m))
                continue
            if ev is None:  # proven slower than the cutoff part-way: as good as pruned by its bound
                stats.evaluated += 1
                stats.pruned_bound += 1
                ledger.bounded([(cutoff, i, True, m)])
                continue
            if isinstance(ev, InfeasibleError):
                raise ev
        except DeadlineExpired:  # abandoned mid-evaluation: it stays open (its bound counts)
            heapq.heappush(queue, (bound, i, True, m))
            stats.timed_out = True
            break
        except InfeasibleError as exc:  # an inner pass found nothing that fits (e.g. SRAM, DRAM)
            stats.evaluated += 1
            stats.pruned_memory += 1
            inner_failure = str(exc)
            ledger.ruled_out(m, bound, "infeasible")
            continue
        stats.evaluated += 1
        if not ev.fits:
            stats.pruned_memory += 1
            ledger.ruled_out(m, bound, "memory", ev.memory.total_bytes)
            if worst_memory is None or ev.memory.total_bytes < worst_memory.memory.total_bytes:
                worst_memory = ev
            if relief is not None:
                admit_mappings(relief(m))
            continue
        if relief is not None and getattr(ev, "split_moved", False):
            # its time-balanced split did not fit: its offloaded twins join as for a mapping that
            # does not fit (offloaded, the balanced split may fit and beat the moved one)
            admit_mappings(relief(m))
        accept(ev, m, bound)
        reporter.maybe(stats, len(queue), top[0].iteration_time_s, queue[0][0] if queue else None)
    if share is not None:  # (cut by the deadline: what arrived since stays open, its bound counts)
        _push(queue, seq, share.finish(final=True))
    for ev in dived.values():  # incumbents taken early that the cut search never reached
        if isinstance(ev, InfeasibleError) or ev is None:
            continue
        stats.evaluated += 1
        if ev.fits:
            if not ev.proven_optimal:
                stats.proven_optimal = stats.inner_proven = False
            ledger.evaluated(ev.mapping, ev.iteration_time_s)
            _insert(top, ev, keep)
    best = top[0] if top else None
    stats.wall_s = time.perf_counter() - t0
    if best is None and (stats.timed_out or enumeration_cut):
        leanest = None if worst_memory is None else (worst_memory.memory.total_bytes, worst_memory.memory.summary())
        exc = no_incumbent_error(f"{stats.candidates} candidates enumerated, {stats.evaluated} evaluated", leanest)
        if share is not None and not enumeration_cut:
            # a parallel worker without a fitting mapping of its own (the incumbents may be another
            # worker's, or the seeds evaluated before the fork): what it left open bounds its share
            stats.lower_bound_s = min((b for b, *_ in queue), default=math.inf)
            ledger.bounded(queue)
        raise exc
    if best is None and worst_memory is None:
        smallest_floor = floors["smallest"]  # (groups screened out during the search count too)
        if inner_failure is not None:
            raise InfeasibleError(f"no mapping fits: {inner_failure}")
        if smallest_floor is not None:
            raise InfeasibleError(
                f"no mapping fits in memory: even the leanest needs at least {fmt_bytes(smallest_floor)} "
                f"per chip but a chip has {fmt_bytes(capacity)}, short by "
                f"{fmt_bytes(smallest_floor - capacity)}{_host_note(candidates)}"
            )
        if _host_note(candidates):
            raise InfeasibleError(f"no mapping fits in memory{_host_note(candidates)}")
    if best is None:
        if not hasattr(worst_memory, "breakdown_s"):  # a screened memory floor: report exact figures
            worst_memory = model.evaluate(worst_memory.mapping)
        mem = worst_memory.memory
        if not getattr(mem, "host_fits", True):
            raise InfeasibleError(f"no mapping fits in memory: the smallest {mem.summary()}")
        raise InfeasibleError(
            f"no mapping fits in memory: the smallest needs {mem.total_bytes / 2**30:.1f} GiB per chip "
            f"(weights {mem.weights_bytes / 2**30:.1f}, gradients {mem.gradients_bytes / 2**30:.1f}, "
            f"optimizer {mem.optimizer_bytes / 2**30:.1f}, activations {mem.activations_bytes / 2**30:.1f}) "
            f"but a chip has {mem.capacity_bytes / 2**30:.1f} GiB, short by "
            f"{fmt_bytes(mem.total_bytes - mem.capacity_bytes)}"
        )
    global_bound = getattr(model, "global_lower_bound_s", None)
    _close(stats, best, queue if not enumeration_cut else heap, unproven_bound,
           enumeration_cut and (global_bound() if global_bound else 0.0))
    if stats.timed_out and not enumeration_cut and queue:
        ledger.bounded(queue)
    stats.runners_up = top[1:]
    if share is None:  # (a parallel worker leaves these to the parent, which merges every worker's tables)
        tables = ledger.tables()
        stats.ruled_out = tables.ruled_out_counts(best.iteration_time_s)
        stats.why_not = tables.why_not(best.mapping, best.iteration_time_s)
    reporter.final(stats, best.iteration_time_s)
    return best, stats


#: the ``refined`` mark of a queued mapping already proven slower than the best time found
#: (``_search``): it is evaluated again, against the ``keep``-th best, only after every bound below
#: the best is closed, so a search cut by its deadline has proven its winner before it spends time
#: on confirming the runners-up (DeepSeek-V3 on 8192 dragonfly chips, serial: the winner proven at
#: 23.3 CPU s instead of 28.6 with every candidate screened against the sixth-best time)
_SCREENED = "screened"


def _host_note(space) -> str:
    """What an infeasibility message adds when offloaded twins were dropped because their state
    cannot fit the host (``space.host_short``: least host floor, share per chip), else ''."""
    short = getattr(space, "host_short", None)
    if short is None:
        return ""
    need, share = short
    return (f"; offloaded to host memory, what a mapping moves there needs at least {need / 2**30:.1f} GiB of "
            f"host memory per chip, its share of the host is {share / 2**30:.1f} GiB")


def no_incumbent_error(counts: str, leanest: tuple[float, str] | None) -> TimeLimitError:
    """The error of a search cut before any mapping fitted: what it did (``counts``) and, when
    it evaluated mappings that did not fit, what the leanest of them needs (``leanest``: its
    chip memory and its :meth:`~dfmodel.inter_chip.memory.MemoryBreakdown.summary`; memory, not
    time, may be what stands in the way), kept on the error for the parallel search to compare.

    >>> str(no_incumbent_error("9 evaluated", (1.0, "needs 90 GiB per chip, a chip has 80 GiB"))).split("; ")[1]
    'the leanest mapping evaluated needs 90 GiB per chip, a chip has 80 GiB: allow more time, or more chips or host memory'
    """
    hint = "allow more time"
    if leanest is not None:
        hint = f"the leanest mapping evaluated {leanest[1]}: allow more time, or more chips or host memory"
    exc = TimeLimitError(f"time limit reached before any mapping was evaluated to completion ({counts}, none "
                         f"fitting yet); {hint}")
    exc.leanest = leanest
    return exc


def _push(queue: list, seq, groups: list) -> bool:
    """``groups`` onto the queue under their bounds; True when there were any."""
    for g in groups:
        heapq.heappush(queue, (g.bound_s, next(seq), False, g))
    return bool(groups)


def _count(items) -> int:
    """Mappings behind queue entries (a group counts all of its mappings)."""
    return sum(item[3].count if isinstance(item[3], SpaceNode) else 1 for item in items)


def _knob_items(item) -> tuple:
    """(knob, value) pairs a queue item fixes: every field of a mapping, a group's shared knobs."""
    return item.knobs if isinstance(item, SpaceNode) else tuple(vars(item).items())


def _no_time_for(recent_eval_s: list[float]) -> bool:
    """True when the deadline has passed, or is nearer than the slowest recent evaluation's part
    that cannot be interrupted (the pipeline simulation, the memory screen: starting one that
    cannot finish would overrun the limit). Its MILP solves and intra-chip DPs stop at the
    deadline themselves, leaving the evaluation open with its bound, so they are not reserved:
    an evaluation that solves a new block may still finish in the time left."""
    left = time_left_s()
    if left is None:
        return False
    return left <= 0.0 or (bool(recent_eval_s) and left < max(recent_eval_s))


def _evaluate_below(model, m, cutoff_s: float | None, *, screen: bool, screen_memory: bool = True):
    """``model.evaluate(m)``. With ``screen`` (not in an exhaustive run), models that accept it
    may return None when they prove part-way that the mapping is slower than ``cutoff_s``
    (strictly: a margin of 1e-9 keeps ties, which :func:`_better` breaks), or a non-fitting
    memory floor before their costly inner solves."""
    if screen and getattr(model, "evaluate_accepts_cutoff", False):
        return model.evaluate(m, cutoff_s=None if cutoff_s is None else cutoff_s * (1.0 + 1e-9),
                              screen_memory=screen_memory)
    return model.evaluate(m)


def _try_evaluate(model, m):
    """``model.evaluate(m)``, or the InfeasibleError it raised (re-raised when it is visited);
    None when the deadline cut it."""
    try:
        return model.evaluate(m)
    except DeadlineExpired:
        return None
    except InfeasibleError as exc:
        return exc


def _inner_gap(ev) -> float:
    """Largest relative gap of the evaluation's unproven inner solves (1.0 when unknown)."""
    gaps = []
    layer = getattr(ev, "layer", None)
    for phase in (getattr(layer, "fwd", None), getattr(layer, "bwd", None), getattr(ev, "chip", None)):
        if phase is not None and getattr(phase, "gap", None) is not None:
            gaps.append(float(phase.gap))
    return min(1.0, max(gaps)) if gaps else 1.0


def annotate_result(result, best, stats: SearchStats):
    """Put the search's status, proven bound, gap, runners-up and why-not table on ``result``."""
    result.solver.status = stats.status
    result.solver.proven_optimal = stats.proven_optimal
    result.solver.gap = stats.gap
    result.solver.lower_bound_s = stats.lower_bound_s
    result.solver.candidates_evaluated = stats.evaluated
    result.solver.candidates_pruned = stats.pruned
    result.alternatives = alternatives_report(best, stats.runners_up)
    result.ruled_out = dict(stats.ruled_out)
    result.why_not = dict(stats.why_not)
    if stats.timed_out:
        result.notes.append(
            f"time limit reached: best found {best.iteration_time_s:.6g} s, proven lower bound "
            f"{stats.lower_bound_s:.6g} s (gap {stats.gap:.2%})"
        )
    result.notes.extend(n for n in stats.notes if n not in result.notes)
    return result


def alternatives_report(best, runners_up) -> list[dict]:
    """Runners-up as JSON rows: time, how much slower, the knobs that differ, the bottleneck."""
    rows = []
    for rank, ev in enumerate(runners_up, start=2):
        breakdown = ev.breakdown_s
        rows.append({
            "rank": rank,
            "iteration_time_s": ev.iteration_time_s,
            "slower_by": ev.iteration_time_s / best.iteration_time_s - 1.0,
            "differs": knobs_differing(best.mapping, ev.mapping),
            "bottleneck": max(breakdown, key=breakdown.get) if breakdown else "",
            "mapping": {k: knob_value(v) for k, v in knob_items(ev.mapping)},
        })
    return rows


def _insert(top: list, ev, keep: int) -> None:
    """Insert ``ev`` into the sorted list of the ``keep`` best (order: :func:`_better`)."""
    at = len(top)
    while at > 0 and _better(ev, top[at - 1]):
        at -= 1
    if at < keep:
        top.insert(at, ev)
        del top[keep:]


def _close(stats: SearchStats, best, heap, unproven_bound: float, cut_bound) -> None:
    """Status, proven lower bound and relative gap, as a MILP solver reports them.

    ``cut_bound`` is False when every candidate was enumerated, else the model's bound valid for
    every mapping (``global_lower_bound_s``, 0 when it has none): the candidates never seen."""
    t = best.iteration_time_s
    if cut_bound is not False:
        stats.timed_out = True
        stats.notes.append("the time limit cut the enumeration of candidates; the bound covers the rest "
                           "with the model's global floor")
        lb = min(t, float(cut_bound), min((b for b, *_ in heap), default=math.inf), unproven_bound)
    else:
        open_bound = min((b for b, *_ in heap), default=math.inf) if stats.timed_out else math.inf
        lb = min(t, open_bound, unproven_bound)
    closed = stats.proven_optimal and cut_bound is False and lb >= t * (1 - 1e-12)
    if stats.timed_out and closed:
        # the bound left open is no better than the winner: the optimum is proven (as a MILP
        # solver reports a closed gap); only the runners-up were not all confirmed
        stats.notes.append("time limit reached after the optimum was proven: the runners-up listed may "
                           "not be the next best")
        stats.timed_out = False
    if stats.timed_out or not stats.proven_optimal:
        stats.status = "time_limit"
        stats.proven_optimal = False
    stats.lower_bound_s = lb
    stats.gap = max(0.0, (t - lb) / t) if t > 0 else 0.0


class _Reporter:
    """Calls the user's progress callback at most every ``every_s`` seconds."""

    def __init__(self, callback, t0: float, every_s: float = 0.1):
        self.callback, self.t0, self.every_s, self.last = callback, t0, every_s, -math.inf

    def maybe(self, stats: SearchStats, open_: int, best_s, bound_s) -> None:
        if self.callback is None:
            return
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last = now
        self.callback(Progress(stats.candidates, stats.evaluated, stats.pruned, open_, best_s,
                               min(bound_s, best_s) if bound_s is not None and best_s is not None else bound_s,
                               now - self.t0))

    def final(self, stats: SearchStats, best_s: float) -> None:
        if self.callback is not None:
            self.callback(Progress(stats.candidates, stats.evaluated, stats.pruned, 0, best_s,
                                   stats.lower_bound_s, time.perf_counter() - self.t0))


def knob_items(mapping) -> list[tuple[str, object]]:
    """(name, value) of a mapping's knobs; the placement shown as ``{"tp": ["nvlink:8"], ...}``."""
    out = []
    for f in dataclasses.fields(mapping):
        v = getattr(mapping, f.name)
        out.append((f.name, _placement_names(v) if f.name == "placement" else v))
    return out


def knob_value(v) -> object:
    """A knob value as JSON: placements become ``{"tp": ["nvlink:8"], ...}``."""
    if isinstance(v, tuple) and v and isinstance(v[0], tuple):
        return {name: list(grp) for name, grp in v}
    return v


def knobs_differing(winner, other) -> dict[str, object]:
    """The knobs of ``other`` that differ from ``winner``'s (JSON values)."""
    a, b = dict(knob_items(winner)), knob_items(other)
    return {k: knob_value(v) for k, v in b if a.get(k) != v}


class _Ledger:
    """Per knob value: the best time evaluated, the smallest bound left unexplored, and what
    ruled candidates out -- the data behind "why not tp = 8?". Events are only recorded during
    the search (cheap); the per-knob tables are built once at the end."""

    def __init__(self) -> None:
        self.events: list[tuple] = []  # (knob items, kind, value, need_bytes, count)
        self.open: list = []  # heaps of candidates left unexplored: (bound, i, refined, mapping or group)

    def evaluated(self, m, time_s: float) -> None:
        self.events.append((_knob_items(m), "evaluated", time_s, None, 1))

    def ruled_out(self, m, bound_s: float, reason: str, need_bytes: float | None = None, count: int = 1) -> None:
        """``m`` (a mapping, or a group of ``count`` mappings and their common bound) could not run."""
        self.events.append((_knob_items(m), reason, bound_s, need_bytes, count))

    def bounded(self, heap) -> None:
        self.open.append(heap)

    def tables(self, keep_open=lambda node: True) -> "KnobTables":
        """The events and open heaps folded per knob value (what :meth:`KnobTables.why_not`
        reads); ``keep_open``: which unexplored groups count (a parallel worker leaves out the
        roots another worker searched)."""
        t = KnobTables()
        ruled: dict[str, list] = {}
        for items, kind, value, need_bytes, n in self.events:
            if kind == "evaluated":
                for kv in items:
                    if value < t.best.get(kv, math.inf):
                        t.best[kv] = value
                continue
            ruled.setdefault(kind, []).append((value, n))
            for kv in items:
                c = t.out.setdefault(kv, {})
                c[kind] = c.get(kind, 0) + n
                if need_bytes is not None and need_bytes < t.need.get(kv, math.inf):
                    t.need[kv] = need_bytes
        for heap in self.open:
            for entry in heap:
                if not keep_open(entry[3]):
                    continue
                for kv in _knob_items(entry[3]):
                    if entry[0] < t.bound.get(kv, math.inf):
                        t.bound[kv] = entry[0]
        for kind, pairs in ruled.items():
            pairs.sort()
            t.ruled[kind] = [([b for b, _ in pairs], list(itertools.accumulate(n for _, n in pairs)))]
        return t

    def ruled_out_counts(self, best_s: float) -> dict[str, int]:
        """Candidates whose bound was below the winner's time but that could not run (a group
        pruned whole counts all of its mappings under the group's bound)."""
        return self.tables().ruled_out_counts(best_s)

    def why_not(self, winner, best_s: float) -> dict[str, dict]:
        """For every knob value the winner does not use: its best time, or the bound that
        proves it no better, or what ruled all of its candidates out (:class:`KnobTables`)."""
        return self.tables().why_not(winner, best_s)


@dataclass
class KnobTables:
    """A search's why-not record folded per (knob, value): the best time evaluated (``best``),
    the smallest bound left unexplored (``bound``), the candidates ruled out by reason
    (``out``) and the least memory they needed (``need``); and per reason the sorted bounds of
    the ruled-out groups with the running count of their mappings (``ruled``). Small, so parallel
    workers send these rather than every event, and the parent merges them (:meth:`merge`)."""

    best: dict = field(default_factory=dict)
    bound: dict = field(default_factory=dict)
    out: dict = field(default_factory=dict)
    need: dict = field(default_factory=dict)
    ruled: dict = field(default_factory=dict)  # reason -> [(sorted bounds, running counts)], one per worker

    def merge(self, other: "KnobTables") -> None:
        for mine, theirs in ((self.best, other.best), (self.bound, other.bound), (self.need, other.need)):
            for kv, v in theirs.items():
                if v < mine.get(kv, math.inf):
                    mine[kv] = v
        for kv, counts in other.out.items():
            c = self.out.setdefault(kv, {})
            for kind, n in counts.items():
                c[kind] = c.get(kind, 0) + n
        for kind, parts in other.ruled.items():
            self.ruled.setdefault(kind, []).extend(parts)

    def ruled_out_counts(self, best_s: float) -> dict[str, int]:
        """Candidates whose bound was below the winner's time but that could not run (a group
        pruned whole counts all of its mappings under the group's bound)."""
        counts: dict[str, int] = {}
        for kind, parts in self.ruled.items():
            for bounds, cum in parts:
                i = bisect.bisect_left(bounds, best_s)
                if i:
                    counts[kind] = counts.get(kind, 0) + cum[i - 1]
        return counts

    def why_not(self, winner, best_s: float) -> dict[str, dict]:
        """For every knob value the winner does not use: its best time, or the bound that
        proves it no better, or what ruled all of its candidates out. Groups pruned whole
        speak for the knob values they fix."""
        best, bound, out, need = self.best, self.bound, self.out, self.need
        mine = vars(winner)
        rows: dict[str, dict] = {}
        def order(kv):
            v = kv[1]
            return (kv[0], (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)))

        for kv in sorted(set(best) | set(bound) | set(out), key=order):
            name, value = kv
            if mine.get(name) == value or name == "num_micro_batches":
                continue
            shown = _placement_names(value) if name == "placement" else value
            row: dict = {"knob": name, "value": knob_value(shown)}
            if kv in bound and bound[kv] < best.get(kv, math.inf):
                # unexplored mappings with this value may beat the best evaluated one: the
                # honest statement is their bound (never below the winner's time)
                row.update(status="bound", bound_s=bound[kv], slower_by=bound[kv] / best_s - 1.0)
                if kv in best:
                    row["best_s"] = best[kv]
            elif kv in best:
                row.update(status="slower", best_s=best[kv], slower_by=best[kv] / best_s - 1.0)
            else:
                counts = out.get(kv, {})
                # the commonest reason; a tie goes to the first name (the same on any worker count)
                row.update(status=max(sorted(counts), key=counts.get) if counts else "ruled_out", counts=dict(counts))
                if kv in need:
                    row["needs_bytes"] = need[kv]
            rows[f"{name}={_show(shown)}"] = row
        return rows


def _placement_names(v):
    return tuple((name, tuple(f"{d}:{n}" for d, n in grp)) for name, grp in v)


def _show(v) -> str:
    if isinstance(v, tuple) and v and isinstance(v[0], tuple):
        return ",".join(f"{name}[{'x'.join(grp)}]" for name, grp in v)
    return str(v)


__all__ = ["search", "llm_candidates", "degree_triples", "SearchStats", "Progress", "validate_knobs",
           "knobs_differing", "itertools"]


def _better(ev, best) -> bool:
    """Faster iteration wins; ties within rounding (e.g. every mapping waits for the same input
    load) go to the fastest step, then to the smaller mapping (deterministic)."""
    if best is None:
        return True
    a, b = ev.iteration_time_s, best.iteration_time_s
    if abs(a - b) > 1e-12 * max(abs(a), abs(b)):
        return a < b
    return (_step_s(ev), ev.mapping) < (_step_s(best), best.mapping)


def _step_s(ev) -> float:
    """Iteration time without the storage terms (input wait, checkpoint stall)."""
    br = ev.breakdown_s
    return ev.iteration_time_s - br.get("input", 0.0) - br.get("checkpoint", 0.0)
