"""The branch and bound of :mod:`dfmodel.inter_chip.search` on every core.

A space's roots (one group per degree tuple: :class:`~dfmodel.inter_chip.llm_space.LLMSpace`)
are built once in this process; forked workers then run the ordinary best-bound search over
*all* of them, but a root is expanded by one worker only: its *home*, chosen by the root's
(tp, cp, ep) class (classes dealt round-robin in order of their best bound), because the inner
block solves are cached per process on those knobs and two workers expanding one class would
solve the same blocks twice (a first version handed roots to whichever worker reached them
first: it balanced better but spent ~1.7x the CPU on llama3_70b/dgx_h100). The claim is
recorded in shared memory so that counts and bounds are merged once.
When evaluations are costly (block solves of seconds: dataflow chips), one class may hold the
whole proof (DeepSeek-V3 on SN30: six block solves in class (8, 1, 64)), and dealing by class
leaves one worker alone with it. A root reached then is *split*: every worker that reaches it
expands it and keeps the children whose block key -- (tp, cp) and the micro-batch size, which
every block's cache key holds -- was dealt to it (a shared table, first come, in bound order, to
the worker with the fewest keys), so block caches still never overlap (:class:`_RootProxy`).
Dealt before anything shows which keys are costly, the keys may leave one worker with more
work per bound than another, which then runs ahead in bound order past incumbents the first has
yet to find (DeepSeek-V3 / 8192 dragonfly: 5300 evaluations, 25 %, that the serial search
prunes). So a worker keeps the groups of the keys it does not own (shelved) and publishes its
queue's head, and the first screen or expansion of a key's group *settles* the key: a key still
unsolved goes to a worker whose head is past that bound (:meth:`_Share.settle`, :class:`_KeyProxy`);
a worker with nothing left waits as the one furthest ahead, for the next key settled, until every
worker is done or waiting (:meth:`_Share.finish`). The groups of a handed key that its first
worker refined to the end bring their bounds along (:attr:`_Shared.refined`,
:meth:`_KeyProxy.take_refined`): they are not refined twice.
The workers share their ``keep`` best times (a shared array): each prunes with the ``keep``-th
best over all of them, so no worker explores what another has already beaten.
On dataflow chips the recipe incumbents (``space.seeds``: MoE models) are evaluated here, before
the fork, as the serial search evaluates them before its first expansion: every worker then
starts with their cutoff, the blocks and lattices they solved, and their cost (which decides the
splitting; :func:`_seeds_before_fork`: on GPUs worker 0 evaluates them while the others search);
a forked helper evaluates those of the other TP degrees meanwhile (:class:`_SeedPrefetch`).
(Worker 0 evaluated them after the fork, 3.5 of DeepSeek-V3 / 8192 dragonfly's 21 CPU s per
worker, while worker 1 idled for the first, then searched without the others' cutoff; both
solved the seeds' lattices, ~2 CPU s.)

The parent merges: the winner and runners-up are the best of every worker's evaluations under
the serial search's total order (:func:`~dfmodel.inter_chip.search._better`: time, then step time,
then the mapping), so the answer is the serial search's; the proven bound is the least bound any
worker left open; counts are summed (each root counted once); the why-not ledger is the union of
the workers' records. The deadline (:mod:`dfmodel.solvers.deadline`) is inherited by the forked
workers, so the time limit holds for the whole call.

Where ``fork`` is unavailable, or the roots that fit (the offloaded twins of those that cannot, when a
model fits only offloaded) fall in fewer than two classes, the serial search
runs (``workers=1`` is always exactly the serial path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import time
from multiprocessing.connection import wait

from dfmodel.errors import InfeasibleError, TimeLimitError
from dfmodel.inter_chip.search import (KnobTables, Progress, SearchStats, _better, _insert, _Reporter, _search,
                                       _try_evaluate, no_incumbent_error)
from dfmodel.inter_chip.space import SpaceNode
from dfmodel.intra_chip import ideals
from dfmodel.parallel import fork_available
from dfmodel.solvers.deadline import deadline_scope, time_left_s

_UNCLAIMED = -1
_PROGRESS_FIELDS = 7  # candidates, evaluated, pruned, open, best, bound, elapsed
#: a worker still running this long after the deadline is stopped (its claims count as open, its
#: incumbents were streamed to the parent as it found them, so nothing it evaluated is lost): the
#: limit holds "within a second" even when a worker is inside an evaluation that cannot be cut
#: (a pipeline simulation, a memory screen) or the machine is busy
_HARD_STOP_GRACE_S = 0.4
#: the workers stop this much before the caller's deadline (at most 5% of the limit), leaving the
#: time to send their records and for the parent to merge them (~0.1-0.25 s measured on
#: deepseek_v3/dgx_b200 and llama3_405b/dgx_h100 8192 chips, 2 busy cores)
_WRAP_UP_S = 0.3


#: how often a worker with nothing left to search looks for a key handed to it (:meth:`_Share.finish`)
_IDLE_POLL_S = 0.005

_SPLIT = -2  # a root every worker expands, keeping the children whose block key it owns (_Share.key_owner)
#: a worker splits the roots it reaches (:class:`_RootProxy`) once its evaluations take this
#: long on average: then a root's children are worth spreading (DeepSeek-V3 on SN30: an
#: evaluation solving a new block takes 0.3-2.1 s, and the proof is six of them in one (tp, cp,
#: ep) class), while expanding a root in every worker costs ~1 ms of bounds there. Where
#: evaluations take milliseconds (GPUs, and the dataflow cells of thousands of evaluations) the
#: search's cost is in bounding roots, which splitting would duplicate: measured +5-20% CPU
#: when every root was split (DeepSeek-V3 on B200 and H100, Llama 3 70B on H100 and dragonfly)
_SPLIT_EVAL_S = 0.05
#: slots of the shared table of block keys -> owning worker (open addressing; a full table falls
#: back to the key's hash modulo the workers: still one owner per key, only less balanced)
_KEY_SLOTS = 1 << 14
_EMPTY_SLOT = 0
#: children of a split root whose refined bounds are shared (:attr:`_Shared.refined`): a root's
#: micro-batch sizes, the divisors of its batch per data-parallel rank (at most 64 up to
#: ~10^5 sequences); a later child is refined again where its key is handed (the same bound)
_CHILD_SLOTS = 64


class _Shared:
    """Shared memory, created before the fork: the workers' ``keep`` best times, the owner of
    every root, the owner of every block key dealt so far, and each worker's latest progress
    snapshot."""

    def __init__(self, ctx, workers: int, keep: int, n_roots: int):
        self.workers, self.keep = workers, keep
        self.tops = ctx.Array("d", [math.inf] * (workers * keep))
        self.tops_version = ctx.Value("q", 0, lock=False)  # (under the tops' lock) updates of tops so far
        self.owner = ctx.Array("i", [_UNCLAIMED] * n_roots)
        self.progress = ctx.Array("d", [math.nan] * (workers * _PROGRESS_FIELDS), lock=False)
        self.key_hash = ctx.Array("q", [_EMPTY_SLOT] * _KEY_SLOTS)  # (its lock guards key_owner and dealt)
        self.key_table = self.key_hash.get_obj()  # (the same memory, read under that lock without taking it again)
        self.key_owner = ctx.Array("i", [_UNCLAIMED] * _KEY_SLOTS, lock=False)
        self.dealt = ctx.Array("q", [0] * workers, lock=False)  # keys dealt to each worker
        # (under key_hash's lock) a key's owner is final (_Share.settle); keys handed to each
        # worker so far; which workers have finished (they take no more keys)
        self.key_settled = ctx.Array("b", [0] * _KEY_SLOTS, lock=False)
        self.handed = ctx.Array("q", [0] * workers, lock=False)
        self.done = ctx.Array("b", [0] * workers, lock=False)
        self.waiting = ctx.Array("b", [0] * workers, lock=False)  # (under key_hash's lock) idle in _Share.finish
        self.head = ctx.Array("d", [-math.inf] * workers, lock=False)  # each worker's queue head (bound)
        # each worker's evaluations so far: (CPU seconds, count), read by every worker (_Share.splits)
        self.evals = ctx.Array("d", [0.0] * (2 * workers), lock=False)
        # per child of a split root (_KeyProxy.slot): its bound once every stage of its refine ran
        # in some worker (-inf: none did), so the worker its key is handed to need not refine it
        self.refined = ctx.Array("d", [-math.inf] * (n_roots * _CHILD_SLOTS), lock=False)


class _Share:
    """A worker's side of the sharing: the hook ``_search(share=...)`` calls."""

    def __init__(self, shared: _Shared, me: int, conn=None):
        self.shared, self.me, self.conn = shared, me, conn
        self.stats = self.ledger = None  # set by _search
        self.published = False  # a fitting evaluation of this worker's
        self.started = False  # the roots have been admitted: claims may begin
        self.sent: set = set()  # mappings already streamed to the parent
        self.shelf: dict[tuple, list] = {}  # block key -> groups of split roots another worker owns
        self.handed_seen = 0  # keys handed to this worker, as of its last look at the shelf
        self.final: dict[tuple, int] = {}  # settled keys' owners (final: asked again without the lock)
        self.seen_tops = (-1, math.inf, math.inf)  # (tops_version, keep-th best, best) as last read

    def publish(self, top: list) -> None:
        """This worker's ``keep`` best times into its slice (under the lock: a reader never sees
        half an update, which could count one evaluation twice), and its new incumbents to the
        parent (a worker stopped at the deadline then loses none of them)."""
        keep = self.shared.keep
        self.published = True
        if self.conn is not None:
            for ev in top[:keep]:
                if ev.mapping not in self.sent:
                    self.sent.add(ev.mapping)
                    self.conn.send(("incumbent", ev))
        times = [ev.iteration_time_s for ev in top[:keep]] + [math.inf] * (keep - len(top))
        with self.shared.tops.get_lock():
            self.shared.tops[self.me * keep:(self.me + 1) * keep] = times
            self.shared.tops_version.value += 1

    def cutoff(self, local: float | None) -> float | None:
        """The ``keep``-th best time over every worker (<= this worker's own), or ``local``."""
        self.started = True
        kth = self._tops()[0]
        return kth if math.isfinite(kth) else local

    def best(self, local: float | None) -> float | None:
        """The best time over every worker (<= this worker's own), or ``local``."""
        best = self._tops()[1]
        return best if math.isfinite(best) else local

    def _tops(self) -> tuple[float, float]:
        """(the ``keep``-th best, the best) over every worker's times, read again only when some
        worker has published since (the search asks both at every step, ~16k times a worker on
        DeepSeek-V3 / 512 dragonfly, each a lock); a publish that lands after the version is
        read is seen at the next step (until then the older, larger times: a weaker cutoff)."""
        sh = self.shared
        version = sh.tops_version.value
        if version != self.seen_tops[0]:
            with sh.tops.get_lock():
                times = sh.tops[:]
            kth = sorted(times)[sh.keep - 1]
            best = min(times[::sh.keep])  # (each worker's slice starts with its best)
            self.seen_tops = (version, kth, best)
        return self.seen_tops[1:]

    def claim(self, i: int, home: int) -> bool:
        """True when root ``i`` (whose home worker is ``home``) is (now) this worker's to expand."""
        owner = self.shared.owner
        with owner.get_lock():
            if owner[i] == _UNCLAIMED and home == self.me:
                owner[i] = self.me
            return owner[i] == self.me

    def owner_of(self, i: int) -> int:
        return self.shared.owner[i]

    def timed(self, evaluate):
        """``evaluate``, adding its CPU seconds to this worker's record (read by :meth:`splits`)."""
        def run(*args, **kw):
            t0 = time.process_time()
            try:
                return evaluate(*args, **kw)
            finally:
                evals = self.shared.evals
                evals[2 * self.me] += time.process_time() - t0
                evals[2 * self.me + 1] += 1
        return run

    def splits(self) -> bool:
        """True when the evaluations so far (the seeds', before the fork on dataflow chips:
        :func:`_seeds_before_fork`, then the workers') average :data:`_SPLIT_EVAL_S` or more.
        None yet means unsplit: a dense model on GPUs bounds ~200 roots before its first
        evaluation, and splitting them all cost 7% CPU."""
        evals = self.shared.evals[:]
        n = sum(evals[1::2])
        return n > 0 and sum(evals[0::2]) >= _SPLIT_EVAL_S * n

    def decide(self, i: int, home: int) -> int:
        """Root ``i``'s owner once a worker reaches it: the first worker to reach it splits it
        (:data:`_SPLIT`) when evaluations are costly (:meth:`splits`), else gives it to its home
        (claimed as :meth:`claim` would, even by another worker: a root one worker left unsplit
        must not be split later, when the first worker has dropped it); a decision once made
        stands for every worker."""
        owner = self.shared.owner
        if owner[i] == _UNCLAIMED:
            split = self.splits()
            with owner.get_lock():
                if owner[i] == _UNCLAIMED:
                    owner[i] = _SPLIT if split else home
        return owner[i]

    def key_owner(self, key: tuple, deal: bool) -> int:
        """The worker that expands the children of split roots with this block key; with ``deal``
        a key not seen yet goes to the worker with the fewest keys so far (else -1)."""
        final = self.final.get(key)
        if final is not None:  # (a split root's children ask theirs at every count and refine)
            return final
        sh = self.shared
        with sh.key_hash.get_lock():
            owner, slot, h = _lookup_locked(sh, key)
            if owner != _UNCLAIMED and (slot is None or sh.key_settled[slot]):
                self.final[key] = owner
            if owner != _UNCLAIMED or not deal:
                return owner
            w = min(range(sh.workers), key=lambda k: (sh.dealt[k], k))  # (slot: a free one, as above)
            sh.key_table[slot], sh.key_owner[slot] = h, w
            sh.dealt[w] += 1
            return w

    def settle(self, key: tuple, bound_s: float) -> int:
        """The key's owner for good, asked when a worker first screens or expands one of its
        groups (none of its blocks solved yet): a key still this worker's goes, unsettled, to
        the worker furthest ahead in bound order when one is (its queue's head past ``bound_s``,
        the bound this worker has reached). Keys are dealt when the roots are expanded, before
        anything shows which are costly: DeepSeek-V3 / 8192 dragonfly's worker 0 got 40 % more
        work per bound, and worker 1, ahead, evaluated 5300 mappings (25 %) below the cutoff
        it had but above the one worker 0 found later, that the serial search prunes."""
        sh = self.shared
        with sh.key_hash.get_lock():
            owner, slot, h = _lookup_locked(sh, key)
            if slot is None or owner == _UNCLAIMED:  # (a full table: the hash's owner, never handed)
                return h % sh.workers
            if owner == self.me and not sh.key_settled[slot]:
                ahead = [w for w in range(sh.workers) if w != self.me and not sh.done[w] and sh.head[w] > bound_s]
                if ahead:
                    owner = sh.key_owner[slot] = max(ahead, key=lambda w: sh.head[w])
                    sh.handed[owner] += 1
                    sh.waiting[owner] = 0  # (busy again: the others do not end on its account)
                sh.key_settled[slot] = 1
            return owner

    def shelve(self, groups: list) -> None:
        """Groups of a split root whose key another worker owns: kept, unsearched, in case the key
        is handed to this worker (:meth:`settle`)."""
        for g in groups:
            self.shelf.setdefault(g.key, []).append(g)

    def arrived(self, head_s: float) -> list:
        """Publishes this worker's queue head; the shelved groups of the keys handed to it since
        it last looked (to search)."""
        sh = self.shared
        sh.head[self.me] = head_s
        if sh.handed[self.me] == self.handed_seen:
            return []
        with sh.key_hash.get_lock():
            return self._unshelve()

    def finish(self, final: bool = False) -> list:
        """Like :meth:`arrived` when this worker's search is about to end; when nothing arrived
        it waits, idle, as the worker furthest ahead (its head at infinity), for a key another
        worker settles (:meth:`settle` hands it here), and is done (atomically: no key is handed
        to it afterwards) once every other worker is done or waiting too, or at the deadline.
        Keys are dealt before anything shows which are costly, and the block solves of one
        dwarf the others' on dataflow chips: DeepSeek-V3 / 512 dragonfly's workers ended 3.6 s
        apart (9.3 and 13.0 s) when the first returned at once. ``final``: done whatever
        arrived (a search cut by the deadline leaves it open, its bound counted): a key handed
        to a worker that has returned would be searched by none and counted open by none."""
        sh = self.shared
        while True:
            with sh.key_hash.get_lock():
                groups = self._unshelve()
                if groups or final:
                    sh.waiting[self.me], sh.done[self.me] = 0, int(final)
                    return groups
                left = time_left_s()
                if (left is not None and left <= 0.0) or all(
                        sh.done[w] or sh.waiting[w] for w in range(sh.workers) if w != self.me):
                    sh.done[self.me] = 1
                    return []
                sh.waiting[self.me], sh.head[self.me] = 1, math.inf
            time.sleep(_IDLE_POLL_S)

    def _unshelve(self) -> list:
        """(under the key table's lock) the shelved groups whose key is now this worker's."""
        sh = self.shared
        if sh.handed[self.me] == self.handed_seen:
            return []
        self.handed_seen = sh.handed[self.me]
        mine = [k for k in self.shelf if _owner_locked(sh, k) == self.me]
        groups = [g for k in mine for g in self.shelf.pop(k)]
        for g in groups:
            g.take_refined()
        return groups

    def report(self, p: Progress) -> None:
        f = _PROGRESS_FIELDS
        nan = math.nan
        self.shared.progress[self.me * f:(self.me + 1) * f] = [
            p.candidates, p.evaluated, p.pruned, p.open, nan if p.best_s is None else p.best_s,
            nan if p.bound_s is None else p.bound_s, p.elapsed_s]


