"""Cheaper proofs of the MoE search (issue 12, DeepSeek-V3 on GPUs), each checked against the
exact computation it shortcuts.

Oracles: the early-exit memory screen (``LLMModel.screen_bytes``) decides "fits" exactly as the
full pre-solve screen does, at every capacity between the least and the largest screen, and
returns the full screen whenever it does not fit; the search's answer over a small MoE space is
the exhaustive one."""

from __future__ import annotations

import dataclasses

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import DFModelError
from dfmodel.inter_chip import offload as off
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_space import LLMSpace, llm_candidates, mappings_under
from dfmodel.inter_chip.search import search
from test_inter_chip import small_system
from test_moe_physics import moe_workload
from test_offload import with_host
from test_search_space import inner_groups


def _model(first_dense_layers: int = 1, capacity: str | None = None) -> LLMModel:
    system = with_host(small_system(4, 2, **({"capacity": capacity} if capacity else {})))
    return LLMModel(load_workload(moe_workload(first_dense_layers=first_dense_layers)), load_system(system))


def _probes(model, mb):
    """Every mapping of a small MoE space (placement aside) and a few offloaded twins."""
    seen = {}
    for m in llm_candidates(model, Knobs(micro_batch=mb)):
        for x in [m] + off.variants(m, Knobs(micro_batch=mb), model.system)[:2]:
            seen.setdefault(dataclasses.replace(x, placement=()), x)
    return list(seen.values())


