"""The "no valid mapping" diagnosis: it agrees with the candidate enumeration (the oracle), names
the failed constraint with its numbers, and its nearest valid values really admit a mapping."""

from __future__ import annotations

import itertools
import random

import pytest

from dfmodel import load_system, load_workload
from dfmodel.errors import InfeasibleError
from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.diagnose import context_of, diagnose, first_failure, nearest
from dfmodel.inter_chip.llm import LLMModel
from dfmodel.inter_chip.llm_family import solve_llm
from dfmodel.inter_chip.search import llm_candidates


def tiny(heads=6, kv=None, layers=6, batch=12):
    model = {"hidden": 64 * heads, "num_heads": heads, "num_layers": layers, "seq_len": 64, "vocab_size": 512}
    if kv:
        model["num_kv_heads"] = kv
    return {"kind": "llm", "name": "t", "model": model, "training": {"global_batch": batch, "precision": "bf16"}}


def system(per_node=4, nodes=2):
    return {
        "name": "mini",
        "chip": {"name": "gpu", "peak_flops": {"bf16": "312 TFLOPS"}, "sram_bytes": "40 MiB",
                 "memory": {"kind": "HBM", "capacity_bytes": "80 GiB", "bandwidth_Bps": "2 TB/s"}},
        "network": [
            {"name": "nvlink", "topology": "switch", "size": per_node, "link_bandwidth_Bps": "300 GB/s"},
            {"name": "ib", "topology": "switch", "size": nodes, "link_bandwidth_Bps": "25 GB/s"},
        ],
    }


def model_of(w, s, knobs):
    m = LLMModel(load_workload(w), load_system(s))
    m.knobs = knobs
    return m


def admits_a_mapping(m, knobs) -> bool:
    return next(iter(llm_candidates(m, knobs)), None) is not None


def random_knobs(rng, n):
    pick = lambda opts: rng.choice([None, None] + opts)  # noqa: E731
    return Knobs(tp=pick([1, 2, 3, 4, 8]), pp=pick([1, 2, 4, 7, 8]), dp=pick([1, 2, 4, 8]),
                 micro_batch=pick([1, 2, 3, 5, 6, 12]), interleave=pick([1, 2, 3]))


def test_diagnosis_agrees_with_the_enumeration_on_random_cases():
    """Oracle: a failure is reported exactly when llm_candidates yields nothing."""
    rng = random.Random(9)
    seen = {"fail": 0, "ok": 0}
    for _ in range(150):
        w = tiny(heads=rng.choice([4, 6, 8]), layers=rng.choice([4, 6, 8]), batch=rng.choice([8, 12, 24]),
                 kv=rng.choice([None, 2]))
        s = system(*rng.choice([(4, 2), (2, 2), (8, 1)]))
        n = load_system(s).num_chips
        knobs = random_knobs(rng, n)
        if any(v is not None and n % v for v in (knobs.tp, knobs.pp, knobs.dp)):
            continue  # validate_knobs rejects these as input errors first
        m = model_of(w, s, knobs)
        expected_ok = admits_a_mapping(m, knobs)
        found = first_failure(context_of(m), knobs)
        assert (found is None) == expected_ok, (w, s, knobs, found and found[0].name)
        seen["ok" if expected_ok else "fail"] += 1
    assert seen["fail"] > 20 and seen["ok"] > 20, seen


def test_every_suggested_value_admits_a_mapping():
    rng = random.Random(3)
    checked = 0
    for _ in range(80):
        w, s = tiny(batch=rng.choice([12, 24])), system()
        knobs = random_knobs(rng, 8)
        if any(v is not None and 8 % v for v in (knobs.tp, knobs.pp, knobs.dp)):
            continue
        m = model_of(w, s, knobs)
        x = context_of(m)
        if first_failure(x, knobs) is None:
            continue
        from dfmodel.inter_chip.diagnose import feasible_values

        for knob, value in x.fixed().items():
            for v in nearest(value, feasible_values(x, knob)):
                fixed = Knobs(**{**knobs.__dict__, knob: v})
                assert admits_a_mapping(model_of(w, s, fixed), fixed), (knobs, knob, v)
                checked += 1
    assert checked > 10


def test_nearest_is_the_closest_below_and_above():
    for value, valid in itertools.product([1, 5, 7, 16], [[1, 2, 4, 8], [3, 6, 12], [2]]):
        got = nearest(value, valid)
        below = max((v for v in valid if v < value), default=None)
        above = min((v for v in valid if v > value), default=None)
        assert got == [v for v in (below, above) if v is not None]