class _RootProxy(SpaceNode):
    """A root as one worker sees it: the same bound, floor, count and knobs; expanding (or
    screening) it claims it, and a root claimed by another worker expands to nothing and, once
    the search is under way, counts no mappings (so pruned counts are not duplicated).

    A root that may be split (``split``: :func:`_splittable`) is split when the first worker to
    reach it finds evaluations costly (:meth:`_Share.decide`): then every worker that reaches it
    expands it and keeps the children whose block key (:func:`_block_key`) it owns, the keys
    being dealt the first time a worker expands a root holding them (:meth:`_Share.key_owner`):
    one (tp, cp, ep) class then spreads its micro-batch sizes, whose block solves share nothing,
    over the workers."""

    def __init__(self, real: SpaceNode, index: int, share: _Share, home: int, split: bool = False):
        self.real, self.index, self.share, self.home, self.split = real, index, share, home, split
        self._all: list | None = None  # (split) the children as _KeyProxy, built once
        super().__init__(real.bound_s, real.floor_bytes, real.count, real.knobs, self._expand, real.leaf,
                         None if real.screen is None else self._screen, real.relief)

    @property
    def count(self) -> int:
        if not self.share.started:
            return self._count
        owner = self.share.owner_of(self.index)
        if owner == _SPLIT:  # expanded somewhere: this worker answers for its own children only
            return sum(c.count for c in self._children())  # (0 for another's key: _KeyProxy.count)
        return self._count if owner in (_UNCLAIMED, self.share.me) else 0

    @count.setter
    def count(self, value: int) -> None:
        self._count = value

    def _expand(self) -> list:
        if not self.split:
            return self.real.expand() if self.share.claim(self.index, self.home) else []
        owner = self.share.decide(self.index, self.home)
        if owner == _SPLIT:  # this worker's children; the others' shelved (their key may be handed here)
            mine = {c: c.mine() for c in self._children()}
            self.share.shelve([c for c, ok in mine.items() if not ok])
            return [c for c, ok in mine.items() if ok]
        return self.real.expand() if owner == self.share.me else []

    def _children(self) -> list:
        """The real root's children, each as a :class:`_KeyProxy` of its block key (keys dealt
        in bound order), built once: counting a root another worker split and expanding it
        ask the same list."""
        if self._all is None:
            children = self.real.expand()
            for c in sorted(children, key=lambda c: c.bound_s):
                self.share.key_owner(_block_key(c.knobs), deal=True)
            self._all = [_KeyProxy(c, _block_key(c.knobs), self.share,
                                   self.index * _CHILD_SLOTS + j if j < _CHILD_SLOTS else None)
                         for j, c in enumerate(children)]
        return self._all

    def _screen(self) -> float:
        return self.real.screen() if self.share.claim(self.index, self.home) else 0.0


