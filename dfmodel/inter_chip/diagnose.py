"""Why no LLM mapping exists: the failed constraint, with its numbers, and the nearest valid values.

The LLM candidate enumeration (:func:`dfmodel.inter_chip.search.llm_candidates`) keeps a mapping
only when every structural constraint holds. When it yields nothing, :func:`no_mapping_message`
re-checks those constraints one at a time over the user's fixed knobs, names the first that
leaves no candidate, and, for each fixed knob, the nearest values that would admit a mapping.

Extending it: a new knob or constraint is one more
:class:`Check` in :data:`CHECKS` (and, for a knob, one more entry in :data:`KNOBS`).

>>> from dfmodel.inter_chip.config import Knobs
>>> ctx = Context(num_chips=64, heads=40, kv_heads=40, layers=40, batch=512, knobs=Knobs(tp=16))
>>> print(diagnose(ctx))
tp 16 does not divide the 40 attention heads; nearest valid: --tp 8
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from dfmodel.inter_chip.config import Knobs, divisors
from dfmodel.algorithms import interleaved_split_accounts

# the knobs the enumeration takes as fixed, with their CLI spelling
KNOBS = {"tp": "--tp", "cp": "--cp", "pp": "--pp", "dp": "--dp", "micro_batch": "--micro-batch",
         "interleave": "--interleave", "ep": "--ep"}


def interleave_options(layers: int) -> list[int]:
    """Every interleave a pipeline split of ``layers`` may take (``llm_space.interleaves``: ``v``
    divides the layers per stage, or with the embedding and loss counted as layers); the checks
    keep those that split evenly for a candidate's pp."""
    return sorted(set(divisors(layers)) | set(divisors(layers + 1)) | set(divisors(layers + 2)))


@dataclass(frozen=True)
class Context:
    """The numbers the constraints read: chips, heads, layers, global batch and the fixed knobs."""

    num_chips: int
    heads: int
    kv_heads: int
    layers: int
    batch: int
    knobs: Knobs = field(default_factory=Knobs)
    placeable: Callable[..., bool] | None = None  # (tp, pp, dp, cp) -> fits the network
    # chips of the dimensions where TP collectives can hide under GEMMs (NetworkDim.comm_gemm_overlap)
    overlap_chips: int | None = None
    overlap_dims: str = ""
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model)
    seq_len: int = 0  # tokens per sequence (0: unknown, cp unconstrained)
    megatron_core: bool = True  # the chip runs Megatron-Core (Chip.eager): TP x EP needs SP
    layout_stages: int = 0  # virtual stages of the workload's training.pipeline_layout (0: none)

    def fixed(self) -> dict[str, int]:
        return {k: getattr(self.knobs, k) for k in KNOBS if getattr(self.knobs, k) is not None}


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    interleave: int

    @property
    def model_chips(self) -> int:
        """Chips one data-parallel replica spans: tp x cp x pp (``ep`` is carved out of dp x cp)."""
        return self.tp * self.cp * self.pp

    @property
    def num_micro_batches(self) -> int:
        return self.batch_per_replica // self.micro_batch

    batch_per_replica: int = 0
    cp: int = 1
    ep: int = 1


def _cp(cs: list[Candidate]) -> str:
    """`` x cp N`` when context parallelism is in play, else nothing (the message stays short)."""
    return f" x cp {_one(cs, 'cp')}" if any(c.cp > 1 for c in cs) else ""


@dataclass(frozen=True)
class Check:
    """One constraint of the enumeration: ``ok`` per candidate, ``why`` for the candidates it rejects all of."""

    name: str
    ok: Callable[[Context, Candidate], bool]
    why: Callable[[Context, list[Candidate]], str]


def _values(cands: list[Candidate], attr: str) -> str:
    return ", ".join(str(v) for v in sorted({getattr(c, attr) for c in cands}))


def _one(cands: list[Candidate], attr: str) -> str:
    vals = sorted({getattr(c, attr) for c in cands})
    return str(vals[0]) if len(vals) == 1 else "in {" + ", ".join(map(str, vals)) + "}"


def _one_product(cs: list[Candidate]) -> str:
    vals = sorted({c.model_chips * c.dp for c in cs})
    return str(vals[0]) if len(vals) == 1 else "in {" + ", ".join(map(str, vals)) + "}"


def _interleave_ok(x: Context, c: Candidate) -> bool:
    v, pp = c.interleave, c.pp
    if x.layout_stages:  # (llm_space.interleaves: the layout's own v = stages / pp)
        return pp * v == x.layout_stages and (v == 1 or c.num_micro_batches % pp == 0)
    return v == 1 or (pp > 1 and c.num_micro_batches % pp == 0
                      and interleaved_split_accounts(x.layers, pp, v) is not None)


