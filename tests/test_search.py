"""The outer search: a whole-call time limit, exact runners-up, why-not tables, progress."""

from __future__ import annotations

import time

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import TimeLimitError
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import PlacementFreeBounds
from dfmodel.inter_chip.search import Progress, llm_candidates, search
from dfmodel.solvers.deadline import clamp, deadline_scope, expired, time_left_s
from tests.test_inter_chip import SMALL_LLM, small_system


def test_deadline_clamps_solver_limits_and_nests():
    assert clamp(3.0) == 3.0 and time_left_s() is None
    with deadline_scope(100.0):
        assert 99.0 < clamp(None) <= 100.0
        assert clamp(2.0) == 2.0
        with deadline_scope(1000.0):  # an inner scope never extends the outer deadline
            assert clamp(None) <= 100.0
        with deadline_scope(0.5):
            assert clamp(5.0) <= 0.5
    with deadline_scope(0.0):
        assert expired() and clamp(5.0) > 0  # a solve still gets a few ms to return its incumbent


@pytest.mark.parametrize("cut_short", [True, False])
def test_a_slow_evaluation_that_stops_at_the_deadline_does_not_stop_the_search(monkeypatch, cut_short):
    """The search does not start an evaluation that could overrun the deadline; what counts is
    the part that cannot be cut short. Here the second evaluation spends 2.5 s of a 4 s limit:
    inside an :func:`interruptible` section (as the intra-chip DP and the MILP solves, which
    stop at the deadline themselves) the search goes on; as plain work it stops there
    (``time_limit``, within the limit). DeepSeek-V3 on SN30 once stopped ~2 s early so."""
    import contextlib

    from dfmodel.solvers.deadline import interruptible

    real, calls = LLMModel.evaluate, {"n": 0}

    def slow_second(self, m, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            with interruptible() if cut_short else contextlib.nullcontext():
                time.sleep(2.5)
        return real(self, m, **kw)

    monkeypatch.setattr(LLMModel, "evaluate", slow_second)
    t0 = time.perf_counter()
    r = optimize(SMALL_LLM, small_system(4, 4, ib_bw="5 GB/s"), workers=1, time_limit_s=4.0)
    assert time.perf_counter() - t0 < 5.0
    if cut_short:
        assert calls["n"] > 2
    else:
        assert calls["n"] == 2 and r.solver.status == "time_limit"


@pytest.mark.parametrize("workers", [1, 2])
def test_one_second_limit_on_a_large_case_holds(workers):
    """In a fresh interpreter (a user's call; a long test session's caches and garbage would
    slow any call): 1 s on Llama-3 70B x 512 H100 returns within 2 s with a gap, on one worker
    and on two (the parallel search, dfmodel.inter_chip.parallel_search)."""
    import json
    import subprocess
    import sys

    code = (
        "import json, time\n"
        "from dfmodel import optimize\n"
        "t0 = time.perf_counter()\n"
        f"r = optimize('llama3_70b', 'dgx_h100', num_chips=512, time_limit_s=1.0, workers={workers})\n"
        "print(json.dumps({'wall': time.perf_counter() - t0, 'time': r.iteration_time_s,"
        " 'solver': r.to_dict()['solver'], 'notes': r.notes}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout.strip().splitlines()[-1])
    s = d["solver"]
    assert d["wall"] < 2.0
    assert s["status"] == "time_limit" and not s["proven_optimal"]
    assert 0.0 < s["gap"] < 1.0
    assert s["lower_bound_s"] <= d["time"]
    assert s["gap"] == pytest.approx(1 - s["lower_bound_s"] / d["time"])
    assert any("time limit" in n for n in d["notes"])


def test_cli_time_limit_caps_the_command():
    """``dfmodel solve --time-limit 2`` counts from the command's start (imports and loading
    included), so the whole process ends within about a second of the limit (interpreter start
    aside, measured as a bare ``import dfmodel.cli`` beside it, so a loaded machine does not fail
    it), with the time-limited status and a gap in its JSON. Without the cap the run takes ~50 s."""
    import json
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()  # (the interpreter's start and the CLI's imports, on this machine now)
    subprocess.run([sys.executable, "-c", "import dfmodel.cli"], check=True, timeout=120)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dfmodel.cli", "solve", "-w", "llama3_70b", "-s", "dgx_h100",
                          "--num-chips", "512", "--time-limit", "2", "--quiet", "--json", "-"],
                         capture_output=True, text=True, timeout=120)
    wall_s = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    solver = json.loads(out.stdout)["solver"]
    assert solver["status"] == "time_limit" and 0.0 < solver["gap"] < 1.0
    assert wall_s < 2.0 + 1.0 + max(start_s, 0.5), (wall_s, start_s)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_cut_search_with_nothing_fitting_says_what_the_leanest_needs(workers, monkeypatch):
    """GPT-3 1T on 64 H100s, with the host-memory floors switched off (with them the search
    proves at once that nothing fits: test_host_floor.py): every offloaded mapping is
    evaluated and overflows the host, so a search cut at 6 s names the leanest one's memory in
    its time-limit error, not only time. (6 s, not 3: on a loaded machine a 3 s cut could end
    before the first evaluation finished, and the test then met the other message.)"""
    from dfmodel.inter_chip import host_floor
    from dfmodel.inter_chip.llm_space import LLMSpace

    monkeypatch.setattr(host_floor, "host_floor_bytes", lambda model, m: 0.0)
    monkeypatch.setattr(LLMSpace, "_host_screen", lambda self, *args: True)
    with pytest.raises(TimeLimitError, match="none fitting yet") as exc:
        optimize("gpt3_1t", "dgx_h100", num_chips=64, time_limit_s=6.0, workers=workers)
    assert "the leanest mapping evaluated needs" in str(exc.value) and "GiB" in str(exc.value)
    assert exc.value.exit_code == 4


