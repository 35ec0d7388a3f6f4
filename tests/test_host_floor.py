"""The host-memory floor of offloaded mappings (dfmodel.inter_chip.host_floor): below the host
bytes every evaluation charges (exhaustive over small spaces, dense and MoE, every ZeRO stage and
offload combination), tight for a dense model, and the search that drops twins it rules out
still equals exhaustive evaluation, or proves that nothing fits."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.errors import InfeasibleError
from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.host_floor import host_floor_bytes, host_share_bytes
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.llm_space import llm_candidates
from tests.test_inter_chip import SMALL_LLM, small_system
from tests.test_offload import with_host

MOE = {"num_experts": 8, "top_k": 2, "expert_ffn_hidden": 64, "num_shared_experts": 1}

def offloads(modes=("host", "delayed")):
    return [(o, a, wt) for o in modes for a in (False, True) for wt in (False, True)]


def small_moe() -> dict:
    w = copy.deepcopy(SMALL_LLM)
    w["name"] = "small_moe"
    w["model"]["moe"] = MOE
    return w


def offloaded(model, modes=("host", "delayed")):
    """Every candidate of the free space with every valid optimizer/weight offload (the oracle;
    the free search uses ``delayed`` only when the user fixes it)."""
    for m in llm_candidates(model, Knobs()):
        for o, a, wt in offloads(modes):
            v = dataclasses.replace(m, offload_optimizer=o, offload_activations=a, offload_weights=wt)
            if off.valid(v):
                yield v


@pytest.mark.parametrize("workload", [SMALL_LLM, small_moe()], ids=["dense", "moe"])
def test_host_floor_is_below_every_evaluated_host_bytes(workload):
    w = load_workload(workload)
    s = load_system(with_host(small_system(2, 2), capacity_bytes="64 GB"))
    model = LLMModel(w, s)
    seen, tightest = 0, 0.0
    for v in list(offloaded(model))[::3]:
        host = model.evaluate(v).memory.host_bytes
        floor = host_floor_bytes(model, v)
        assert 0 < floor <= host * (1 + 1e-12), v
        tightest = max(tightest, floor / host)
        seen += 1
    assert seen >= 50
    if "moe" not in workload["model"]:
        # dense, pp 1, no activation offload: the floor is the host's bytes exactly (up to the
        # norms TP replicates), so it is no loose bound
        assert tightest > 0.95


def test_no_host_floor_without_offloaded_state():
    model = LLMModel(load_workload(SMALL_LLM), load_system(with_host(small_system(2, 2))))
    m = next(iter(llm_candidates(model, Knobs())))
    assert host_floor_bytes(model, m) == 0.0
    assert host_floor_bytes(model, dataclasses.replace(m, offload_activations=True)) == 0.0


def _host_for(floor_bytes: float, sharing: int) -> dict:
    return {"capacity_bytes": f"{floor_bytes * sharing:.0f} B"}


@pytest.mark.parametrize("fraction", [0.8, 1.05, 1.6])
def test_search_with_a_tight_host_equals_exhaustive(fraction):
    """Host sized around the least offloaded floor: some twins dropped, maybe all; the search
    equals the best fitting evaluation over every variant, or raises when none fits."""
    w = load_workload(SMALL_LLM)
    tight = small_system(2, 2, capacity="0.2 GiB")  # nothing fits without offload
    probe = LLMModel(w, load_system(with_host(tight, capacity_bytes="64 GB")))
    least = min(host_floor_bytes(probe, v) for v in offloaded(probe))
    s = load_system(with_host(tight, **_host_for(fraction * least, 4)))
    model = LLMModel(w, s)
    assert host_share_bytes(s) == pytest.approx(fraction * least, rel=1e-9)
    fitting = [e.iteration_time_s for e in map(model.evaluate, offloaded(model, ("none", "host"))) if e.fits]
    fitting += [e.iteration_time_s for e in map(model.evaluate, llm_candidates(model, Knobs())) if e.fits]
    if not fitting:
        with pytest.raises(InfeasibleError, match="host memory per chip"):
            solve_llm(w, s, Knobs())
        return
    r = solve_llm(w, s, Knobs())
    assert r.iteration_time_s == pytest.approx(min(fitting), rel=1e-12)
    assert r.solver.status == "optimal"


def test_gpt3_1t_on_64_h100_is_proven_infeasible_for_the_host():
    """GPT-3 1T on 64 H100: 16 bytes of optimizer state and fp32 gradients per parameter,
    1.007e12 / 64 parameters per chip = 234.7 GiB of host per chip against a 216.8 GiB share
    (2 TB - 128 GiB reserve over 8 GPUs): infeasible, said in one line."""
    with pytest.raises(InfeasibleError) as exc:
        optimize("gpt3_1t", "dgx_h100", num_chips=64, time_limit_s=10, workers=1)
    msg = str(exc.value)
    assert "needs at least 234.7 GiB of host memory per chip" in msg and "216.8 GiB" in msg


# -- the leaf screen: host bytes of activation offload --------------------------------------------


#: activations dominate the state (16K tokens, hidden 512): activation offload is what fits
LONG = {**SMALL_LLM, "name": "long", "model": {**SMALL_LLM["model"], "hidden": 512, "num_heads": 8, "seq_len": 16384},
        "training": {**SMALL_LLM["training"], "global_batch": 8}}
CHIP = small_system(2, 2, capacity="0.3 GiB")  # nothing fits without the optimizer on the host


@pytest.mark.parametrize("name,per_node,nodes", [("small", 4, 2), ("long", 2, 2)])
def test_leaf_host_screen_is_below_every_evaluated_host_bytes(name, per_node, nodes):
    """``memory_before_blocks``' host bytes (what the leaf groups' host screen reads) against
    every offloaded mapping's evaluation, pp > 1 and activation offload included."""
    w = load_workload(SMALL_LLM if name == "small" else LONG)
    s = load_system(with_host(small_system(per_node, nodes), capacity_bytes="64 GB"))
    model = LLMModel(w, s)
    seen = 0
    for v in offloaded(model, ("none", "host")):
        if not off.uses_offload(v):
            continue
        host = model.evaluate(v).memory.host_bytes
        assert LLMModel(w, s).memory_before_blocks(v).host_bytes <= host * (1 + 1e-12), v
        seen += 1
    assert seen >= 200


