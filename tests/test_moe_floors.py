"""Memory floors and the parallel split of the offloaded twins (issue 12, DeepSeek-V3 on 64 GPUs).

Oracles: every group floor and the activation floor stay below the pre-solve screen and the
evaluated memory of every mapping of small MoE spaces (dense layers, offload, pipelines); the
parallel search deals the offloaded twins to its workers when no root fits on the chip and
still gives the serial answer."""

from __future__ import annotations

import dataclasses

import pytest

from dfmodel import load_system, load_workload, optimize
from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip import parallel_search as ps
from dfmodel.inter_chip.config import Knobs, Mapping
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_space import LLMSpace, llm_candidates
from dfmodel.parallel import fork_available
from test_inter_chip import small_system
from test_moe_physics import moe_workload
from test_offload import with_host

TOL = 1 + 1e-12


def _moe_model(capacity: str | None = None) -> LLMModel:
    system = with_host(small_system(4, 2, **({"capacity": capacity} if capacity else {})))
    return LLMModel(load_workload(moe_workload(first_dense_layers=1)), load_system(system))


@pytest.mark.parametrize("mb", [1, 2])
def test_activation_floor_is_below_the_screen_and_every_evaluation(mb):
    """Every mapping of a small MoE space with a dense layer (and each one's offloaded twins):
    activation floor <= pre-solve screen <= evaluated memory; the floor is tighter than the
    recompute-blind memory floor somewhere (else it would prune nothing)."""
    model = _moe_model()
    checked = tighter = offloaded = 0
    for m in llm_candidates(model, Knobs(micro_batch=mb)):
        for x in [m] + off.variants(m, Knobs(micro_batch=mb), model.system)[:3]:
            act = model.activation_floor_bytes(x)
            screen = model.memory_before_blocks(x).total_bytes
            ev = model.evaluate(x)
            assert act <= screen * TOL and act <= ev.memory.total_bytes * TOL, (x, act, screen)
            assert model.leaf_floor_bytes(x) <= ev.memory.total_bytes * TOL
            for rc in ("none", "selective", "full"):  # a group's least over recompute choices
                assert model.activation_floor_bytes(x, rc) == model.activation_floor_bytes(
                    dataclasses.replace(x, recompute=rc))
            tighter += act > model.memory_floor_bytes(x) * (1 + 1e-9)
            offloaded += x is not m
            checked += 1
    assert checked > 50 and tighter > 0 and offloaded > 0


def test_group_floors_of_offloaded_twins_are_below_their_mappings():
    """When no root fits on the chip, the twins' groups (the whole search then) carry floors
    below each of their mappings' screens, and each child's floor is at least its parent's."""
    model = _moe_model()
    space = LLMSpace(model, Knobs(micro_batch=1))
    space.roots()
    twins = [t for r in space.roots_built if r.relief is not None and (t := r.relief()) is not None]
    assert twins
    seen = 0

    def walk(node):
        nonlocal seen
        for kid in node.expand():
            if node.leaf:
                assert node.floor_bytes <= model.memory_before_blocks(kid).total_bytes * TOL, kid
                assert node.floor_bytes == model.leaf_floor_bytes(kid)
                seen += 1
            else:
                assert kid.floor_bytes >= node.floor_bytes * (1 - 1e-12)
                walk(kid)

    for t in twins[:6]:
        walk(t)
    assert seen > 20


def test_activation_floor_rules_out_deepseek_v3_groups_the_old_floor_kept():
    """DeepSeek-V3 on 64 H100s (the case that motivated it): TP 2, PP 4, mb 8 without
    recomputation saves ~16 layers of activations, beyond 80 GiB whatever else is offloaded,
    which the recompute-blind floor cannot see; full recomputation keeps it below."""
    model = LLMModel(load_workload("deepseek_v3"), load_system("dgx_h100", num_chips=64))
    cap = model.system.chip.memory.capacity_bytes
    m = Mapping(2, 4, 8, 8, 240, 1, "none", True, zero_stage=3, ep=16, offload_optimizer="host", offload_weights=True)
    assert model.memory_floor_bytes(m) < cap < model.activation_floor_bytes(m)
    assert model.activation_floor_bytes(m) <= model.memory_before_blocks(m).total_bytes
    assert model.activation_floor_bytes(m, "full") < cap