def test_limit_too_short_for_any_mapping_says_so():
    with pytest.raises(TimeLimitError, match="before any mapping") as exc:
        optimize("gpt3_1t", "dgx_h100", time_limit_s=1e-4)
    assert exc.value.exit_code == 4


def test_generous_limit_changes_nothing():
    w, s = SMALL_LLM, small_system(4, 2)
    a, b = optimize(w, s), optimize(w, s, time_limit_s=600)
    assert a.iteration_time_s == b.iteration_time_s and b.solver.status == "optimal"
    assert b.solver.gap == 0.0 and b.solver.lower_bound_s == b.iteration_time_s


@pytest.mark.parametrize("k", [1, 5])
def test_alternatives_are_exactly_the_next_best(k):
    """Runners-up equal the K next-best times of exhaustive enumeration; each re-evaluates to a
    valid mapping that fits, no faster than the winner."""
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2))
    r = optimize(w, s, alternatives=k)
    model = LLMModel(w, s)
    evs = [model.evaluate(m) for m in llm_candidates(model, Knobs())]
    times = sorted(e.iteration_time_s for e in evs if e.fits)
    assert r.iteration_time_s == pytest.approx(times[0], rel=1e-12)
    assert [a["iteration_time_s"] for a in r.alternatives] == pytest.approx(times[1:k + 1], rel=1e-12)
    valid = set(llm_candidates(model, Knobs()))
    by_mapping = {e.mapping: e for e in evs}
    for a in r.alternatives:
        assert a["iteration_time_s"] >= r.iteration_time_s
        assert a["slower_by"] >= 0 and a["differs"] and a["bottleneck"] in r.breakdown_s
        m = next(c for c in valid if _same(c, a["mapping"]))
        ev = by_mapping[m]
        assert ev.fits and ev.iteration_time_s == pytest.approx(a["iteration_time_s"], rel=1e-12)


def _same(mapping, d) -> bool:
    from dfmodel.inter_chip.search import knob_items, knob_value

    return {k: knob_value(v) for k, v in knob_items(mapping)} == d