class _KeyProxy(SpaceNode):
    """A child of a split root (a micro-batch group) as one worker sees it: searched, and
    counted, by the worker that owns its block key (:meth:`_Share.key_owner`); the first
    screen or expansion of one of the key's groups settles the key (:meth:`_Share.settle`),
    which may hand it to a worker further ahead: a group whose key another worker owns refines,
    screens and expands to nothing here."""

    def __init__(self, real: SpaceNode, key: tuple, share: _Share, slot: int | None = None):
        self.real, self.key, self.share, self.slot = real, key, share, slot
        host = getattr(real, "host_screen", None)
        super().__init__(real.bound_s, real.floor_bytes, real.count, real.knobs, self._expand, real.leaf,
                         None if real.screen is None else self._screen, real.relief, real.refine,
                         None if host is None else self._host_screen)

    def mine(self) -> bool:
        return self.share.key_owner(self.key, deal=False) == self.share.me

    def _refine_shared(self, refine):
        """``refine`` (a stage of the real group's), its bound shared once no stage is left."""
        def run() -> float:
            out = refine()
            if self.real.refine is None and self.slot is not None:
                refined = self.share.shared.refined
                refined[self.slot] = max(refined[self.slot], self.bound_s, out)
            return out
        return run

    def take_refined(self) -> None:
        """A group whose key was just handed here: where the worker that held the key refined
        it to the end, its bound and no refine left (the same floors computed again: DeepSeek-V3
        / 512 dragonfly's workers refined ~1200 groups twice, ~0.7 CPU s)."""
        done = -math.inf if self.slot is None else self.share.shared.refined[self.slot]
        if done > -math.inf:
            self.real.refine = None
            self.bound_s = max(self.bound_s, done)

    @property
    def count(self) -> int:
        return self._count if self.mine() else 0

    @count.setter
    def count(self, value: int) -> None:
        self._count = value

    @property
    def refine(self):  # (the real group's, which a staged refine sets again)
        if self.real.refine is None or not self.mine():
            return None
        return self._refine_shared(self.real.refine)

    @refine.setter
    def refine(self, value) -> None:
        self.real.refine = value

    def _settled_mine(self) -> bool:
        return self.share.settle(self.key, self.bound_s) == self.share.me

    def _screen(self) -> float:
        return self.real.screen() if self._settled_mine() else 0.0

    def _host_screen(self) -> bool:
        return self.real.host_screen() if self._settled_mine() else True

    def _expand(self) -> list:
        return self.real.expand() if self._settled_mine() else []