@pytest.mark.parametrize("dense", [0, 1])
def test_early_exit_screen_decides_fit_exactly_as_the_full_screen(dense):
    model = _model(first_dense_layers=dense)
    probes = _probes(model, 1) + _probes(model, 2)
    full = [model.memory_before_blocks(x).total_bytes for x in probes]
    # capacities between and around the screens: some fit, some do not, for every probe
    caps = sorted(set(full))
    caps = [caps[0] * 0.99, caps[len(caps) // 4], caps[len(caps) // 2], caps[-1] * 1.01]
    fit_and_not = [0, 0]
    for cap in caps:
        fresh = _model(first_dense_layers=dense)  # no memo shared with the full screens above
        for x, exact in zip(probes, full):
            got = fresh.screen_bytes(x, cap)
            if exact > cap:
                assert got == exact, (x, cap)  # a pruned group reports the exact screen
                fit_and_not[1] += 1
            else:
                assert got <= cap and got >= exact * (1 - 1e-12), (x, cap, got, exact)
                fit_and_not[0] += 1
    assert all(n > 10 for n in fit_and_not), fit_and_not


def test_leaves_without_offload_carry_no_host_screen():
    """The host screen reads host memory only: a leaf that offloads nothing has none."""
    model = _model()
    space = LLMSpace(model, Knobs(micro_batch=1))
    leaves = offl = 0
    stack = list(space.roots())
    while stack:
        node = stack.pop()
        if node.leaf:
            leaves += 1
            offloads = any(off.uses_offload(m) for m in node.expand())
            assert (node.host_screen is not None) == offloads
            offl += offloads
        else:
            stack.extend(node.expand())
            if node.relief is not None and (r := node.relief()) is not None:
                stack.append(r)
    assert leaves > 10 and offl > 0


@pytest.mark.parametrize("capacity", [None, "9 GiB"])
def test_search_equals_exhaustive_on_a_small_moe_space(capacity):
    """Optimum of the branch and bound (screens, relief, bounds) = exhaustive evaluation."""
    model = _model(capacity=capacity)
    knobs = Knobs(micro_batch=1)
    best, _ = search(model, LLMSpace(model, knobs))
    oracle, _ = search(model, llm_candidates(model, knobs), exhaustive=True)
    assert best.iteration_time_s == pytest.approx(oracle.iteration_time_s, rel=1e-12)


def _walk(node, parent_bound, out):
    """Every (group, its parent's bound) below ``node``, relief groups included (refined)."""
    if node.refine is not None:
        node.bound_s, node.refine = max(node.bound_s, node.refine()), None
    out.append((node, parent_bound))
    if node.leaf:
        return
    for child in node.expand():
        _walk(child, node.bound_s, out)
    if node.relief is not None and (r := node.relief()) is not None:
        _walk(r, 0.0, out)  # (a relief group's bound is its own: it holds other mappings)


def test_offloaded_groups_bound_every_leaf_and_evaluation_below_them():
    """Group bounds (with the host-transfer floor of offloaded twins) never exceed a child's
    bound, and a leaf's never exceeds the evaluated time of its mappings; the transfer floor
    raises some offloaded group above the compute floor (else it would prune nothing)."""
    model = _model(capacity="9 GiB")
    space = LLMSpace(model, Knobs(micro_batch=1))
    nodes = []
    for root in space.roots():
        _walk(root, 0.0, nodes)
    offloaded_groups = raised = evaluated = 0
    for node, parent_bound in nodes:
        assert node.bound_s >= parent_bound * (1 - 1e-12), node.knobs
        if node.leaf:
            for m in node.expand()[:2]:
                ev = model.evaluate(m)
                assert ev.iteration_time_s >= node.bound_s * (1 - 1e-12), m
                evaluated += 1
            continue
        probes = [m for m in _leaf_mappings(node)]
        if probes and all(off.uses_offload(m) for m in probes):
            offloaded_groups += 1
            mb = dict(node.knobs).get("micro_batch")
            rc = dict(node.knobs).get("recompute")
            if mb is not None and rc is not None:
                compute = model.compute_floor_s(mb, rc) / (probes[0].tp * probes[0].cp * probes[0].pp)
                raised += min(model.offload_stage_floor_s(m) for m in probes) > compute
    assert evaluated > 20 and offloaded_groups > 0 and raised > 0, (evaluated, offloaded_groups, raised)


def _leaf_mappings(node):
    if node.leaf:
        return node.expand()
    return [m for child in node.expand() for m in _leaf_mappings(child)]


def _relief_subs_of(space):
    """Every twin group (:meth:`LLMSpace._relief_sub`) of the sub groups of ``space``'s roots."""
    out = []
    for _, children in inner_groups(space.roots()):
        for child in children:
            if not child.leaf and dict(child.knobs).get("recompute") is not None and child.relief is not None:
                r = child.relief()
                if r is not None:
                    out.append(r)
    return out


def test_twin_groups_bound_their_children_and_every_evaluation_under_them():
    """A twin group is built lazily: its bound (and its refined bound) is at most each child's
    refined bound and each evaluated mapping's time under it, and it counts exactly the
    mappings under it; some twin group's refined bound rises above its unrefined one."""
    model = _model(capacity="9 GiB")
    space = LLMSpace(model, Knobs(micro_batch=1))
    groups = _relief_subs_of(space)
    assert groups
    raised = evaluated = 0
    for g in groups:
        bound = g.bound_s
        finer = g.refine() if g.refine is not None else bound
        raised += finer > bound * (1 + 1e-9)
        children = g.expand()
        assert g.count == sum(c.count for c in children) > 0
        assert g.floor_bytes <= min(c.floor_bytes for c in children)
        for c in children:
            assert c.refine is None and c.bound_s >= max(bound, finer) * (1 - 1e-12), c.knobs
            for m in _leaf_mappings(c)[:3]:
                ev = model.evaluate(m)
                assert ev.iteration_time_s >= finer * (1 - 1e-12), m
                evaluated += 1
    assert evaluated > 10 and raised > 0, (evaluated, raised)


@pytest.mark.parametrize("capacity", ["224 MiB", "320 MiB"])
def test_evaluate_with_cutoff_reports_exact_memory_of_splits_that_cannot_fit(capacity):
    """evaluate(m, cutoff_s) returns a MemoryFloorMiss exactly when the full evaluation does not
    fit, with the full evaluation's memory (the time-balanced split's, not a floor)."""
    model = _model(capacity=capacity)
    misses = fits = 0
    for m in (_probes(model, 1) + _probes(model, 2))[::23]:  # (some fit, some do not, at either capacity)
        try:
            full = model.evaluate(m)
        except DFModelError as exc:  # an inner pass without a plan raises the same either way
            with pytest.raises(type(exc)):
                model.evaluate(m, cutoff_s=1e9)
            continue
        cut = model.evaluate(m, cutoff_s=1e9)
        assert cut.fits == full.fits
        if full.fits:
            assert cut.iteration_time_s == full.iteration_time_s
            fits += 1
        else:
            assert type(cut).__name__ == "MemoryFloorMiss"
            assert cut.memory.total_bytes == full.memory.total_bytes
            misses += 1
    assert misses > 5 and fits > 5, (misses, fits)


@pytest.mark.parametrize("dense", [0, 1])
def test_last_stage_floor_bounds_every_plain_1f1b_evaluation(dense):
    """The refined bound with the last stage's head, MTP and one layer (LLMModel._last_stage_floor_s)
    stays below the evaluation of every plain-1F1B mapping of a small MoE space, and is above the
    mean-stage bound on some (else it would prune nothing)."""
    model = _model(first_dense_layers=dense)
    seen = raised = 0
    for m in (_probes(model, 1) + _probes(model, 2))[::7]:
        if m.pp == 1 or m.interleave != 1:
            continue
        try:
            ev = model.evaluate(m)
        except DFModelError:  # no plan: nothing to bound
            continue
        bound = model.refined_bound_s(m)
        assert bound <= ev.iteration_time_s * (1 + 1e-12), m
        seen += 1
        key = (m.micro_batch, m.tp, m.group("tp"), m.sequence_parallel)
        layer = model._blocks[("layer", *key, *model._layer_key_tail(m))]
        head = model._blocks[("head", *key)]
        dense_b = model._blocks.get(("dense_layer", *key)) if model.num_dense_layers else None
        last = model._last_stage_floor_s(m, head, sum(model._layer_phases_s(m, layer, model._layer_comm_shared(m, layer))),
                                         dense_b)
        assert last <= max(ev.stage_fwd_s[-1] + ev.stage_bwd_s[-1], 0.0) * (1 + 1e-12), m
        raised += last * m.pp > sum(f + b for f, b in zip(ev.stage_fwd_s, ev.stage_bwd_s))
    assert seen > 20 and raised > 0, (seen, raised)


def _slow_dp_model(first_dense_layers: int, mtp_layers: int) -> LLMModel:
    """The small MoE on a slow inter-node network (ZeRO-3's gathers cost more than a layer's
    kernels there), with dense layers and MTP modules as DeepSeek-V3 has them."""
    system = with_host(small_system(4, 2, ib_bw="2 GB/s"))
    w = moe_workload(first_dense_layers=first_dense_layers, mtp_layers=mtp_layers)
    return LLMModel(load_workload(w), load_system(system))


@pytest.mark.parametrize("dense,mtp", [(0, 0), (1, 1)])
def test_presolve_pipeline_bound_is_below_every_evaluation(dense, mtp):
    """The pre-solve pipeline bound (LLMModel._presolve_pipeline_s: ZeRO-3's collectives of each
    MoE layer on the mapping's own groups, ep 1 included, and plain 1F1B's last stage from
    per-kernel floors) stays below the evaluation of every mapping of a small MoE space (offloaded
    twins included), and rises above the bound it adds to (_own_groups_bound_s) on some ZeRO-3
    mappings and on some pipelines (else it would prune nothing)."""
    model = _slow_dp_model(dense, mtp)
    seen = zero3_raised = last_raised = 0
    for m in (_probes(model, 1) + _probes(model, 2))[::3]:
        try:
            ev = model.evaluate(m)
        except DFModelError:  # no plan: nothing to bound
            continue
        pre = model.presolve_bound_s(m)
        if pre is None:
            continue
        assert pre <= ev.iteration_time_s * (1 + 1e-12), m
        new, old = model._presolve_pipeline_s(m), model._own_groups_bound_s(m)
        seen += 1
        zero3_raised += m.zero_stage == 3 and new > old * (1 + 1e-9)
        last_raised += m.zero_stage != 3 and m.pp > 1 and new > old * (1 + 1e-9)
    # (the last stage's MTP module and head put it above the mean stage; without them it is not)
    assert seen > 50 and zero3_raised > 0 and (last_raised > 0) == (mtp > 0), (seen, zero3_raised, last_raised)


def test_leaf_bounds_hold_where_host_transfers_hide_the_all_to_alls():
    """A layer's host transfers hide behind its whole pass, all-to-alls included, so a stage is at
    least max(work + all-to-alls, transfers), not max(work, transfers) + all-to-alls: with
    activations offloaded over a slow network (the transfers bind) every leaf bound stays below
    its mappings' evaluations, every child's bound above its parent's, and the correction
    (LLMModel.offload_ep_overlap_s) is nonzero somewhere (before it, 24 leaves here were above
    their evaluations)."""
    model = _slow_dp_model(0, 0)
    space = LLMSpace(model, Knobs(micro_batch=2))
    nodes = []
    for root in space.roots():
        _walk(root, 0.0, nodes)
    evaluated = corrected = 0
    for node, parent_bound in nodes:
        assert node.bound_s >= parent_bound * (1 - 1e-12), node.knobs
        if not node.leaf:
            continue
        for m in node.expand()[:1]:
            assert model.evaluate(m).iteration_time_s >= node.bound_s * (1 - 1e-12), m
            evaluated += 1
            corrected += model.offload_ep_overlap_s(m, model.num_moe_layers * model._ep_exposed_floor_s(m) / m.pp) > 0
    assert evaluated > 1000 and corrected > 0, (evaluated, corrected)


def _bounds_by_knobs(space) -> dict:
    """Every group's (refined) bound below ``space``'s roots, keyed by its knobs and kind."""
    nodes = []
    for root in space.roots():
        _walk(root, 0.0, nodes)
    return {(n.knobs, n.leaf, n.count): n.bound_s for n, _ in nodes}


def test_last_stage_floor_of_groups_bounds_every_evaluation_below_them():
    """Plain 1F1B's last stage (the head, the MTP module and a layer: per-kernel floors on the
    cheapest TP group, the cheapest all-to-alls) raises micro-batch, sub and leaf group bounds
    (LLMSpace._last_stage_min_s, LLMModel.last_stage_bound_s) on a small MoE model with an MTP
    module; every child's bound stays above its parent's and every leaf's below each of its
    mappings' evaluations."""
    model = _slow_dp_model(1, 1)
    space = LLMSpace(model, Knobs(micro_batch=1))
    nodes = []
    for root in space.roots():
        _walk(root, 0.0, nodes)
    evaluated = 0
    for node, parent_bound in nodes:
        assert node.bound_s >= parent_bound * (1 - 1e-12), node.knobs
        if node.leaf:
            for m in node.expand()[:2]:
                assert model.evaluate(m).iteration_time_s >= node.bound_s * (1 - 1e-12), m
                evaluated += 1
    plain = LLMSpace(model, Knobs(micro_batch=1))
    plain._last_stage_min_s = lambda *a: 0.0
    plain._last_stage_bound_s = lambda *a: 0.0
    with_last, without = _bounds_by_knobs(space), _bounds_by_knobs(plain)
    raised = {leaf: 0 for leaf in (False, True)}
    for key, bound in with_last.items():
        if key in without:
            assert bound >= without[key] * (1 - 1e-12)
            raised[key[1]] += bound > without[key] * (1 + 1e-9)
    assert evaluated > 500 and raised[False] > 0 and raised[True] > 0, (evaluated, raised)


def test_deferred_group_floors_bound_every_mapping_and_prune_as_before():
    """Micro-batch and sub groups start with their parent's memory floor and take their own
    only in their screen: that floor is >= the start, <= the pre-solve screen of every mapping
    under the group, and a group whose deferred floor does not fit refines to nothing (the
    search then prunes it for memory, relief included); the search stays exact (above)."""
    model = _model(capacity="0.1 GiB")  # (between the groups' floors: some fit, some do not)
    capacity = model.system.chip.memory.capacity_bytes
    space = LLMSpace(model, Knobs())
    checked = over = raised = 0
    for node, _ in inner_groups(space.roots()):
        if node.screen is None:  # (the degree groups keep their floor up front)
            continue
        floor = node.screen()
        assert floor >= node.floor_bytes * (1 - 1e-12), node.knobs
        raised += floor > node.floor_bytes * (1 + 1e-9)
        for m in list(mappings_under(node))[:4]:
            assert floor <= model.memory_before_blocks(m).total_bytes * (1 + 1e-12), m
            checked += 1
        if floor > capacity:
            over += 1
            assert node.refine() == 0.0
    assert checked > 50 and over > 0 and raised > 0, (checked, over, raised)