def test_why_not_answers_every_other_tp():
    """"Why not TP 2?": every tp value the search saw is either slower (evaluated), bounded
    no better than the winner, or ruled out, and the numbers say by how much."""
    r = optimize(SMALL_LLM, small_system(4, 2, capacity="3 GiB"))
    rows = {k: v for k, v in r.why_not.items() if v["knob"] == "tp"}
    assert rows and f"tp={r.parallelism.tp}" not in rows
    for row in rows.values():
        assert row["status"] in ("slower", "bound", "memory", "infeasible")
        if row["status"] == "slower":
            assert row["best_s"] >= r.iteration_time_s
        if row["status"] == "bound":
            assert row["bound_s"] >= r.iteration_time_s * (1 - 1e-12)
    assert set(r.ruled_out) <= {"memory", "infeasible"}
    d = r.to_dict()
    assert "alternatives" in d and "why_not" in d and "ruled_out" in d


def test_placement_free_bounds_equal_the_models_on_every_candidate():
    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    memo = PlacementFreeBounds(model)
    cands = list(llm_candidates(model, Knobs()))
    for m in cands:
        assert memo.lower_bound_s(m) == model.lower_bound_s(m)
        assert memo.memory_floor_bytes(m) == model.memory_floor_bytes(m)
    # the global floor is below every candidate's bound (it covers candidates never enumerated)
    assert memo.global_lower_bound_s() <= min(model.lower_bound_s(m) for m in cands) * (1 + 1e-12)
    for mb in (1, 2, 4):
        assert model.compute_floor_s(mb, "none") >= mb * model.compute_floor_s(1, "none") * (1 - 1e-12)


def test_progress_callback_sees_monotone_counts():
    seen: list[Progress] = []
    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    best, stats = search(model, llm_candidates(model, Knobs()), progress=seen.append)
    assert seen and seen[-1].best_s == best.iteration_time_s and seen[-1].gap == 0.0
    done = [p.done for p in seen]
    assert done == sorted(done)