class _ShardSpace:
    """The space as worker ``me`` searches it: the roots that fit as claimable proxies (in the
    serial order); the roots that cannot fit (pruned at once, then relieved by their offloaded
    twins), the recipe seeds (``seeds``: evaluated before the fork, counted and accepted by
    worker 0, skipped by every worker; None: evaluated by worker 0) and the early leanest
    incumbent go to worker 0 alone."""

    def __init__(self, space, roots: list, fits: list[bool], homes: list[int], share: _Share,
                 twin_of: dict[int, int] | None = None, split: bool = False, seeds: list | None = None):
        self.space, self.share = space, share
        me = share.me
        twin_of = twin_of or {}
        proxies = {i: _RootProxy(r, i, share, homes[i], split and _splittable(r))
                   for i, (r, ok) in enumerate(zip(roots, fits)) if ok}
        twins = set(twin_of.values())
        if me == 0:
            # worker 0 prunes the roots that cannot fit (counting them, as the serial search
            # does) and admits their offloaded twins from the pruning, as claimable proxies
            self._roots = [proxies[i] if i in proxies else _with_relief(r, proxies.get(twin_of.get(i)))
                           for i, r in enumerate(roots) if i not in twins]
        else:
            self._roots = [proxies[i] for i in sorted(proxies)]
        if seeds is not None:
            self.seeds = lambda *args, **kw: iter(seeds if me == 0 else ())
            self.seeded = frozenset(ev.mapping for ev in seeds)  # (_search skips them)
        elif hasattr(space, "seeds"):
            self.seeds = space.seeds if me == 0 else (lambda *args, **kw: ())
        if me > 0:
            # the early incumbent under a deadline (the leanest mapping) is worker 0's to take:
            # two workers evaluating the same mapping would each get half the cores for it
            self.leanest = lambda *args, **kw: None

    def roots(self) -> list:
        return self._roots

    def __getattr__(self, name):
        return getattr(self.space, name)