@pytest.fixture(scope="module")
def long_oracle():
    """(time, chip bytes, host bytes) of every mapping of LONG on CHIP, offloaded or not; the
    host's size changes none of them, only whether they fit."""
    w = load_workload(LONG)
    model = LLMModel(w, load_system(with_host(CHIP, capacity_bytes="64 GB")))
    out = []
    for m in list(llm_candidates(model, Knobs())) + list(offloaded(model, ("none", "host"))):
        try:
            e = model.evaluate(m)
        except InfeasibleError:  # an inner pass cannot fit the chip's DRAM: no time
            continue
        out.append((e.iteration_time_s, e.memory.total_bytes,
                    e.memory.host_bytes if e.memory.host_capacity_bytes else 0.0))
    return out


@pytest.mark.parametrize("quantile", [0.0, 0.1, 0.5])
def test_search_with_an_activation_bound_host_equals_exhaustive(long_oracle, quantile, monkeypatch):
    """A host sized at quantiles of what the chip-fitting offloaded mappings move: leaf groups
    are pruned by their host screen (counted), and the search finds the oracle's best."""
    from dfmodel.inter_chip import llm_space

    capacity = 0.3 * 2**30
    moved = sorted(h for _, chip, h in long_oracle if chip <= capacity and h > 0)
    share = moved[int(quantile * (len(moved) - 1))] * (1 + 1e-9)
    best = min(t for t, chip, h in long_oracle if chip <= capacity and h <= share)
    s = load_system(with_host(CHIP, capacity_bytes=f"{share * 4:.0f} B"))
    screened = []
    real = llm_space.LLMSpace._host_screen
    monkeypatch.setattr(llm_space.LLMSpace, "_host_screen", lambda self, *a: screened.append(real(self, *a))
                        or screened[-1])
    r = solve_llm(load_workload(LONG), s, Knobs())
    assert r.iteration_time_s == pytest.approx(best, rel=1e-12)
    assert r.solver.status == "optimal"
    assert False in screened  # some leaf group was pruned by its host floor