def test_cli_json_stays_clean_and_carries_alternatives(tmp_path):
    import json

    from typer.testing import CliRunner

    from dfmodel.cli import app

    import yaml

    wf, sf = tmp_path / "w.yaml", tmp_path / "s.yaml"
    wf.write_text(yaml.safe_dump(SMALL_LLM))
    sf.write_text(yaml.safe_dump(small_system(4, 2)))
    res = CliRunner().invoke(app, ["solve", "-w", str(wf), "-s", str(sf), "--alternatives", "3", "--json", "-"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert len(d["alternatives"]) == 3 and d["solver"]["status"] == "optimal"
    table = CliRunner().invoke(app, ["solve", "-w", str(wf), "-s", str(sf), "--quiet"])
    assert "runners-up" in table.stdout and "why not" in table.stdout
    bad = CliRunner().invoke(app, ["solve", "-w", str(wf), "-s", str(sf), "--time-limit", "0"])
    assert bad.exit_code == 2


def test_progress_is_quiet_off_a_terminal():
    import io

    from dfmodel.progress import enabled

    assert not enabled(False, io.StringIO()) and not enabled(True, io.StringIO())


def test_no_candidate_at_all_is_infeasible_with_or_without_a_limit():
    from dfmodel.errors import InfeasibleError

    for limit in (None, 30.0):
        with pytest.raises(InfeasibleError, match="no valid mapping"):
            optimize(SMALL_LLM, small_system(17, 1), time_limit_s=limit)  # 17 chips, 8 layers, batch 16


def _symmetric_system():
    s = small_system(2, 2)
    s["network"] = [
        {"name": "x", "topology": "ring", "size": 2, "link_bandwidth_Bps": "100 GB/s", "latency_s": "2 us"},
        {"name": "y", "topology": "ring", "size": 2, "link_bandwidth_Bps": "100 GB/s", "latency_s": "2 us"},
        {"name": "z", "topology": "ring", "size": 2, "link_bandwidth_Bps": "100 GB/s", "latency_s": "2 us"},
    ]
    return s


def test_symmetric_placements_are_searched_once_and_change_nothing():
    from dfmodel.inter_chip.llm_family import distinct_up_to_symmetry, symmetric_dims
    from dfmodel.inter_chip.llm_family import solve_llm

    w, s = load_workload(SMALL_LLM), load_system(_symmetric_system())
    assert symmetric_dims(s) == [["x", "y", "z"]]
    model = LLMModel(w, s)
    all_c = list(llm_candidates(model, Knobs()))
    kept = list(distinct_up_to_symmetry(all_c, s))
    assert len(kept) < len(all_c)
    import dataclasses

    from dfmodel.inter_chip.llm_family import canonical_placement

    classes = symmetric_dims(s)
    times: dict = {}
    for m in all_c:  # twins (same canonical placement) cost exactly the same
        key = dataclasses.replace(m, placement=canonical_placement(m.placement, classes))
        times.setdefault(key, []).append(model.evaluate(m).iteration_time_s)
    assert any(len(v) > 1 for v in times.values())
    for v in times.values():
        assert max(v) == pytest.approx(min(v), rel=1e-12)
    full = solve_llm(w, s, Knobs(), exhaustive=True)
    fast = optimize(w, s)
    assert fast.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)


@pytest.mark.parametrize("capacity", [None, "3 GiB"])
def test_memory_before_blocks_is_a_floor_on_every_candidate(capacity):
    """The pre-solve memory screen never exceeds the evaluated memory (so it never rules out a
    mapping that fits), is not vacuous, and screening changes neither winner nor runners-up."""
    kw = {"capacity": capacity} if capacity else {}
    w, s = load_workload(SMALL_LLM), load_system(small_system(4, 2, **kw))
    model = LLMModel(w, s)
    evs = [model.evaluate(m) for m in llm_candidates(model, Knobs())]
    close = 0
    for ev in evs:
        floor = LLMModel(w, s).memory_before_blocks(ev.mapping).total_bytes
        assert floor <= ev.memory.total_bytes * (1 + 1e-12)
        close += floor >= 0.7 * ev.memory.total_bytes
    assert close >= len(evs) // 2
    times = sorted(e.iteration_time_s for e in evs if e.fits)
    r = optimize(w, s, alternatives=3)
    assert r.iteration_time_s == pytest.approx(times[0], rel=1e-12)
    assert [a["iteration_time_s"] for a in r.alternatives] == pytest.approx(times[1:4], rel=1e-12)


# -- issue 12 (session 4): the MoE mean-stage memory floor ---------------------------------------
def test_moe_memory_floor_counts_the_whole_model():
    """The MoE floor (memory.mean_stage_floor_bytes: the whole model's state over the stages, the
    experts sharded over their own expert-dp ranks) stays below the evaluated memory of every
    candidate of a small MoE model with dense layers, every ZeRO stage included, and is the
    binding one (above the per-layer floor at the lightest layer kind) on some of them."""
    from dfmodel.inter_chip import memory as mem
    from tests.test_moe_physics import moe_workload

    model = LLMModel(load_workload(moe_workload(first_dense_layers=2)), load_system(small_system(4, 2)))
    tighter = 0
    cands = list(llm_candidates(model, Knobs(micro_batch=1, sequence_parallel=True)))
    assert {c.zero_stage for c in cands} >= {0, 1, 2, 3} and any(c.ep > 1 for c in cands)
    for m in cands[::3]:
        ev = model.evaluate(m)
        floor = model.memory_floor_bytes(m)
        assert floor <= ev.memory.total_bytes * (1 + 1e-12)
        _, layer, experts, dense = model._param_counts
        per_layer = mem.memory_lower_bound_bytes(
            num_layers=model.num_layers, params_per_layer=min(layer - experts * (1 - 1 / m.ep), dense),
            seq_len=model.model.seq_len // m.cp, micro_batch=m.micro_batch, hidden=model.model.hidden, tp=m.tp,
            pp=m.pp, dp=m.dp_cp, num_micro_batches=m.num_micro_batches,
            zero_stage=m.zero_stage if m.zero_stage >= 2 else None, bytes_per_element=model.precision.bytes)
        tighter += floor > per_layer * (1 + 1e-9)
    assert tighter > 0


def test_deepseek_v3_that_cannot_fit_is_proven_infeasible_at_once():
    """671B parameters' state on 32 chips of 44.7 GiB: the mean-stage floor rules every degree
    tuple out before any block is solved (it timed out before: the per-layer floor took every
    layer at the size of DeepSeek-V3's 3 dense layers)."""
    from dfmodel.errors import InfeasibleError

    t0 = time.process_time()
    with pytest.raises(InfeasibleError, match="no mapping fits in memory"):
        optimize("deepseek_v3", "pcie_ddr", time_limit_s=30)
    assert time.process_time() - t0 < 10


def test_a_finished_search_keeps_no_model_alive():
    """A design-space sweep runs thousands of searches in one process (a notebook, the sweep
    runner, bench_matrix): a model and its memos must die with its search. A method-level
    functools.lru_cache on LLMModel once kept every model alive (its cache is the class's)."""
    import gc

    from dfmodel import optimize
    from dfmodel.inter_chip.llm import LLMModel

    for workload, system, chips in (("gpt3_13b", "dgx_a100", 64), ("mixtral_8x7b", "dgx_h100", None)):
        optimize(workload, system, num_chips=chips, workers=1)
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, LLMModel)] == []