def _with_relief(root: SpaceNode, twin: SpaceNode | None) -> SpaceNode:
    """``root`` (a root that cannot fit), its relief being ``twin`` (its offloaded twin built
    before the fork, a claimable proxy) when there is one."""
    if twin is None:
        return root
    return dataclasses.replace(root, relief=lambda: twin)  # every other field (host_screen too) kept


def _relief_twins(roots: list, fits: list[bool], capacity: float) -> tuple[list, dict[int, int]]:
    """The offloaded twins of the roots that cannot fit in a chip's memory (``root.relief()``,
    what the serial search admits when it prunes such a root), those whose own floor fits, as
    extra roots numbered after ``roots``; and root index -> its twin's index. Built before the
    fork so that the workers share them: a model too large for the chips without offload
    (DeepSeek-V3 on 64 GPUs) has no root that fits, and its whole search lies in the twins."""
    twins, twin_of = [], {}
    for i, (r, ok) in enumerate(zip(roots, fits)):
        if ok or r.count <= 0 or r.relief is None:
            continue
        twin = r.relief()
        if twin is not None and twin.count > 0 and twin.floor_bytes <= capacity:
            twin_of[i] = len(roots) + len(twins)
            twins.append(twin)
    return twins, twin_of


def _seeds_before_fork(model) -> bool:
    """Whether the seeds are evaluated before the fork (:func:`_evaluate_seeds`): on dataflow
    chips, where their blocks and lattices cost seconds (3 of DeepSeek-V3 / 8192 dragonfly's
    CPU s) that every worker then shares, and their cost decides the splitting (DeepSeek-V3 on
    SN30 would otherwise settle its costly class unsplit). Not on kernel-by-kernel chips (GPUs):
    worker 0 evaluates them while the others search, as idling them cost DeepSeek-V3 on 64 B200s
    ~0.4 s on its slowest worker, and they decide no split (evaluations average milliseconds)."""
    chip = getattr(getattr(model, "system", None), "chip", None)
    return getattr(chip, "execution", "dataflow") == "dataflow"


def _evaluate_seeds(model, space, capacity: float, shared: _Shared, keep: int) -> list | None:
    """The space's recipe incumbents (``space.seeds``; none without), evaluated in this process
    before the fork where :func:`_seeds_before_fork` (else None); their times are worker 0's
    first ``keep`` best (every worker prunes with them from its first root) and their cost the
    first evaluations' (:meth:`_Share.splits`)."""
    if not _seeds_before_fork(model):
        return None
    if not hasattr(space, "seeds"):
        return []
    tried = [0]
    t0 = time.process_time()
    with _SeedPrefetch(model, space, capacity) as prefetched:
        def evaluate(m):
            tried[0] += 1
            return prefetched.result(m)

        seeds = list(space.seeds(capacity, evaluate))
    shared.evals[0] += time.process_time() - t0 + prefetched.helper_s
    shared.evals[1] += tried[0]
    top: list = []
    for ev in seeds:
        _insert(top, ev, keep)
    shared.tops[:keep] = [ev.iteration_time_s for ev in top] + [math.inf] * (keep - len(top))
    shared.tops_version.value += 1
    return seeds


#: what the prefetching helper's walk of the seeds takes every evaluation for (:func:`_prefetch_seeds`)
_AS_FITTING = type("_AsFitting", (), {"fits": True})()


class _SeedPrefetch:
    """The seeds' evaluations (:func:`_evaluate_seeds`, in this process: the workers inherit
    what it solves) with a forked helper evaluating ahead, in parallel, the seeds of the other
    TP degrees than the first seed's on the walk the seeds take when every seed fits
    (:func:`_prefetch_seeds`: the first candidate of each expert-parallel degree and pipeline
    depth). This process walks the seeds as before, each evaluation being the helper's when it
    has taken it (waited for while it runs: the same deterministic evaluation), its own
    otherwise; the blocks and phases the helper solved join this process's caches with it. So
    the seeds are the serial search's. Evaluated here alone they were 2.5 of DeepSeek-V3 / 512
    dragonfly's 15 s of wall (3.1 of 14.4 s at 8192), the second core idle; split by TP degree
    (seeds of one degree share phases and lattices: split by turns, each process solved them
    again), this process keeps the first seed's degree, whose caches the workers inherit whole:
    at 8192 the helper takes TP 4's seeds (memory misses, 1.4 CPU s) and this process TP 8's."""

    def __init__(self, model, space, capacity: float):
        self.model, self.helper_s = model, 0.0
        self.taken: dict = {}  # mapping -> its evaluation (None: the helper is evaluating it)
        ctx = multiprocessing.get_context("fork")
        self.conn, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_prefetch_seeds, args=(model, space, capacity, send), daemon=True)
        self.proc.start()
        send.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.is_alive():  # (evaluating seeds the walk did not need: it would slow the workers)
            self.proc.terminate()
        self.proc.join()
        self.conn.close()

    def result(self, m):
        """``_try_evaluate(model, m)``: the helper's when it took ``m``."""
        self._receive(wait=False)
        while m in self.taken and self.taken[m] is None and self._receive(wait=True):
            pass
        if self.taken.get(m) is not None:
            return self.taken[m][0]
        return _try_evaluate(self.model, m)

    def _receive(self, wait: bool) -> bool:
        """Takes in the helper's messages (one at least with ``wait``); False when it has stopped
        (ended, failed, or past the deadline)."""
        left = time_left_s()
        timeout = (None if left is None else max(0.0, left) + _HARD_STOP_GRACE_S) if wait else 0.0
        try:
            while self.conn.poll(timeout):
                kind, m, payload = self.conn.recv()
                if kind == "taken":
                    self.taken.setdefault(m, None)
                elif kind == "done":
                    ev, solved, self.helper_s = payload  # (its CPU seconds so far)
                    for name, cache in _seed_caches(self.model).items():
                        for key, value in solved[name].items():
                            cache.setdefault(key, value)
                    self.taken[m] = (ev,)
                    if wait:
                        return True
                else:  # it has ended
                    return self._stopped()
            if not wait:
                return True
        except (EOFError, OSError):
            pass
        return self._stopped()

    def _stopped(self) -> bool:
        """The helper has ended (or failed, or passed the deadline): what it was evaluating is
        evaluated here."""
        self.taken = {k: v for k, v in self.taken.items() if v is not None}
        return False