def _interleave_why(x: Context, cs: list[Candidate]) -> str:
    """Which of the interleaving conditions (Megatron's virtual pipeline) every candidate breaks."""
    v = _one(cs, "interleave")
    if x.layout_stages and all(c.pp * c.interleave != x.layout_stages for c in cs):
        return (f"training.pipeline_layout has {x.layout_stages} virtual stages, so pp x interleave must be "
                f"{x.layout_stages}; pp {_one(cs, 'pp')} x interleave {v} is not")
    if all(c.pp == 1 for c in cs):
        return f"interleave {v} needs pipeline parallelism (pp > 1)"
    if all(interleaved_split_accounts(x.layers, c.pp, c.interleave) is None for c in cs if c.pp > 1):
        prod = ", ".join(sorted({str(c.pp * c.interleave) for c in cs if c.pp > 1}, key=int))
        return (f"interleave {v}: the {x.layers} layers are not a multiple of pp {_one(cs, 'pp')} x interleave {v} "
                f"= {prod} (nor with the embedding and loss counted as layers, as Megatron-Core may)")
    return (f"interleave {v} needs the micro-batch count (per-replica batch / micro-batch, here "
            f"{_one(cs, 'num_micro_batches')}) to be a multiple of pp {_one(cs, 'pp')}")