def _why_not_reference(events, open_heaps, best_s):
    """The why-not tables and ruled-out counts straight from the events (the oracle)."""
    best, bound, out, need, counts = {}, {}, {}, {}, {}
    for items, kind, value, need_bytes, n in events:
        if kind == "evaluated":
            for kv in items:
                best[kv] = min(best.get(kv, float("inf")), value)
            continue
        if value < best_s:
            counts[kind] = counts.get(kind, 0) + n
        for kv in items:
            out.setdefault(kv, {})[kind] = out.setdefault(kv, {}).get(kind, 0) + n
            if need_bytes is not None:
                need[kv] = min(need.get(kv, float("inf")), need_bytes)
    for heap in open_heaps:
        for b, knobs in heap:
            for kv in knobs:
                bound[kv] = min(bound.get(kv, float("inf")), b)
    return best, bound, out, need, counts


def test_folded_why_not_tables_merge_to_the_event_by_event_answer():
    """Workers send their why-not record folded per knob value (KnobTables) and the parent merges
    them: random ledgers split over 1-3 workers give exactly the tables, ruled-out counts and
    why-not rows of the whole event list computed one event at a time."""
    import random

    from dfmodel.inter_chip.search import KnobTables, _Ledger
    from dfmodel.inter_chip.space import SpaceNode

    rng = random.Random(5)
    for _ in range(30):
        events, heaps = [], []
        for _ in range(rng.randint(0, 60)):
            knobs = tuple((k, rng.choice([1, 2, 4, 8])) for k in ("tp", "pp", "dp") if rng.random() < 0.8)
            kind = rng.choice(["evaluated", "memory", "infeasible", "bound"])
            need = rng.uniform(1, 9) if kind == "memory" and rng.random() < 0.7 else None
            events.append((knobs, kind, rng.uniform(1, 10), need, rng.randint(1, 5)))
        for _ in range(rng.randint(0, 3)):
            heaps.append([(rng.uniform(1, 10), tuple((k, rng.choice([1, 2, 4])) for k in ("tp", "dp")))
                          for _ in range(rng.randint(0, 5))])
        best_s = rng.uniform(2, 8)
        workers = rng.randint(1, 3)
        merged = KnobTables()
        for w in range(workers):
            ledger = _Ledger()
            ledger.events = events[w::workers]
            ledger.open = [[(b, 0, True, SpaceNode(b, 0.0, 0, knobs, None)) for b, knobs in heap]
                           for heap in heaps[w::workers]]
            merged.merge(ledger.tables())
        best, bound, out, need, counts = _why_not_reference(events, heaps, best_s)
        assert (merged.best, merged.bound, merged.out, merged.need) == (best, bound, out, need)
        assert merged.ruled_out_counts(best_s) == counts
        whole = _Ledger()
        whole.events = events
        whole.open = [[(b, 0, True, SpaceNode(b, 0.0, 0, knobs, None)) for b, knobs in heap] for heap in heaps]
        winner = type("W", (), {})()
        winner.tp, winner.pp, winner.dp = 1, 1, 1
        assert merged.why_not(winner, best_s) == whole.why_not(winner, best_s)