def _seed_caches(model) -> dict[str, dict]:
    """What a seed's evaluation solves that the search reuses: the model's blocks and phases
    (``LLMModel._blocks``, ``_phases``: {} without) and the lattices' pair structures
    (``ideals._STRUCTURES``: shared by the phases of one shape at every TP degree; without
    them, DeepSeek-V3 / 8192 dragonfly's workers spent ~0.6 CPU s more each). Keyed by content
    or by block knobs, never by an object's id: entries made in another process hold here."""
    out = {name: getattr(model, name, None) for name in ("_blocks", "_phases")}
    out = {name: cache if isinstance(cache, dict) else {} for name, cache in out.items()}
    return {**out, "structures": ideals._STRUCTURES}


#: pair structures larger than this (pairs) stay in the helper: a 33-kernel backward layer's
#: millions (DeepSeek-V3 on SN30: 16.5 M, ~0.5 GB) cost more to send than to build again
_SENT_MAX_PAIRS = 1 << 21


def _sendable(name: str, value) -> bool:
    return name != "structures" or value is None or value[0].size <= _SENT_MAX_PAIRS


def _prefetch_seeds(model, space, capacity: float, conn) -> None:
    """:class:`_SeedPrefetch`'s helper: walks the seeds taking every one as fitting, evaluating
    those of another TP (and CP) degree than the first, each announced before (``taken``) and
    sent after with what it solved (``done``: :func:`_seed_caches`' new entries)."""
    t0, first = time.process_time(), []
    known = {name: set(cache) for name, cache in _seed_caches(model).items()}

    def evaluate(m):
        first[:] = first or [(m.tp, m.cp)]
        if (m.tp, m.cp) == first[0]:  # (the parent's: the workers inherit what it solves)
            return _AS_FITTING
        conn.send(("taken", m, None))
        ev = _try_evaluate(model, m)
        solved = {name: {k: v for k, v in cache.items() if k not in known[name] and _sendable(name, v)}
                  for name, cache in _seed_caches(model).items()}
        for name, new in solved.items():
            known[name].update(new)
        conn.send(("done", m, (ev, solved, time.process_time() - t0)))
        return _AS_FITTING

    try:
        for _ in space.seeds(capacity, evaluate):
            pass
        conn.send(("end", None, None))
    except BaseException:  # noqa: BLE001 -- the parent evaluates what the helper did not
        pass
    finally:
        with contextlib.suppress(Exception):
            conn.close()
        os._exit(0)  # (as a worker: no atexit handlers of the parent's objects)


def _worker(me: int, conn, model, space, roots, fits, homes, shared: _Shared, keep: int, limit_s,
            twin_of: dict[int, int] | None = None, split: bool = False, seeds: list | None = None) -> None:
    """Run the search on this worker's share; send back what the parent merges."""
    share = _Share(shared, me, conn)
    try:
        with contextlib.suppress(AttributeError):  # (this process's copy: timed for _Share.splits)
            model.evaluate = share.timed(model.evaluate)
        kind, detail = "ok", None
        left = time_left_s()
        own_limit_s = None if left is None else max(0.0, left - min(_WRAP_UP_S, 0.05 * (limit_s or left)))
        try:
            with deadline_scope(own_limit_s):
                best, stats = _search(model, _ShardSpace(space, roots, fits, homes, share, twin_of, split, seeds),
                                      exhaustive=False,
                                      keep=keep, progress=share.report, limit_s=limit_s, share=share)
            top = [best] + list(stats.runners_up)
        except TimeLimitError as exc:  # detail: (chip bytes, summary) of its leanest non-fitting evaluation
            # (its stats when its search set the bound of what it left open: _search, no incumbent)
            cut_stats = share.stats if share.stats is not None and share.stats.lower_bound_s is not None else None
            kind, detail, top, stats = "time", getattr(exc, "leanest", None), [], cut_stats
        except InfeasibleError as exc:
            kind, detail, top, stats = "infeasible", str(exc), [], share.stats
        except Exception:  # noqa: BLE001
            s = share.stats
            if share.published or s is None or s.timed_out:
                raise
            # the other workers claimed or beat everything this one reached: it has no mapping of
            # its own (the serial search's "why nothing fits" report does not apply to a share)
            kind, detail, top, stats = "empty", None, [], s
        ledger = share.ledger
        tables, counted_unclaimed = None, 0
        if ledger is not None:
            def mine(node) -> bool:  # a root (or a key) another worker searched: its records speak for it
                if isinstance(node, _KeyProxy):
                    return node.mine()
                return not isinstance(node, _RootProxy) or share.owner_of(node.index) in (_UNCLAIMED, _SPLIT, me)

            if stats is not None and not stats.timed_out:
                counted_unclaimed = sum(e[3]._count for heap in ledger.open for e in heap  # pruned by the bound here
                                        if isinstance(e[3], _RootProxy) and share.owner_of(e[3].index) == _UNCLAIMED)
            # the why-not record folded per knob value here: the parent merges these small tables
            tables = ledger.tables(keep_open=mine)
        if stats is not None:
            stats.runners_up, stats.why_not, stats.ruled_out = [], {}, {}
        conn.send((kind, detail, top, stats, tables, counted_unclaimed))
    except BaseException as exc:  # noqa: BLE001 -- re-raised in the parent
        try:
            conn.send(("error", exc, [], None, None, 0))
        except Exception:  # an unpicklable exception: its text
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}"), [], None, None, 0))
    finally:
        with shared.key_hash.get_lock():  # (however it ended: a worker idle in finish() then stops waiting)
            shared.done[me] = 1
        conn.close()
        os._exit(0)  # no atexit handlers or finalizers of the parent's objects in a forked child