@pytest.mark.parametrize("knobs,needle", [
    (Knobs(tp=16), "tp 16 does not divide the 40 attention heads; nearest valid: --tp 8"),
    (Knobs(micro_batch=7), "micro-batch 7 does not divide the per-replica batch"),
    (Knobs(pp=64), "pp 64 exceeds the 40 layers; nearest valid: --pp 32"),
    (Knobs(pp=4, interleave=3), "the 40 layers are not a multiple of pp 4 x interleave 3 = 12"),
])
def test_issue_examples_gpt3_13b_on_64_chips(knobs, needle):
    w, s = load_workload("gpt3_13b"), load_system("dgx_a100", num_chips=64)
    with pytest.raises(InfeasibleError) as exc:
        solve_llm(w, s, knobs)
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg
    if knobs.micro_batch == 7:
        assert "nearest valid: --micro-batch 4 or 8" in msg


def test_issue_example_gpt3_175b_dp_does_not_divide_batch():
    w, s = load_workload("gpt3_175b"), load_system("dgx_a100")
    with pytest.raises(InfeasibleError) as exc:
        solve_llm(w, s, Knobs(tp=1, pp=1))
    msg = str(exc.value)
    assert "dp 1024" in msg and "does not divide the global batch 1536" in msg, msg
    assert "--tp 2" in msg and "--pp 2" in msg


def test_kv_heads_constraint_is_named():
    x = context_of(model_of(tiny(heads=8, kv=2), system(), Knobs(tp=4)))
    assert first_failure(x, x.knobs) is None  # kv 2 divides tp 4: fine
    x = context_of(model_of(tiny(heads=12, kv=4), system(per_node=6, nodes=1), Knobs(tp=6)))
    assert "tp 6 and the 4 key/value heads" in diagnose(x)


def test_tp_comm_overlap_outside_its_dimensions_is_named():
    """TE userbuffers need the TP group inside dimensions with peer memory access
    (``comm_gemm_overlap``): with it on the 4-chip NVLink only, tp 8 (spanning InfiniBand) has no
    mapping, the message says why and its suggestion (tp 4) admits one; the enumeration (the
    oracle) agrees."""
    s = system(4, 2)
    s["network"][0]["comm_gemm_overlap"] = True
    w = tiny(heads=8, layers=4, batch=8)
    bad = Knobs(tp=8, tp_comm_overlap=True)
    m = model_of(w, s, bad)
    assert not admits_a_mapping(m, bad)
    why = diagnose(context_of(m))
    assert why.startswith("tp_comm_overlap needs the TP group inside") and "nvlink of 4" in why
    assert "--tp 4" in why
    assert admits_a_mapping(m, Knobs(tp=4, tp_comm_overlap=True))
    # every candidate with the overlap keeps its TP group on NVLink
    free = list(llm_candidates(model_of(w, s, Knobs()), Knobs()))
    on = [c for c in free if c.tp_comm_overlap]
    assert on and all(name == "nvlink" for c in on for name, _ in c.group("tp"))
    assert any(c.tp > 1 and any(n == "ib" for n, _ in c.group("tp")) for c in free)  # without it, TP may span IB
    # a system with no such dimension offers the overlap nowhere
    assert not any(c.tp_comm_overlap for c in llm_candidates(model_of(w, system(4, 2), Knobs()), Knobs()))
    assert "none on this system" in diagnose(context_of(model_of(w, system(4, 2), Knobs(tp=2, tp_comm_overlap=True))))


def test_suggested_cp_ep_and_interleave_values_admit_a_mapping():
    """The suggestions for a fixed cp, ep or interleave come from their own valid values (an
    unfixed cp/ep used to be enumerated at 1 only, so `--ep 7` on 256 experts suggested only
    `--ep 1`): the nearest below and above are offered, and each admits a mapping (the
    enumeration is the oracle)."""
    from test_moe_physics import moe_workload  # 8 experts

    s = system(4, 2)
    short = tiny()
    short["model"]["seq_len"] = 24  # 2 x cp 8 = 16 chunks do not split it; 2 x cp 4 do
    cases = [
        (moe_workload(), Knobs(ep=3), "ep 3 must divide the 8 experts", "--ep 2 or 4"),
        (tiny(layers=8, batch=8), Knobs(pp=2, interleave=3), "interleave 3", "--interleave 2 or 4"),
        (short, Knobs(cp=8), "cp 8 must split the 24-token sequence", "--cp 4"),
    ]
    for w, knobs, why, suggestion in cases:
        m = model_of(w, s, knobs)
        assert not admits_a_mapping(m, knobs)
        msg = diagnose(context_of(m))
        assert why in msg and suggestion in msg, msg
        knob = next(k for k in ("ep", "interleave", "cp") if getattr(knobs, k) not in (None, 1) and k in suggestion)
        for v in map(int, suggestion.split(f"--{knob} ")[1].split(" or ")):
            fixed = Knobs(**{**knobs.__dict__, knob: v})
            assert admits_a_mapping(model_of(w, s, fixed), fixed), (knob, v)