def test_full_gc_paused_during_a_search_and_restored_after_even_on_error():
    """While a search runs only the young generations are collected (the oldest generation's
    threshold is raised); the thresholds are restored when it returns or raises."""
    import gc

    from dfmodel.inter_chip.search import FULL_GC_PAUSED_THRESHOLD

    model = LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2)))
    before = gc.get_threshold()
    seen = []

    def candidates():
        for m in llm_candidates(model, Knobs(tp=2, micro_batch=1)):
            seen.append(gc.get_threshold())
            yield m

    best, _ = search(model, candidates())
    assert best is not None and seen
    assert all(t == (before[0], before[1], FULL_GC_PAUSED_THRESHOLD) for t in seen)
    assert gc.get_threshold() == before

    def failing():
        yield from ()
        raise RuntimeError("enumeration failed")

    with pytest.raises(RuntimeError):
        search(model, failing())
    assert gc.get_threshold() == before


class _ScreenedModel:
    """A model of eight mappings (times 1..8, bounds 0.5 below or as given), whose evaluate returns None
    when its time is above the cutoff it is given, as LLMModel's screens do; each evaluation of
    ``slow`` (one at time 2, a runner-up) sleeps ``sleep_s`` when it is not screened."""

    evaluate_accepts_cutoff = True
    time_limit_s = None

    def __init__(self, slow: int | None = None, sleep_s: float = 0.0, bounds: dict | None = None):
        from types import SimpleNamespace

        self.system = SimpleNamespace(chip=SimpleNamespace(memory=SimpleNamespace(capacity_bytes=1.0)))
        self.times = {m: float(m) for m in range(1, 9)}
        self.bounds = {m: t - 0.5 for m, t in self.times.items()} | (bounds or {})
        self.slow, self.sleep_s, self.calls = slow, sleep_s, []

    def memory_floor_bytes(self, m) -> float:
        return 0.0

    def lower_bound_s(self, m) -> float:
        return self.bounds[m]

    def refined_bound_s(self, m):
        return None

    def evaluate(self, m, cutoff_s=None, screen_memory=False):
        from types import SimpleNamespace

        self.calls.append((m, cutoff_s))
        t = self.times[m]
        if cutoff_s is not None and t > cutoff_s:
            return None
        if m == self.slow:
            time.sleep(self.sleep_s)
        return SimpleNamespace(iteration_time_s=t, fits=True, proven_optimal=True, mapping=_Picked(m),
                               breakdown_s={"compute": t})


class _Picked(int):
    """An int mapping the ledger can fold (its knobs: its value)."""

    def __init__(self, v):
        self.value = int(v)


def test_runners_up_wait_until_the_winner_is_proven_and_stay_exact():
    """With runners-up asked for, a candidate is screened against the best time first. Bounds
    2: 0.6, 3: 0.7, 1: 0.9 (weak ones). Mapping 3, reached when the best is 2, is proven slower
    than it and waits behind mapping 1 (bound 0.9); once every bound below the best (now 1) is
    closed it is evaluated against the 3rd-best cutoff and listed. The answer is exhaustive
    enumeration's (winner 1, then 2 and 3); bounds past the 3rd best are never evaluated."""
    from dfmodel.inter_chip.search import _search

    model = _ScreenedModel(bounds={2: 0.6, 3: 0.7, 1: 0.9})
    best, stats = _search(model, [_Picked(m) for m in (3, 1, 2, 5, 4, 8, 7, 6)], exhaustive=False, keep=3,
                          progress=None)
    assert best.iteration_time_s == 1.0 and [e.iteration_time_s for e in stats.runners_up] == [2.0, 3.0]
    assert stats.status == "optimal" and stats.gap == 0.0
    margin = 1 + 1e-9  # (_evaluate_below's: ties are kept)
    assert [(int(m), c) for m, c in model.calls] == [(2, None), (3, 2.0 * margin), (1, 2.0 * margin), (3, None)]