def parallel_search(model, space, *, keep: int, progress, limit_s: float | None, workers: int):
    """:func:`~dfmodel.inter_chip.search.search` over ``space`` on ``workers`` forked processes
    (the same ``(best, stats)``; see the module docstring)."""
    def serial():
        return _search(model, space, exhaustive=False, keep=keep, progress=progress, limit_s=limit_s)

    if not fork_available():
        return serial()
    t0 = time.perf_counter()
    capacity = model.system.chip.memory.capacity_bytes
    roots = list(space.roots())
    fits = [r.count > 0 and r.floor_bytes <= capacity for r in roots]
    chip_fits = list(fits)  # (which roots fit without offload: worker 0 prunes the others)
    twins, twin_of = _relief_twins(roots, fits, capacity)
    roots, fits = roots + twins, fits + [True] * len(twins)
    homes, n_classes = _homes(roots, fits)
    workers = min(workers, n_classes)
    if workers < 2:
        return serial()
    fit_count = sum(r.count for r, ok in zip(roots, fits) if ok)
    ctx = multiprocessing.get_context("fork")
    homes = [h % workers for h in homes]
    shared = _Shared(ctx, workers, keep, len(roots))
    seeds = _evaluate_seeds(model, space, capacity, shared, keep)
    procs, conns = [], {}
    for me in range(workers):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker,
                        args=(me, send, model, space, roots, fits, homes, shared, keep, limit_s, twin_of, True, seeds),
                        daemon=True)
        p.start()
        send.close()
        procs.append(p)
        conns[recv] = me
    replies = _collect(conns, shared, workers, fit_count, progress, t0)
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    failed = [r for r in replies.values() if r[0] == "error"]
    if failed:
        raise failed[0][1]
    return _merge(model, serial, replies, roots, fits, fit_count, shared, keep, progress, t0, all(chip_fits),
                  seeds or ())


#: the knobs that decide a root's inner block solves (the sharding and intra-chip results are
#: cached on them: two workers expanding roots of one class would each solve the same blocks)
_BLOCK_KNOBS = ("tp", "cp", "ep")
#: the knobs every block key of a root's child holds (``LLMModel.block``: blocks of two
#: micro-batch sizes share no solve), so a split root's children are dealt by them. Not ep: the
#: embedding, head and dense-layer blocks are keyed without it, and the layer's phases are
#: shared by content across ep (``LLMModel._phase_time``); dealt by (tp, cp, ep, micro-batch),
#: DeepSeek-V3 / 8192 dragonfly solved 9 blocks (41 -> 50) and 30 phases (104 -> 134) twice
_SPLIT_KNOBS = ("tp", "cp", "micro_batch")


def _slot(sh: _Shared, h: int) -> int | None:
    """(under the key table's lock) the slot of hash ``h`` in the key table (open addressing), or
    the empty slot where it would go; None when the table is full without it."""
    slot = h % _KEY_SLOTS
    table = sh.key_table
    for _ in range(_KEY_SLOTS):
        if table[slot] in (h, _EMPTY_SLOT):
            return slot
        slot = (slot + 1) % _KEY_SLOTS
    return None


def _owner_locked(sh: _Shared, key: tuple) -> int:
    """The key's owner so far, the caller holding the table's lock: -1 when not dealt yet; by its
    hash when the table is full (one owner per key all the same)."""
    return _lookup_locked(sh, key)[0]


def _lookup_locked(sh: _Shared, key: tuple) -> tuple[int, int | None, int]:
    """(:func:`_owner_locked`, the key's slot or the free one where it would go (None: the table
    is full without it), its hash)."""
    h = hash(key) or 1
    slot = _slot(sh, h)
    if slot is None:
        return h % sh.workers, None, h
    return (sh.key_owner[slot] if sh.key_table[slot] == h else _UNCLAIMED), slot, h


def _block_key(knobs: tuple) -> tuple:
    return tuple((k, v) for k, v in knobs if k in _SPLIT_KNOBS)


def _splittable(root: SpaceNode) -> bool:
    """A root whose children may go to several workers: not a leaf group (its mappings share one
    block), and without a memory screen (a root pruned by it admits its offloaded twin in the
    worker that screened it: one worker must own it)."""
    return not root.leaf and root.screen is None


def _homes(roots: list, fits: list[bool]) -> tuple[list[int], int]:
    """Each root's class (its tp, cp, ep) numbered in increasing order of the class's best
    bound, and the number of classes: class ``k`` is expanded by worker ``k mod workers``, so a
    block is solved in one worker only and the cheapest-bound classes are spread over all."""
    order = sorted((i for i in range(len(roots)) if fits[i]), key=lambda i: (roots[i].bound_s, i))
    classes: dict[tuple, int] = {}
    homes = [0] * len(roots)
    for i in order:
        key = tuple(v for k, v in roots[i].knobs if k in _BLOCK_KNOBS)
        homes[i] = classes.setdefault(key, len(classes))
    return homes, len(classes)