CHECKS: list[Check] = [
    Check("chips", lambda x, c: c.model_chips * c.dp == x.num_chips,
          lambda x, cs: f"tp x{' cp x' if _cp(cs) else ''} pp x dp must equal the {x.num_chips} chips, but the fixed "
                        f"degrees give tp {_one(cs, 'tp')}{_cp(cs)} x pp {_one(cs, 'pp')} x dp {_one(cs, 'dp')} = "
                        f"{_one_product(cs)}"),
    # expert TP = TP: ep divides dp x cp; expert TP 1 (etp): ep = tp x a divisor of dp x cp
    Check("cp", lambda x, c: c.cp == 1 or not x.seq_len or x.seq_len % (2 * c.cp) == 0,
          lambda x, cs: f"cp {_one(cs, 'cp')} must split the {x.seq_len}-token sequence into 2 x cp equal chunks "
                        f"(Megatron-Core's load-balanced causal split)"),
    Check("experts", lambda x, c: c.ep == 1 or (x.num_experts > 1 and x.num_experts % c.ep == 0),
          lambda x, cs: (f"ep {_one(cs, 'ep')} must divide the {x.num_experts} experts" if x.num_experts > 1
                         else "ep > 1 needs experts to split (the workload has no model.moe block)")),
    Check("ep", lambda x, c: (c.dp * c.cp) % c.ep == 0 or (c.tp > 1 and c.ep % c.tp == 0
                                                             and (c.dp * c.cp) % (c.ep // c.tp) == 0),
          lambda x, cs: f"ep {_one(cs, 'ep')} must divide dp x cp (the ranks experts are split over), "
                        f"here dp {_one(cs, 'dp')}{_cp(cs)}, or with expert TP 1 be tp x a divisor of it"),
    Check("sequence_parallel", lambda x, c: x.knobs.sequence_parallel is not False or c.tp == 1 or c.ep == 1
          or not x.megatron_core,
          lambda x, cs: f"sequence parallelism is off, but Megatron-Core requires it where tensor and expert "
                        f"parallelism are combined (tp {_one(cs, 'tp')}, ep {_one(cs, 'ep')})"),
    Check("heads", lambda x, c: x.heads % c.tp == 0,
          lambda x, cs: f"tp {_one(cs, 'tp')} does not divide the {x.heads} attention heads"),
    Check("kv_heads", lambda x, c: x.kv_heads % c.tp == 0 or c.tp % x.kv_heads == 0,
          lambda x, cs: f"tp {_one(cs, 'tp')} and the {x.kv_heads} key/value heads: one must divide the other"),
    Check("layers", lambda x, c: c.pp <= x.layers,
          lambda x, cs: f"pp {_one(cs, 'pp')} exceeds the {x.layers} layers"),
    Check("batch", lambda x, c: x.batch % c.dp == 0,
          lambda x, cs: f"dp {_one(cs, 'dp')} (the {x.num_chips} chips / (tp {_one(cs, 'tp')}{_cp(cs)} x pp {_one(cs, 'pp')})) "
                        f"does not divide the global batch {x.batch}"),
    Check("micro_batch", lambda x, c: c.batch_per_replica % c.micro_batch == 0,
          lambda x, cs: f"micro-batch {_one(cs, 'micro_batch')} does not divide the per-replica batch "
                        f"{_one(cs, 'batch_per_replica')} (global batch {x.batch} / dp {_one(cs, 'dp')})"),
    Check("interleave", _interleave_ok, lambda x, cs: _interleave_why(x, cs)),
    Check("tp_comm_overlap", lambda x, c: not x.knobs.tp_comm_overlap or c.tp == 1 or x.overlap_chips is None
          or x.overlap_chips % c.tp == 0,
          lambda x, cs: f"tp_comm_overlap needs the TP group inside the dimensions that allow it "
                        f"({x.overlap_dims or 'none on this system'}: comm_gemm_overlap), but tp {_one(cs, 'tp')} "
                        f"does not fit there"),
    Check("placement", lambda x, c: x.placeable is None or x.placeable(c.tp, c.pp, c.dp, c.cp),
          lambda x, cs: f"tp {_one(cs, 'tp')}{_cp(cs)} x pp {_one(cs, 'pp')} x dp {_one(cs, 'dp')} cannot be laid out on "
                        f"the system's network dimensions"),
]


def space(x: Context, knobs: Knobs, free: tuple[str, ...] = ()) -> list[Candidate]:
    """Every (tp, cp, pp, dp, ep, micro-batch, interleave) the fixed ``knobs`` allow, valid or not.
    An unfixed cp, ep or interleave is 1 unless named in ``free`` (the knob whose valid values are
    sought): 1 always passes their checks, and enumerating them costs."""
    n, B = x.num_chips, x.batch

    def opts(name: str, default) -> list[int]:
        v = getattr(knobs, name)
        return [v] if v is not None else list(default)

    out = []
    cps, eps = (opts(k, divisors(n) if k in free else [1]) for k in ("cp", "ep"))
    for tp, pp, cp in itertools.product(opts("tp", divisors(n)), opts("pp", divisors(n)), cps):
        model_chips = tp * pp * cp
        dps = opts("dp", [n // model_chips] if n % model_chips == 0 else [max(1, n // model_chips)])
        for dp, ep in itertools.product(dps, eps):
            per_dp = B // dp if B % dp == 0 else B / dp
            vs = divisors(x.layout_stages) if x.layout_stages else interleave_options(x.layers)
            for mb, v in itertools.product(opts("micro_batch", divisors(B)),
                                           opts("interleave", vs if "interleave" in free else [1])):
                out.append(Candidate(tp, pp, dp, mb, v, int(per_dp) if per_dp == int(per_dp) else 0, cp, ep))
    return out


def first_failure(x: Context, knobs: Knobs) -> tuple[Check, list[Candidate]] | None:
    """The first check that rejects every candidate left by the ones before it, with those candidates."""
    cands = space(x, knobs)
    for check in CHECKS:
        kept = [c for c in cands if check.ok(x, c)]
        if not kept:
            return check, cands
        cands = kept
    return None


def feasible_values(x: Context, knob: str) -> list[int]:
    """Values of ``knob`` that admit a mapping when it alone is freed (the other fixed knobs kept)."""
    relaxed = replace(x.knobs, **{knob: None})
    return sorted({getattr(c, knob) for c in space(x, relaxed, free=(knob,)) if all(ch.ok(x, c) for ch in CHECKS)})


def nearest(value: int, valid: list[int]) -> list[int]:
    """The closest valid value below and above ``value`` (ratio distance: degrees are multiplicative).

    >>> nearest(7, [1, 2, 4, 8, 16])
    [4, 8]
    >>> nearest(16, [1, 2, 4, 8])
    [8]
    """
    below = [v for v in valid if v < value]
    above = [v for v in valid if v > value]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def suggestions(x: Context) -> str:
    parts = []
    for knob, value in x.fixed().items():
        near = nearest(value, feasible_values(x, knob))
        if near:
            parts.append(f"{KNOBS[knob]} " + " or ".join(map(str, near)))
    return f"; nearest valid: {', or '.join(parts)}" if parts else ""


def diagnose(x: Context) -> str | None:
    """One line: the failed constraint with its numbers and the nearest valid values; None if none failed."""
    found = first_failure(x, x.knobs)
    if found is None:
        return None
    check, cands = found
    return check.why(x, cands) + suggestions(x)


def context_of(model) -> Context | None:
    """The :class:`Context` of an LLM model, or None for other families."""
    w, knobs = model.workload, getattr(model, "knobs", None)
    if getattr(w, "kind", None) != "llm" or knobs is None:
        return None
    from dfmodel.netmodels import split_dims

    heads = w.model.num_heads
    fixed_mb = knobs.micro_batch or getattr(w.training, "micro_batch", None)
    system = model.system

    def placeable(tp: int, pp: int, dp: int, cp: int = 1) -> bool:
        return bool(split_dims(system, {"tp": tp, "cp": cp, "pp": pp, "dp": dp} if cp > 1 else {"tp": tp, "pp": pp, "dp": dp}))

    overlap = [d for d in system.network if d.comm_gemm_overlap]
    return Context(system.num_chips, heads, getattr(w.model, "num_kv_heads", None) or heads, w.model.num_layers,
                   w.training.global_batch, replace(knobs, micro_batch=fixed_mb), placeable,
                   math.prod(d.size for d in overlap), " x ".join(f"{d.name} of {d.size}" for d in overlap),
                   num_experts=model.num_experts, seq_len=w.model.seq_len, megatron_core=system.chip.eager,
                   layout_stages=model.pipeline_layout.num_stages if getattr(model, "pipeline_layout", None) else 0)


GENERIC = "no valid mapping: the fixed knobs, chip count and batch admit none"


def no_mapping_message(model) -> str:
    """The message of the "no valid mapping" error: the diagnosis when there is one, else the generic line."""
    x = context_of(model)
    why = diagnose(x) if x is not None else None
    return f"no valid mapping: {why}" if why else GENERIC


__all__ = ["CHECKS", "Check", "Context", "diagnose", "no_mapping_message", "nearest"]