class _ProvingModel(_ScreenedModel):
    """:class:`_ScreenedModel` whose screen proves the mapping's exact time (``proven_bound_s``,
    as ``LLMModel.evaluate`` keeps the bound that proved it past the cutoff)."""

    proven_bound_s = None

    def evaluate(self, m, cutoff_s=None, screen_memory=False):
        ev = super().evaluate(m, cutoff_s, screen_memory)
        self.proven_bound_s = self.times[m] if ev is None else None
        return ev


def test_a_mapping_screened_against_the_best_waits_at_its_proven_bound():
    """Keep 3, bounds 2: 0.6, 4: 0.7, 1: 0.9 (the others 0.5 below their times). Mapping 4,
    reached when the best is 2, is proven past it by a bound of 4 (its time): it waits at 4,
    not at the best, so mapping 3 (proven past the best 1, waiting at 3) is confirmed first and
    the 3rd-best cutoff (3) prunes mapping 4 without a second evaluation. Queued at the best,
    mapping 4 was evaluated again and listed until mapping 3 displaced it: calls 2, 4, 1, 4, 3, 3."""
    from dfmodel.inter_chip.search import _search

    model = _ProvingModel(bounds={2: 0.6, 4: 0.7, 1: 0.9})
    best, stats = _search(model, [_Picked(m) for m in (4, 3, 1, 2, 5, 8, 7, 6)], exhaustive=False, keep=3,
                          progress=None)
    assert best.iteration_time_s == 1.0 and [e.iteration_time_s for e in stats.runners_up] == [2.0, 3.0]
    assert stats.status == "optimal"
    assert [int(m) for m, _ in model.calls] == [2, 4, 1, 3, 3]


def test_a_limit_that_cuts_the_runners_up_after_the_proof_leaves_the_winner_proven():
    """The deadline passes while a runner-up (mapping 3, a 1.5 s evaluation) is confirmed, after
    the winner's proof: the status is optimal, with a note that the runners-up listed may not be
    the next best. Screened against the 3rd-best time throughout (as before), mapping 3 was
    evaluated whole before mapping 1, and the cut search returned 2 at a 55 % gap."""
    from dfmodel.inter_chip.search import _search

    model = _ScreenedModel(slow=3, sleep_s=1.5, bounds={2: 0.6, 3: 0.7, 1: 0.9})
    with deadline_scope(1.0):
        best, stats = _search(model, [_Picked(m) for m in range(1, 9)], exhaustive=False, keep=3, progress=None,
                              limit_s=1.0)
    assert best.iteration_time_s == 1.0
    assert stats.status == "optimal" and stats.gap == 0.0 and stats.lower_bound_s == 1.0
    assert any("runners-up listed may not be the next best" in n for n in stats.notes)


class _MovedSplitModel(_ScreenedModel):
    """Mapping 3 fits only with its layers moved off the balanced split (``split_moved``, 3 s);
    offloaded, its balanced split fits and runs in 2 s: mapping 9, one of its relief twins."""

    def __init__(self):
        super().__init__()
        self.times |= {1: 5.0, 2: 6.0, 9: 2.0}
        self.bounds = {m: 1.0 for m in self.times}

    def memory_relief(self, m):
        return [_Picked(9)] if m == 3 else []

    def evaluate(self, m, cutoff_s=None, screen_memory=False):
        ev = super().evaluate(m, cutoff_s, screen_memory)
        if ev is not None:
            ev.split_moved = m == 3
        return ev


@pytest.mark.parametrize("exhaustive", [False, True])
def test_a_mapping_whose_split_was_moved_for_memory_brings_its_offloaded_twins(exhaustive):
    """Offloaded twins join the search only for mappings that do not fit; one that fits only with
    its layers moved off the time-balanced split counts as such (LLMModel.evaluate's
    ``split_moved``): its twin, faster, wins."""
    from dfmodel.inter_chip.search import _search

    best, stats = _search(_MovedSplitModel(), [_Picked(m) for m in range(1, 9)], exhaustive=exhaustive, keep=1,
                          progress=None)
    assert int(best.mapping) == 9 and best.iteration_time_s == 2.0