def _collect(conns: dict, shared: _Shared, workers: int, fit_count: int, progress, t0: float) -> dict:
    """Every worker's reply (workers that outlive the deadline by more than a grace are stopped
    and reported as cut), passing aggregated progress to ``progress`` meanwhile."""
    replies: dict[int, tuple] = {}
    streamed: dict[int, list] = {me: [] for me in conns.values()}  # incumbents sent while searching
    left = time_left_s()
    hard_stop = None if left is None else time.perf_counter() + left + _HARD_STOP_GRACE_S
    reporter = _Reporter(progress, t0)
    while len(replies) < workers:
        pending = [c for c, me in conns.items() if me not in replies]
        timeout = 0.1 if hard_stop is None else max(0.0, min(0.1, hard_stop - time.perf_counter()))
        for c in wait(pending, timeout=timeout):
            me = conns[c]
            try:
                message = c.recv()
            except EOFError:  # died without a word (killed)
                message = ("error", RuntimeError(f"search worker {me} died"), [], None, None, 0)
            if message[0] == "incumbent":
                streamed[me].append(message[1])
            else:
                replies[me] = message
        if hard_stop is not None and time.perf_counter() >= hard_stop:
            for c, me in conns.items():
                replies.setdefault(me, ("time", "stopped at the deadline", streamed[me], None, None, 0))
        if progress is not None:
            _report(reporter, shared, workers, fit_count)
    return replies


def _report(reporter: _Reporter, shared: _Shared, workers: int, fit_count: int) -> None:
    f = _PROGRESS_FIELDS
    rows = [shared.progress[w * f:(w + 1) * f] for w in range(workers)]
    rows = [r for r in rows if not math.isnan(r[0])]
    if not rows:
        return
    stats = SearchStats(candidates=int(sum(r[0] for r in rows) - (len(rows) - 1) * fit_count),
                        evaluated=int(sum(r[1] for r in rows)), pruned_bound=int(sum(r[2] for r in rows)))
    bests = [r[4] for r in rows if not math.isnan(r[4])]
    bounds = [r[5] for r in rows if not math.isnan(r[5])]
    reporter.maybe(stats, int(sum(r[3] for r in rows)), min(bests) if bests else None,
                   min(bounds) if bounds else None)


def _merge(model, serial, replies: dict, roots, fits, fit_count: int, shared: _Shared, keep: int, progress, t0,
           all_fit: bool = True, seeds: list = ()):
    # (the seeds evaluated before the fork join whatever worker 0 returned: kept if it was stopped)
    ok = [("seeds", None, list(seeds))] if seeds else []
    ok += [replies[w] for w in sorted(replies) if replies[w][0] in ("ok", "time") and replies[w][2]]
    if not ok:
        if all(r[0] in ("infeasible", "empty") for r in replies.values()):
            # nothing fits anywhere: the serial search states why (its smallest floor, its
            # inner failure), the same message as without workers; the floors make it quick
            return serial()
        leanest = [r[1] for r in replies.values() if r[0] == "time" and isinstance(r[1], tuple)]
        raise no_incumbent_error(f"search on {len(replies)} workers", min(leanest) if leanest else None)
    top: list = []
    seen: set = set()
    for r in ok:
        for ev in r[2]:
            if ev.mapping not in seen:
                seen.add(ev.mapping)
                _insert(top, ev, keep)
    best = top[0]
    t = best.iteration_time_s
    stats = SearchStats()
    owners = list(shared.owner[:])
    unclaimed = [r for i, (r, okay) in enumerate(zip(roots, fits)) if okay and owners[i] == _UNCLAIMED]
    cut = False
    lb = t
    proven = True
    counted_unclaimed = 0
    for me in sorted(replies):
        kind, _, _, s, _, n_unclaimed = replies[me]
        if s is not None:
            stats.candidates += s.candidates - (fit_count if me > 0 else 0)
            stats.evaluated += s.evaluated
            stats.pruned_bound += s.pruned_bound
            stats.pruned_memory += s.pruned_memory
            stats.notes.extend(n for n in s.notes if n not in stats.notes)
            # a worker cut by the deadline is ``cut`` below, not unproven: its bound may still
            # have passed the winner found by another (then the optimum is proven)
            proven = proven and s.inner_proven
            if kind == "time":  # cut before any mapping of its own fitted: the bound of what it left open
                cut, lb = True, min(lb, s.lower_bound_s)
            elif kind == "ok" and s.status == "time_limit":
                cut = cut or s.timed_out
                lb = min(lb, s.lower_bound_s)
        else:  # cut (or nothing fitting) before it returned: its claims stay open
            cut = cut or kind == "time"
            row = shared.progress[me * _PROGRESS_FIELDS:(me + 1) * _PROGRESS_FIELDS]
            if not math.isnan(row[0]):  # (stopped: its counts as of its last progress snapshot)
                stats.candidates += int(row[0]) - (fit_count if me > 0 else 0)
                stats.evaluated += int(row[1])
                stats.pruned_bound += int(row[2])  # (the snapshot counts bound and memory prunes together)
            mine = [r.bound_s for i, r in enumerate(roots) if owners[i] in (me, _SPLIT)]
            if me == 0 and not all_fit:  # worker 0 also held the offloaded twins of roots that did not fit
                mine.append(getattr(model, "global_lower_bound_s", lambda: 0.0)())
            lb = min([lb] + mine)
        counted_unclaimed += n_unclaimed
    # a root nobody claimed was pruned by the bound in every worker that reached the cutoff:
    # count it once
    unclaimed_count = sum(r.count for r in unclaimed)
    stats.pruned_bound += min(counted_unclaimed, unclaimed_count) - counted_unclaimed
    if cut:
        lb = min([lb] + [r.bound_s for r in unclaimed])
    closed = proven and lb >= t * (1 - 1e-12)
    if cut and closed:
        note = ("time limit reached after the optimum was proven: the runners-up listed may not be the next best")
        if note not in stats.notes:
            stats.notes.append(note)
        cut = False
    stats.timed_out = cut
    stats.proven_optimal = proven and not cut
    stats.status = "optimal" if stats.proven_optimal else "time_limit"
    stats.lower_bound_s = min(lb, t)
    stats.gap = max(0.0, (t - stats.lower_bound_s) / t) if t > 0 else 0.0
    tables = KnobTables()
    for me in sorted(replies):
        if replies[me][4] is not None:
            tables.merge(replies[me][4])
    stats.wall_s = time.perf_counter() - t0
    stats.runners_up = top[1:]
    stats.ruled_out = tables.ruled_out_counts(t)
    stats.why_not = tables.why_not(best.mapping, t)
    _Reporter(progress, t0).final(stats, t)
    return best, stats


__all__ = ["parallel_search"]
