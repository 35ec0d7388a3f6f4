"""One family interface: every kind in the registry implements it, its bound is valid, its
solve is the search over its candidates; the pure algorithms against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from dfmodel import algorithms as alg
from dfmodel import load_workload
from dfmodel.errors import InfeasibleError, InputError
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.family_api import Family, SearchModel
from dfmodel.inter_chip.registry import FAMILIES, family_for
from dfmodel.inter_chip.search import search
from tests.test_families import DLRM, FFT, HPL, SYSTEMS, system
from tests.test_graph_family import TINY_MLP
from tests.test_inter_chip import SMALL_LLM, small_system

CASES = {
    "llm": (SMALL_LLM, lambda: __import__("dfmodel").load_system(small_system(4, 2))),
    "dlrm": (DLRM, lambda: system(SYSTEMS["switch4x2"])),
    "hpl": (HPL, lambda: system(SYSTEMS["switch4x2"])),
    "fft": (FFT, lambda: system(SYSTEMS["switch4x2"])),
    "graph": (TINY_MLP, lambda: system(SYSTEMS["switch4x2"])),
}


def test_registry_covers_every_kind_and_rejects_others():
    assert set(FAMILIES) == set(CASES)
    for kind, fam in FAMILIES.items():
        assert isinstance(fam, Family) and fam.kind == kind
    with pytest.raises(InputError, match="kinds: dlrm, fft, graph, hpl, llm"):
        family_for("cnn")


@pytest.mark.parametrize("kind", sorted(CASES))
def test_interface_bound_is_valid_and_solve_is_the_search(kind):
    spec, make_system = CASES[kind]
    fam, w, s = family_for(kind), load_workload(spec), make_system()
    model = fam.model(w, s)
    assert isinstance(model, SearchModel)
    cands = list(fam.candidates(model, Knobs()))
    assert cands
    best_time = float("inf")
    for m in cands[:: max(1, len(cands) // 40)]:
        try:
            ev = fam.evaluate(model, m)
        except InfeasibleError:  # an inner pass with nothing that fits: no time to compare
            continue
        assert fam.lower_bound_s(model, m) <= ev.iteration_time_s * (1 + 1e-9)
        if ev.fits:
            best_time = min(best_time, ev.iteration_time_s)
    best, stats = search(model, fam.candidates(model, Knobs()))
    r = fam.result(model, best, stats)
    assert r.iteration_time_s == best.iteration_time_s <= best_time
    solved = fam.solve(w, s, Knobs())
    assert solved.iteration_time_s == pytest.approx(best.iteration_time_s, rel=1e-12)


def test_ideal_masks_equal_brute_force_down_sets():
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 8)
        preds = [sum(1 << j for j in range(k) if rng.random() < 0.3) for k in range(n)]
        brute = {m for m in range(1 << n) if all(not (m >> k) & 1 or not (preds[k] & ~m) for k in range(n))}
        assert alg.ideal_masks(n, preds) == brute
        assert alg.enumerate_ideals(n, preds) == sorted(brute, key=lambda m: (m.bit_count(), m))


def test_min_max_chain_equals_brute_force_on_chains():
    rng = random.Random(5)
    for _ in range(15):
        n, pp = rng.randint(2, 7), rng.randint(2, 4)
        w = [rng.uniform(0.1, 3.0) for _ in range(n)]
        preds = [0] + [1 << (k - 1) for k in range(1, n)]  # a chain: stages are contiguous runs
        cost = lambda mask: sum(w[k] for k in range(n) if (mask >> k) & 1)  # noqa: E731
        got = alg.min_max_chain(n, preds, pp, cost).value
        best = min(
            max(sum(w[a:b]) for a, b in zip((0,) + cuts, cuts + (n,)))
            for r in range(0, pp) for cuts in itertools.combinations(range(1, n), r)
        )
        assert got == pytest.approx(best)


def test_balance_layers_equals_brute_force():
    rng = random.Random(7)
    for _ in range(30):
        L, pp = rng.randint(2, 9), rng.randint(1, 4)
        if pp > L:
            continue
        first, last = rng.uniform(0, 3), rng.uniform(0, 3)
        counts = alg.balance_layers(L, pp, 1, 1.0, first, last)
        assert sum(counts) == L and min(counts) >= 1

        def worst(c):
            t = [float(x) for x in c]
            t[0] += first
            t[-1] += last
            return max(t)

        brute = min(worst(c) for c in itertools.product(range(1, L + 1), repeat=pp) if sum(c) == L)
        assert worst(counts) == pytest.approx(brute)


def test_pareto_front_equals_brute_force():
    rng = random.Random(11)
    pts = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(40)]
    front = set(alg.pareto_front(pts))
    for i, q in enumerate(pts):
        dominated = any(p[0] <= q[0] and p[1] >= q[1] and p != q for p in pts)
        assert (i in front) == (not dominated)


def test_old_names_still_work():
    from dfmodel.graph.workload import LLMArchitecture, LLMModel
    from dfmodel.inter_chip.families import solve_family  # noqa: F401
    from dfmodel.inter_chip.pipeline import balance_layers
    from dfmodel.plots import pareto_front

    assert LLMModel is LLMArchitecture and balance_layers is alg.balance_layers and pareto_front is alg.pareto_front
