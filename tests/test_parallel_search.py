"""Both cores (issue 12): the search shared between forked workers gives the serial search's
answer (same time, mapping, status, runners-up), the time limit holds for the whole call,
``workers=1`` is the serial path, and parallel validation returns the serial rows in order."""

from __future__ import annotations

import time

import copy
import math
import os
from functools import partial

import pytest
import yaml

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InputError
from dfmodel.inter_chip import parallel_search as ps
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import PlacementFreeBounds
from dfmodel.inter_chip.llm_space import LLMSpace, llm_candidates
from dfmodel.inter_chip.search import search, search_options
from dfmodel.parallel import fork_available, ordered_map, resolve_workers

from test_inter_chip import SMALL_LLM, small_system
from test_moe import MOE, with_moe
from test_offload import with_host

pytestmark = pytest.mark.skipif(not fork_available(), reason="parallel search needs the fork start method")


def _answer(r) -> tuple:
    """What must not depend on the number of workers."""
    return (r.iteration_time_s, r.parallelism.to_dict() if hasattr(r.parallelism, "to_dict") else vars(r.parallelism),
            r.solver.status, r.solver.proven_optimal, r.solver.gap,
            [(a["iteration_time_s"], a["mapping"]) for a in r.alternatives])


CASES = [
    pytest.param(SMALL_LLM, small_system(4, 2), {}, id="dense-8"),
    pytest.param(SMALL_LLM, small_system(4, 4, ib_bw="5 GB/s"), {}, id="dense-16-slow-ib"),
    pytest.param(SMALL_LLM, small_system(4, 2, capacity="1.2 GiB"), {}, id="dense-8-tight-memory"),
    pytest.param(with_moe(MOE), small_system(4, 2), {}, id="moe-8"),
    pytest.param(SMALL_LLM, small_system(4, 2), {"solver": "highs"}, id="dense-8-highs"),
    pytest.param(SMALL_LLM, with_host(small_system(2, 2, capacity="0.5 GiB"), link_bandwidth_Bps="8 GB/s",
                                      capacity_bytes="64 GB"), {}, id="offload-relief"),
]


@pytest.mark.parametrize("workload, system, kw", CASES)
def test_two_workers_give_the_serial_answer(workload, system, kw):
    serial = optimize(workload, system, workers=1, **kw)
    par = optimize(workload, system, workers=2, **kw)
    assert _answer(par) == _answer(serial)
    assert par.solver.status == "optimal"


@pytest.mark.parametrize("workload, system", [(SMALL_LLM, small_system(4, 2)), (with_moe(MOE), small_system(4, 2))])
def test_parallel_equals_exhaustive_enumeration(workload, system):
    """The oracle: the best of every mapping of the space, evaluated one by one."""
    w, s = load_workload(workload), load_system(system)
    model = LLMModel(w, s)
    evs = [model.evaluate(m) for m in llm_candidates(model, Knobs())]
    best = min(e.iteration_time_s for e in evs if e.fits)
    par = optimize(w, s, workers=2, alternatives=3)
    assert par.iteration_time_s == pytest.approx(best, rel=1e-12)
    times = sorted(e.iteration_time_s for e in evs if e.fits)
    assert [a["iteration_time_s"] for a in par.alternatives] == pytest.approx(times[1:4], rel=1e-12)


def test_three_workers_and_repeated_runs_agree():
    w, s = SMALL_LLM, small_system(4, 4, ib_bw="5 GB/s")
    answers = {repr(_answer(optimize(w, s, workers=j))) for j in (1, 2, 3, 2)}
    assert len(answers) == 1