@pytest.mark.skipif(not fork_available(), reason="parallel search needs the fork start method")
def test_twins_are_dealt_to_the_workers_when_nothing_fits_on_the_chip():
    """No root fits without offload: the twins are the roots the workers share (two classes or
    more, so both work), and two workers give the serial answer."""
    model = _moe_model()
    space = LLMSpace(model, Knobs(micro_batch=1))
    roots = space.roots()
    cap = min(r.floor_bytes for r in roots) * 0.999
    fits = [r.floor_bytes <= cap for r in roots]
    assert not any(fits)
    twins, twin_of = ps._relief_twins(roots, fits, cap)
    assert twins and set(twin_of.values()) == set(range(len(roots), len(roots) + len(twins)))
    assert ps._homes(roots + twins, fits + [True] * len(twins))[1] >= 2
    system = with_host(small_system(4, 2, capacity=f"{cap / 2**30:.6f} GiB"))
    w = moe_workload(first_dense_layers=1)
    serial = optimize(w, system, workers=1, micro_batch=1, alternatives=2)
    par = optimize(w, system, workers=2, micro_batch=1, alternatives=2)
    assert (par.iteration_time_s, vars(par.parallelism)) == (serial.iteration_time_s, vars(serial.parallelism))
    assert [a["iteration_time_s"] for a in par.alternatives] == [a["iteration_time_s"] for a in serial.alternatives]
    assert serial.solver.status == par.solver.status == "optimal"
    assert serial.parallelism.offload_optimizer != "none" or serial.parallelism.offload_weights


def _micro_batch_floor_as_first_written(space, deg, mb, m, rcs, keys, sps) -> float:
    """``LLMSpace._micro_batch_floor_bytes`` as first written: the activation floor per option key."""
    model, out = space.model, float("inf")
    for key in dict.fromkeys(k[:5] + (False,) for k in keys):
        probes = [space._probe(deg, mb, m, 1, rcs[0], key, sp) for sp in sps]
        acts = min(model.activation_floor_bytes(p, rc) for p in probes for rc in rcs)
        out = min(out, max(model.memory_floor_bytes(probes[0]), acts))
    return out


@pytest.mark.parametrize("capacity", [None, "8 GB"])
def test_micro_batch_floor_takes_the_activation_floor_once_per_offload(monkeypatch, capacity):
    """A micro-batch group's memory floor computes the activation floor once per offload choice
    (it reads no other option): the same value as per option key, on the groups of a small MoE
    space with offloaded twins (offload on and off among the keys)."""
    model = _moe_model(capacity)
    space = LLMSpace(model, Knobs(micro_batch=1))
    real = LLMSpace._micro_batch_floor_bytes
    seen = []

    def checked(self, deg, mb, m, rcs, keys, sps):
        got = real(self, deg, mb, m, rcs, keys, sps)
        assert got == _micro_batch_floor_as_first_written(self, deg, mb, m, rcs, keys, sps)
        seen.append(len({k[3] for k in keys}))
        return got

    monkeypatch.setattr(LLMSpace, "_micro_batch_floor_bytes", checked)
    roots = list(space.roots())
    roots += [t for r in roots if r.relief is not None and (t := r.relief()) is not None]
    for root in roots:
        for group in root.expand():
            if group.screen is not None:
                group.screen()
    assert seen and max(seen) == 2  # (groups whose option keys offload activations and keep them)


def test_split_free_activation_floor_holds_for_every_split_and_beats_the_pigeonhole():
    """The split-free floor (LLMModel._split_free_activation_bytes): at most the evaluated
    memory of every pipelined mapping of a small dense and a small MoE space (whatever split
    evaluate takes), tighter than the ceil(L / pp) floor on some of them, and its closed form
    on DeepSeek-V3 at pp 4: reserve + max(61 a, 58 a_moe) / (1/4 + 1/3 + 1/2 + 1), ``a`` the
    lighter of its layers' activations, ``a_moe`` an MoE layer's."""
    from test_inter_chip import SMALL_LLM

    tighter = 0
    for model in (LLMModel(load_workload(SMALL_LLM), load_system(small_system(4, 2))), _moe_model()):
        checked = 0
        for m in llm_candidates(model, Knobs()):
            if m.pp == 1 or m.offload_activations:
                continue
            free = model._split_free_activation_bytes(m, m.recompute)
            ev = model.evaluate(m)
            assert free <= ev.memory.total_bytes * TOL, m
            assert model.memory_before_blocks(m).total_bytes >= free  # the screen carries it
            reserve = float(model.system.chip.memory.reserve_bytes)
            old = model._layer_act_bytes(m.tp, m.cp, m.micro_batch, m.sequence_parallel, m.recompute)
            tighter += free > reserve + -(-model.num_layers // m.pp) * old * (1 + 1e-9) and model.num_dense_layers == 0
            checked += 1
        assert checked > 10
    assert tighter > 0
    ds = LLMModel(load_workload("deepseek_v3"), load_system("dgx_h100", num_chips=64))
    m = Mapping(2, 4, 8, 1, 240, 1, "none", True, zero_stage=3, ep=16)
    moe = ds._layer_act_bytes(2, 1, 1, True, "none")
    a = min(moe, ds._layer_act_bytes(2, 1, 1, True, "none", dense=True))
    reserve = float(ds.system.chip.memory.reserve_bytes)
    expected = reserve + max(61 * a, 58 * moe) / (1 / 4 + 1 / 3 + 1 / 2 + 1)
    assert ds._split_free_activation_bytes(m, "none") == pytest.approx(expected, rel=1e-9)
    # the pigeonhole floor: ceil(61 / 4) = 16 layers (15 MoE) at one micro-batch
    assert ds.activation_floor_bytes(m) > reserve + max(16 * a, 15 * moe) * 1.5