def test_counts_are_the_serial_search_counts_of_the_space():
    """Every mapping is counted once: the candidates equal the serial search's (no host, so
    no offload twins join), and every candidate is settled (evaluated or pruned)."""
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 4, ib_bw="5 GB/s"))
    runs = {}
    for j in (1, 2):
        model = LLMModel(w, s)
        with search_options(alternatives=5, parallel=None if j == 1 else partial(ps.parallel_search, workers=j)):
            runs[j] = search(PlacementFreeBounds(model), LLMSpace(model, Knobs()))
    (b1, s1), (b2, s2) = runs[1], runs[2]
    assert b1.mapping == b2.mapping and b1.iteration_time_s == b2.iteration_time_s
    assert s2.candidates == s1.candidates
    assert s2.evaluated + s2.pruned >= s2.candidates - s2.evaluated  # nothing lost
    assert s2.pruned_bound + s2.pruned_memory + s2.evaluated >= s2.candidates
    assert s2.ruled_out == s1.ruled_out, (s1.ruled_out, s2.ruled_out)
    # the why-not table speaks for the same knob values
    assert set(s2.why_not) == set(s1.why_not)


def test_workers_one_is_the_serial_path(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("parallel search used with workers=1")

    monkeypatch.setattr(ps, "parallel_search", boom)
    r = optimize(SMALL_LLM, small_system(4, 2), workers=1)
    assert r.solver.status == "optimal"
    with pytest.raises(AssertionError, match="workers=1"):
        optimize(SMALL_LLM, small_system(4, 2), workers=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_worker_counts_name_their_field(bad):
    with pytest.raises(InputError, match="workers"):
        optimize(SMALL_LLM, small_system(4, 2), workers=bad)
    with pytest.raises(InputError):
        resolve_workers(bad)


def test_an_error_in_a_worker_reaches_the_caller(monkeypatch):
    """A bug in a forked worker is raised here (not a hang, not a silent serial answer)."""
    def broken(self, m, **kw):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(LLMModel, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        optimize(SMALL_LLM, small_system(4, 2), workers=2)


def test_progress_is_aggregated_and_final():
    seen = []
    r = optimize(SMALL_LLM, small_system(4, 4, ib_bw="5 GB/s"), workers=2, progress=seen.append)
    assert seen, "no progress snapshot"
    last = seen[-1]
    assert last.open == 0 and last.best_s == r.iteration_time_s
    assert last.bound_s == r.solver.lower_bound_s
    assert all(p.best_s is None or p.best_s >= r.iteration_time_s * (1 - 1e-12) for p in seen)


def test_ordered_map_keeps_order_and_reraises():
    assert ordered_map(lambda x: x * x, list(range(7)), workers=2) == [x * x for x in range(7)]
    got = []
    ordered_map(str, [3, 1, 2], workers=3, on_result=got.append)
    assert got == ["3", "1", "2"]
    with pytest.raises(ZeroDivisionError):
        ordered_map(lambda x: 1 // x, [1, 0, 2], workers=2)


def test_parallel_validation_returns_the_serial_rows(tmp_path):
    """Four published cases (fixed mappings and the free search) on two workers: the same rows,
    in the file's order, as one by one."""
    from dfmodel.validate import read_case_items, resolve_cases, validate_cases

    _, items = read_case_items(resolve_cases("megatron_a100"))
    small = [it for it in items if it.get("system", {}).get("num_chips", 10**9) <= 64][:4] or items[:4]
    f = tmp_path / "cases.yaml"
    f.write_text(yaml.safe_dump(copy.deepcopy(small)))
    order = []
    one = validate_cases(f, free=True, workers=1)
    two = validate_cases(f, free=True, workers=2, on_case=lambda r: order.append(r.id))
    assert [r.to_dict() for r in two] == [r.to_dict() for r in one]
    assert order == [r.id for r in one]


def test_a_worker_left_with_nothing_is_not_an_error(monkeypatch):
    """Worker 1 starts late and finds every root claimed by worker 0: it has no mapping of its
    own, which is no failure (nor a "nothing fits" report); the answer is the serial one."""
    import time

    roots = ps._ShardSpace.roots

    def late(self):
        if self.share.me == 1:
            time.sleep(1.5)
        return roots(self)

    monkeypatch.setattr(ps._ShardSpace, "roots", late)
    w, s = SMALL_LLM, small_system(4, 2)
    par = optimize(w, s, workers=2, alternatives=0)
    assert _answer(par) == _answer(optimize(w, s, workers=1, alternatives=0))


def test_a_worker_stuck_past_the_deadline_is_stopped_and_its_incumbents_kept(monkeypatch):
    """The time limit holds for the whole call even when a worker is inside an evaluation that
    cannot be cut (here: every evaluation after a worker's first sleeps 60 s without looking at
    the deadline): the parent stops it shortly after the deadline, and the mappings it had
    already evaluated (streamed to the parent as found) still make the answer."""
    import time

    real = LLMModel.evaluate
    calls = {"n": 0}

    def slow_after_first(self, m, **kw):
        calls["n"] += 1  # per process: each forked worker counts its own
        if calls["n"] > 1:
            time.sleep(60)
        return real(self, m, **kw)

    monkeypatch.setattr(LLMModel, "evaluate", slow_after_first)
    limit_s = 2.0
    t0 = time.perf_counter()
    r = optimize(SMALL_LLM, small_system(4, 4, ib_bw="5 GB/s"), workers=2, time_limit_s=limit_s)
    wall_s = time.perf_counter() - t0
    assert wall_s < limit_s + 1.0
    assert r.solver.status == "time_limit" and not r.solver.proven_optimal
    assert r.iteration_time_s > 0 and 0.0 <= r.solver.gap < 1.0
    assert r.solver.lower_bound_s <= r.iteration_time_s


def _split_all(monkeypatch) -> None:
    monkeypatch.setattr(ps._Share, "splits", lambda self: True)


@pytest.mark.parametrize("mode", ["all", "after-first-evaluation"])
@pytest.mark.parametrize("workload, system, kw", CASES)
def test_split_roots_give_the_serial_answer(workload, system, kw, mode, monkeypatch):
    """Every root split (as when evaluations are costly), or every root reached after the
    first evaluation (the others settled unsplit): each worker expands the split roots it
    reaches and keeps the micro-batch groups of the block keys dealt to it; the answer, status
    and runners-up are still the serial search's."""
    if mode == "all":
        _split_all(monkeypatch)
    else:
        monkeypatch.setattr(ps, "_SPLIT_EVAL_S", 0.0)
    serial = optimize(workload, system, workers=1, **kw)
    par = optimize(workload, system, workers=2, **kw)
    assert _answer(par) == _answer(serial)


@pytest.mark.parametrize("setup", ["split", "handed"])
def test_every_mapping_counted_once(setup, monkeypatch):
    """With every root split (``split``), a worker counts only its own groups of a root another
    worker expanded; with every key a worker settles handed to another (``handed``), a key's
    groups are counted by their final owner only. Either way the candidates and the ruled-out
    counts are the serial search's, and every candidate is settled."""
    (_split_all if setup == "split" else _hand_every_key)(monkeypatch)
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 4, ib_bw="5 GB/s"))
    runs = {}
    for j in (1, 2, 3):
        model = LLMModel(w, s)
        with search_options(alternatives=5, parallel=None if j == 1 else partial(ps.parallel_search, workers=j)):
            runs[j] = search(PlacementFreeBounds(model), LLMSpace(model, Knobs()))
    b1, s1 = runs[1]
    for j in (2, 3):
        b, st = runs[j]
        assert (b.mapping, b.iteration_time_s) == (b1.mapping, b1.iteration_time_s)
        assert [e.mapping for e in st.runners_up] == [e.mapping for e in s1.runners_up]
        assert st.candidates == s1.candidates
        assert st.pruned_bound + st.pruned_memory + st.evaluated >= st.candidates
        assert st.ruled_out == s1.ruled_out


@pytest.mark.parametrize("workload", [SMALL_LLM, with_moe(MOE)], ids=["dense", "moe"])
def test_split_roots_spread_micro_batch_sizes_over_workers(workload, monkeypatch):
    """A split root's micro-batch groups go to both workers (the point of splitting), and no
    block is solved by two workers: the (tp, cp, micro-batch) each worker evaluated are
    disjoint -- not only with ep, which the embedding, head and dense-layer blocks are not keyed
    on -- while one (tp, cp, ep) class spans both."""
    import multiprocessing

    _split_all(monkeypatch)
    monkeypatch.setattr(ps, "_seeds_before_fork", lambda model: True)  # (worker 0 evaluates any seed else)
    path = multiprocessing.get_context("fork").Manager().list()
    real = LLMModel.evaluate

    def record(self, m, **kw):
        path.append((os.getpid(), m.tp, m.cp, m.micro_batch, m.ep))
        return real(self, m, **kw)

    monkeypatch.setattr(LLMModel, "evaluate", record)
    optimize(workload, small_system(4, 4, ib_bw="5 GB/s"), workers=2)
    by_pid: dict = {}
    for pid, *key in list(path):
        by_pid.setdefault(pid, set()).add(tuple(key))
    by_pid.pop(os.getpid(), None)  # (the seeds, evaluated before the fork)
    assert len(by_pid) == 2, by_pid
    a, b = by_pid.values()
    assert not {k[:3] for k in a} & {k[:3] for k in b}
    # one (tp, cp, ep) class searched by both workers (dealt by class, it could not be)
    assert {(k[0], k[1], k[3]) for k in a} & {(k[0], k[1], k[3]) for k in b}


def test_block_keys_are_dealt_once_and_in_turn(monkeypatch):
    """The shared key table: a key's owner never changes, keys go to the worker with the fewest
    so far, an unknown key is unowned when not dealt, and a full table still gives each key one
    owner (its hash's)."""
    import multiprocessing

    monkeypatch.setattr(ps, "_KEY_SLOTS", 3)
    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    keys = [(("tp", 8), ("micro_batch", mb)) for mb in (12, 10, 5, 6)]
    assert w1.key_owner(keys[0], deal=False) == ps._UNCLAIMED
    assert [w1.key_owner(k, deal=True) for k in keys[:3]] == [0, 1, 0]
    assert [w0.key_owner(k, deal=False) for k in keys[:3]] == [0, 1, 0]  # the same seen from any worker
    full = w0.key_owner(keys[3], deal=True)
    assert full == (hash(keys[3]) or 1) % 2 == w1.key_owner(keys[3], deal=False)


def test_a_root_settled_unsplit_stays_its_homes(monkeypatch):
    """Worker 1 reaches root 0 (worker 0's) while evaluations look cheap: it drops the root, so
    the root must stay worker 0's even when evaluations look costly by the time worker 0
    reaches it (split then, worker 1's share of it would be searched by nobody)."""
    import multiprocessing

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 2)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    monkeypatch.setattr(ps._Share, "splits", lambda self: False)
    assert w1.decide(0, home=0) == 0
    monkeypatch.setattr(ps._Share, "splits", lambda self: True)
    assert w0.decide(0, home=0) == 0
    assert w0.decide(1, home=0) == ps._SPLIT and w1.decide(1, home=0) == ps._SPLIT


def test_only_dataflow_chips_evaluate_the_seeds_before_the_fork():
    """The seeds are evaluated before the fork (and their cost decides the first roots'
    splitting) only where their blocks and lattices cost seconds (dataflow); on GPUs worker 0
    evaluates them while worker 1 searches."""
    gpu = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    dataflow = LLMModel(load_workload("gpt3_13b"), load_system("sn30"))
    assert gpu.system.chip.execution == "kernel_by_kernel" and not ps._seeds_before_fork(gpu)
    assert dataflow.system.chip.execution == "dataflow" and ps._seeds_before_fork(dataflow)


def test_seeds_are_evaluated_once_before_the_fork(monkeypatch):
    """A MoE space's recipe incumbents are evaluated in the parent, before the workers start
    (worker 1 would otherwise evaluate those it reaches again, and search without their cutoff
    meanwhile); the answer is the serial search's."""
    parent = os.getpid()
    seen = []
    seeds = LLMSpace.seeds

    def record(self, capacity, evaluate, *args, **kw):
        for ev in seeds(self, capacity, evaluate, *args, **kw):
            seen.append(os.getpid())
            yield ev

    monkeypatch.setattr(LLMSpace, "seeds", record)
    monkeypatch.setattr(ps, "_seeds_before_fork", lambda model: True)  # (the small system is a GPU's)
    w, s = with_moe(MOE), small_system(4, 2)
    serial = optimize(w, s, workers=1)
    seen.clear()
    par = optimize(w, s, workers=2)
    assert seen and set(seen) == {parent}
    assert _answer(par) == _answer(serial)


def test_a_worker_cut_after_its_bound_passed_the_winner_leaves_the_optimum_proven():
    """The parent's merge of worker records: worker 1 stopped at the deadline while it searched
    for runners-up, its open bound (1.1) already above the winner worker 0 found (1.0). The
    optimum is proven (as the serial search reports it: status optimal, the note that the
    runners-up may not be the next best); with its bound below the winner (0.9), it is not.
    (A cut worker once counted as an unproven inner solve: DeepSeek-V3 on SN30 came back
    ``time_limit`` at 0.0 % gap.)"""
    import multiprocessing
    from dataclasses import dataclass
    from types import SimpleNamespace

    from dfmodel.inter_chip.search import SearchStats

    @dataclass(frozen=True, order=True)
    class Mapping:
        tp: int

    def ev(t, tp):
        return SimpleNamespace(iteration_time_s=t, mapping=Mapping(tp))

    def merged(worker1_bound_s):
        done = SearchStats(evaluated=3)
        cut = SearchStats(evaluated=2, timed_out=True, status="time_limit", proven_optimal=False,
                          lower_bound_s=worker1_bound_s)
        replies = {0: ("ok", None, [ev(1.0, 1), ev(1.3, 2)], done, None, 0),
                   1: ("ok", None, [ev(1.2, 4)], cut, None, 0)}
        shared = ps._Shared(multiprocessing.get_context("fork"), 2, 3, 0)
        return ps._merge(None, None, replies, [], [], 0, shared, 3, None, 0.0)

    best, stats = merged(1.1)
    assert best.iteration_time_s == 1.0 and [e.iteration_time_s for e in stats.runners_up] == [1.2, 1.3]
    assert (stats.status, stats.proven_optimal, stats.lower_bound_s, stats.gap) == ("optimal", True, 1.0, 0.0)
    assert any("runners-up listed may not be the next best" in n for n in stats.notes)
    best, stats = merged(0.9)
    assert (stats.status, stats.proven_optimal, stats.lower_bound_s) == ("time_limit", False, 0.9)
    assert stats.gap == pytest.approx(0.1)


def test_a_worker_cut_with_no_mapping_of_its_own_reports_its_open_bound():
    """A worker cut by the deadline before any mapping of its own fitted (the incumbents being
    the other worker's, or the seeds evaluated before the fork) sends the bound of what it left
    open; the merge takes that, not the bound of every root it claimed (0.1 here: DeepSeek-V3 on
    8192 dragonfly chips came back at an 85 % gap, the serial search's being 19 %)."""
    import multiprocessing
    from dataclasses import dataclass
    from types import SimpleNamespace

    from dfmodel.inter_chip.search import SearchStats
    from dfmodel.inter_chip.space import SpaceNode

    @dataclass(frozen=True, order=True)
    class Mapping:
        tp: int

    root = SpaceNode(0.1, 0.0, 5, (("tp", 8),), lambda: [], False)
    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    shared.owner[0] = 1  # worker 1 claimed the root

    def merged(worker1_open_s):
        done = SearchStats(evaluated=3)
        cut = None if worker1_open_s is None else SearchStats(evaluated=2, timed_out=True,
                                                              lower_bound_s=worker1_open_s)
        replies = {0: ("ok", None, [SimpleNamespace(iteration_time_s=1.0, mapping=Mapping(1))], done, None, 0),
                   1: ("time", None, [], cut, None, 0)}
        return ps._merge(None, None, replies, [root], [True], 0, shared, 1, None, 0.0)[1]

    stats = merged(0.9)
    assert (stats.status, stats.lower_bound_s, stats.evaluated) == ("time_limit", 0.9, 5)
    assert stats.gap == pytest.approx(0.1)
    assert merged(1.2).status == "optimal"
    stats = merged(None)  # (no bound sent: stopped at the hard stop) its claimed roots stay open
    assert stats.lower_bound_s == 0.1


def test_a_key_is_handed_once_to_a_worker_ahead_and_reaches_its_shelf():
    """Worker 0 first reaches a group of its key at bound 2 while worker 1's queue head is at 3:
    the key goes to worker 1 and is settled (asked again, it stays there); worker 1 takes the
    groups it shelved for that key (once), and a worker that has finished takes no more keys."""
    import multiprocessing
    from types import SimpleNamespace

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    a, b, c = (("tp", 8), ("micro_batch", 1)), (("tp", 8), ("micro_batch", 2)), (("tp", 4), ("micro_batch", 1))
    assert [w0.key_owner(k, deal=True) for k in (a, b, c)] == [0, 1, 0]
    group = SimpleNamespace(key=a, take_refined=lambda: None)
    w1.shelve([group])
    assert w1.arrived(3.0) == []
    assert w0.settle(a, 2.0) == 1 and w0.settle(a, 2.0) == 1
    assert w0.key_owner(a, deal=False) == w1.key_owner(a, deal=False) == 1
    assert w1.arrived(3.0) == [group] and w1.arrived(3.0) == []
    assert w0.settle(c, 4.0) == 0  # worker 1 is behind: the key stays (settled) with worker 0
    assert w1.finish(final=True) == [] and shared.done[1]
    d, e = (("tp", 2), ("micro_batch", 1)), (("tp", 1), ("micro_batch", 1))
    assert [w0.key_owner(k, deal=True) for k in (d, e)] == [1, 0]  # (dealt by count, as before)
    assert w0.settle(e, -1.0) == 0  # worker 1's head (3) is past the bound, but it has finished


def test_a_handed_key_brings_the_bounds_its_first_worker_refined():
    """A split root's child refined to the end by the worker holding its key (both stages of a
    staged refine) is not refined again where the key is handed: that worker's copy takes the
    refined bound and no refine; a child refined part-way, or not at all, keeps its own."""
    import multiprocessing
    from functools import partial

    from dfmodel.inter_chip.space import SpaceNode

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    key = (("tp", 8), ("micro_batch", 2))
    assert w0.key_owner(key, deal=True) == 0
    calls = []

    def child(worker):  # a micro-batch group with a two-stage refine (as LLMSpace's on dataflow chips)
        node = SpaceNode(1.0, 0.0, 4, key, lambda: [], refine=None)

        def refine(stage):
            calls.append((worker, stage))
            if stage == 0:
                node.refine = partial(refine, 1)
            return (2.0, 3.0)[stage]

        node.refine = partial(refine, 0)
        return node

    full0, half0 = ps._KeyProxy(child(0), key, w0, 0), ps._KeyProxy(child(0), key, w0, 1)
    full1, half1 = ps._KeyProxy(child(1), key, w1, 0), ps._KeyProxy(child(1), key, w1, 1)
    fresh1 = ps._KeyProxy(child(1), key, w1, 2)
    for proxy, stages in ((full0, 2), (half0, 1)):  # (as the search runs them: bound raised, re-queued)
        for _ in range(stages):
            refine, proxy.refine = proxy.refine, None
            proxy.bound_s = max(proxy.bound_s, refine())
    assert full0.refine is None and half0.refine is not None
    w1.shelve([full1, half1, fresh1])
    assert w1.arrived(9.0) == []  # (worker 1's head at 9: ahead of worker 0)
    assert w0.settle(key, 0.5) == 1
    got = w1.arrived(9.0)
    assert got == [full1, half1, fresh1]
    assert full1.bound_s == 3.0 and full1.refine is None
    assert half1.bound_s == fresh1.bound_s == 1.0 and half1.refine is not None and fresh1.refine is not None
    assert (1, 0) not in calls and calls == [(0, 0), (0, 1), (0, 0)]


def test_a_worker_with_nothing_left_waits_for_a_key_and_ends_with_the_others():
    """A worker whose queue ran out waits, as the worker furthest ahead, for the next key another
    worker settles (it takes the groups it shelved for it), and ends once every other worker is
    done or waiting too; never while one is still searching."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    a = (("tp", 8), ("micro_batch", 1))
    assert w0.key_owner(a, deal=True) == 0
    group = SimpleNamespace(key=a, take_refined=lambda: None)
    w1.shelve([group])
    got = []
    waiting = threading.Thread(target=lambda: got.append(w1.finish()))
    waiting.start()
    while not shared.waiting[1]:  # (worker 1 is idle, its head at infinity)
        time.sleep(0.001)
    assert waiting.is_alive() and not shared.done[1]
    assert w0.settle(a, 5.0) == 1  # worker 0 reaches the key: it goes to the idle worker
    waiting.join(5.0)
    assert got == [[group]] and not shared.done[1] and not shared.waiting[1]
    waiting = threading.Thread(target=lambda: got.append(w1.finish()))
    waiting.start()
    time.sleep(0.05)
    assert waiting.is_alive()  # worker 0 still searches
    with shared.key_hash.get_lock():
        shared.done[0] = 1
    waiting.join(5.0)
    assert got[-1] == [] and shared.done[1]


def test_workers_waiting_on_each_other_all_end():
    import multiprocessing

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w1 = ps._Share(shared, 1)
    shared.waiting[0] = 1  # (worker 0 is idle in finish() too)
    assert w1.finish() == [] and shared.done[1]


def test_a_worker_cut_with_groups_just_handed_to_it_takes_no_more_keys():
    """A worker cut by the deadline takes what was handed to it last (its bound counts as open)
    and is done at once, even though groups arrived: a key handed to it after it returned would
    be searched by no worker and counted open by none, and its bound would be overstated."""
    import multiprocessing
    from types import SimpleNamespace

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 1, 1)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    a, b = (("tp", 8), ("micro_batch", 1)), (("tp", 4), ("micro_batch", 1))
    assert [w0.key_owner(k, deal=True) for k in (a, b)] == [0, 1]
    group = SimpleNamespace(key=a, take_refined=lambda: None)
    w1.shelve([group])
    w1.arrived(3.0)
    assert w0.settle(a, 2.0) == 1  # handed to worker 1, ahead
    assert w1.finish(final=True) == [group] and shared.done[1]
    assert w0.key_owner(b, deal=True) == 1 and w0.settle(b, 2.0) == 1  # (its own key: not handed back)
    c = (("tp", 2), ("micro_batch", 1))
    assert w0.key_owner(c, deal=True) == 0 and w0.settle(c, 2.0) == 0  # nothing more goes to worker 1


def _hand_every_key(monkeypatch) -> None:
    """Every worker looks infinitely far ahead: each key a worker settles goes to another
    worker still searching (the most handing over there can be)."""
    _split_all(monkeypatch)
    arrived = ps._Share.arrived
    monkeypatch.setattr(ps._Share, "arrived", lambda self, head_s: arrived(self, math.inf))


@pytest.mark.parametrize("workload, system, kw", CASES)
def test_keys_handed_over_give_the_serial_answer(workload, system, kw, monkeypatch):
    _hand_every_key(monkeypatch)
    serial = optimize(workload, system, workers=1, **kw)
    par = optimize(workload, system, workers=2, **kw)
    assert _answer(par) == _answer(serial)


@__import__("dataclasses").dataclass(frozen=True, order=True)
class _Seed:
    tp: int
    pp: int
    cp: int = 1


class _SeedModel:
    """Evaluates a seed (pipeline depth 2: none fits) recording the process in its block cache;
    the first seed slowly (the helper then announces its own first)."""

    def __init__(self):
        self._blocks, self._phases = {}, {}

    def evaluate(self, m):
        from types import SimpleNamespace

        if m == _Seed(8, 1):
            import time

            time.sleep(0.3)
        self._blocks[(m.tp, m.pp)] = os.getpid()
        return SimpleNamespace(iteration_time_s=float(m.tp * m.pp), fits=m.pp != 2, mapping=m, pid=os.getpid())


def _seed_walk(capacity, evaluate):
    """LLMSpace.seeds' walk: per pipeline depth the first candidate that fits (TP 8 first at
    depth 1, TP 4 first deeper)."""
    for pp in (1, 2, 4):
        for tp in ((8, 4) if pp == 1 else (4, 8)):
            ev = evaluate(_Seed(tp, pp))
            if ev is None:
                return
            if not isinstance(ev, Exception) and ev.fits:
                yield ev
                break


@pytest.mark.skipif(not fork_available(), reason="needs fork")
def test_a_forked_helper_evaluates_the_other_tp_degrees_seeds_ahead():
    """_SeedPrefetch: the helper walks the seeds as if each fitted and evaluates those of another
    TP degree than the first seed's (TP 4 at depths 2 and 4); this process walks them as the
    serial search does, taking the helper's evaluations (and its solved blocks into its cache)
    and evaluating the rest itself, the fallback after a seed that does not fit included (TP 8
    at depth 2). The seeds are the serial walk's."""
    from types import SimpleNamespace

    serial_model = _SeedModel()
    serial = [ev.mapping for ev in _seed_walk(0.0, serial_model.evaluate)]
    model = _SeedModel()
    with ps._SeedPrefetch(model, SimpleNamespace(seeds=_seed_walk), 0.0) as prefetched:
        seeds = list(_seed_walk(0.0, prefetched.result))
    assert [ev.mapping for ev in seeds] == serial == [_Seed(8, 1), _Seed(4, 4)]
    here = os.getpid()
    assert [ev.pid == here for ev in seeds] == [True, False]
    assert model._blocks[(4, 2)] != here and model._blocks[(8, 2)] == here  # (the helper's block is cached here)
    assert prefetched.helper_s > 0.0


def test_workers_read_the_times_another_published():
    """The keep-th best and the best over every worker's times (:meth:`_Share.cutoff`,
    :meth:`_Share.best`) follow each publish of either worker, read again only after one."""
    import multiprocessing
    from types import SimpleNamespace

    shared = ps._Shared(multiprocessing.get_context("fork"), 2, 2, 0)
    w0, w1 = ps._Share(shared, 0), ps._Share(shared, 1)
    ev = lambda t: SimpleNamespace(iteration_time_s=t, mapping=t)  # noqa: E731
    assert w1.cutoff(7.0) == 7.0 and w1.best(None) is None  # (nothing published: the worker's own)
    w0.publish([ev(5.0), ev(6.0)])
    assert w1.cutoff(None) == 6.0 and w1.best(None) == 5.0
    w1.publish([ev(4.0)])
    assert w0.cutoff(None) == w1.cutoff(None) == 5.0 and w0.best(None) == 4.0
    w0.publish([ev(3.0), ev(5.0)])
    assert w1.cutoff(None) == 4.0 and w1.best(None) == 3.0
