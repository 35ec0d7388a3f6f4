"""Sharding strategies of kernels across a tensor-parallel group, and layout conversions.

A tensor of logical shape ``[tokens, features]`` is held by the ``t`` members of a TP group in
one *layout*:

- ``R`` replicated (every member holds all of it);
- ``T`` split along tokens (sequence or batch rows: Megatron's sequence parallelism);
- ``F`` split along features (hidden columns, attention heads, FFN columns, vocabulary);
- ``P`` partial sums (every member holds a full-size addend; produced by a split reduction);
- ``S`` a weight gradient split like its weight (stays local).

A strategy of a kernel fixes the layout each input operand must arrive in, the layout of its
output, and which work it splits (DESIGN.md section 5, "Sharding"). Kernels that read the same
weight (forward, data-gradient and weight-gradient kernels of one matmul) share one strategy,
because the weight is sharded once. Converting between layouts on an edge costs a collective
(:func:`conversion`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dfmodel.graph.kernel import Kernel, KernelKind, Phase

LAYOUTS = ("R", "T", "F", "P", "S")


@dataclass(frozen=True)
class Strategy:
    """How one kernel runs on a TP group.

    ``inputs`` maps an operand role (``x`` for activations/upstream values, ``g`` for incoming
    gradients, ``*`` for any operand) to the required layout; ``output`` is the produced layout.
    ``splits_work`` divides FLOP (and the output unless R/P) by the group size;
    ``splits_weight`` divides the weight (memory, traffic, parameters per chip).
    """

    name: str
    inputs: tuple[tuple[str, str], ...]
    output: str
    splits_work: bool = True
    splits_weight: bool = False
    split_dim: str | None = None  # which of Kernel.dims shrinks by the group size

    def input_layout(self, role: str) -> str:
        return _input_layout(self.inputs, role)


@lru_cache(maxsize=None)
def _input_layout(inputs: tuple[tuple[str, str], ...], role: str) -> str:
    table = dict(inputs)
    return table.get(role, table.get("*", "R"))


def _s(name, inputs, output, work=True, weight=False, dim=None) -> Strategy:
    return Strategy(name, tuple(inputs.items()), output, work, weight, dim)


# Weighted matmuls, by phase. fwd Y = X W; dgrad dX = dY W^T; wgrad dW = X^T dY.
# "col": W split by output columns (Megatron column-parallel); "row": by input rows
# (row-parallel, partial sums); "tok": tokens split, W replicated (weight gradients then need an
# all-reduce inside the group); "rep": nothing split.
WEIGHTED = {
    Phase.forward: (
        _s("col", {"*": "R"}, "F", weight=True, dim="n"),
        _s("row", {"*": "F"}, "P", weight=True, dim="k"),
        _s("tok", {"*": "T"}, "T", dim="m"),
        _s("rep", {"*": "R"}, "R", work=False),
    ),
    Phase.backward: (
        _s("col", {"*": "F"}, "P", weight=True, dim="k"),
        _s("row", {"*": "R"}, "F", weight=True, dim="n"),
        _s("tok", {"*": "T"}, "T", dim="m"),
        _s("rep", {"*": "R"}, "R", work=False),
    ),
    Phase.weight_grad: (
        _s("col", {"x": "R", "g": "F"}, "S", weight=True, dim="n"),
        _s("row", {"x": "F", "g": "R"}, "S", weight=True, dim="m"),
        _s("tok", {"*": "T"}, "P", dim="k"),
        _s("rep", {"*": "R"}, "R", work=False),
    ),
}

# Grouped expert GEMMs (MoE) with expert tensor parallelism 1 (Megatron-Core
# --expert-tensor-parallel-size 1): the TP ranks hold different whole experts (the ep group spans
# them) and each computes the routed rows of its own experts: the expert batch dim ``b`` is
# split, rows arrive and leave split (``T``), weights and weight gradients stay local (``S``).
EXPERT_SPLIT = {
    Phase.forward: _s("expert", {"*": "T"}, "T", weight=True, dim="b"),
    Phase.backward: _s("expert", {"*": "T"}, "T", weight=True, dim="b"),
    Phase.weight_grad: _s("expert", {"*": "T"}, "S", weight=True, dim="b"),
}

# Matmuls between activations (attention): split heads, or split query rows (keys replicated).
ACTIVATION_MATMUL = (
    _s("heads", {"*": "F"}, "F", dim="b"),
    _s("rep", {"*": "R"}, "R", work=False),
)
ELEMENTWISE = (
    _s("tok", {"*": "T"}, "T", dim="m"),
    _s("feat", {"*": "F"}, "F", dim="n"),
    _s("rep", {"*": "R"}, "R", work=False),
)
# Row-wise reductions over features (layernorm) cannot split features without partial
# statistics; softmax over keys (per head) and the vocabulary-parallel loss can.
ROW_REDUCTION = (
    _s("tok", {"*": "T"}, "T", dim="m"),
    _s("rep", {"*": "R"}, "R", work=False),
)
EMBEDDING = (
    _s("vocab", {"*": "R"}, "P", weight=True, dim="k"),
    _s("tok", {"*": "T"}, "T", dim="m"),
    _s("rep", {"*": "R"}, "R", work=False),
)
# Megatron-LM's token embedding is always vocabulary-parallel (VocabParallelEmbedding): the
# table is split by rows over the TP group and the partial look-ups are summed. Replicating it
# would look free (a look-up streams no weights) while holding the whole table on every member.
# ("rep" stays listed only for a group of one, where nothing is split.)
VOCAB_PARALLEL = (_s("vocab", {"*": "R"}, "P", weight=True, dim="k"), _s("rep", {"*": "R"}, "R", work=False))
PASS_THROUGH = (_s("rep", {"*": "R"}, "R", work=False),)

FEATURE_SPLITTABLE_GROUPS = ("attention", "head", "loss")


def strategies(kernel: Kernel, *, tokens_split: bool, whole_experts: bool = False) -> tuple[Strategy, ...]:
    """Strategies valid for ``kernel``; ``tokens_split=False`` forbids the ``T`` layout
    (no sequence parallelism: Megatron keeps layernorm/dropout/residual replicated).
    ``whole_experts``: a grouped expert GEMM may also split its experts (:data:`EXPERT_SPLIT`).

    >>> from dfmodel.graph.kernel import Kernel, KernelKind
    >>> k = Kernel("fwd.ln1", KernelKind.reduction, {"m": 8, "n": 4}, flop=32, output_bytes=64)
    >>> [s.name for s in strategies(k, tokens_split=True)]
    ['tok', 'rep']
    """
    expert_split = bool(whole_experts and getattr(kernel, "expert", False) and "b" in kernel.dims)
    return _strategies(kernel.kind, kernel.phase, kernel.weight_bytes > 0, kernel.group, bool(tokens_split), expert_split)


@lru_cache(maxsize=4096)
def _strategies(kind: KernelKind, phase: Phase, weighted: bool, group: str, tokens_split: bool,
                expert_split: bool) -> tuple[Strategy, ...]:
    """:func:`strategies` keyed by the only kernel attributes they depend on (memoised: the
    sharding pass asks for them hundreds of thousands of times per search)."""
    if kind == KernelKind.matmul:
        table = WEIGHTED[phase] if weighted else ACTIVATION_MATMUL
        if expert_split:
            table = (EXPERT_SPLIT[phase], *table)
    elif kind == KernelKind.elementwise:
        table = ELEMENTWISE
    elif kind == KernelKind.reduction:
        feat_ok = any(g in group for g in FEATURE_SPLITTABLE_GROUPS)
        table = ELEMENTWISE if feat_ok else ROW_REDUCTION
    elif kind == KernelKind.embedding:
        table = VOCAB_PARALLEL if group == "vocab_embedding" else EMBEDDING
    else:
        table = PASS_THROUGH
    return tuple(s for s in table if tokens_split or "T" not in (s.output, *dict(s.inputs).values()))


@dataclass(frozen=True)
class Conversion:
    """A layout change on an edge: the collective it needs (None = free) and its message."""

    collective: str | None
    message_bytes: float


def conversion(src: str, dst: str, full_bytes: float, group_size: int) -> Conversion | None:
    """Collective turning a tensor of ``full_bytes`` (logical size) from ``src`` to ``dst``.

    None when impossible (nothing consumes partial sums or a local weight-gradient shard).
    Message sizes follow :mod:`dfmodel.netmodels` conventions (all-gather: gathered output;
    reduce-scatter / all-reduce: the full buffer; all-to-all: each member's local buffer).

    >>> conversion("P", "R", 100.0, 4)
    Conversion(collective='all_reduce', message_bytes=100.0)
    >>> conversion("T", "F", 100.0, 4)
    Conversion(collective='all_to_all', message_bytes=25.0)
    """
    if dst in ("P", "S") or src == "S":
        return Conversion(None, 0.0) if src == dst else None
    if src == dst or src == "R":
        return Conversion(None, 0.0)
    if src == "P":
        return Conversion("all_reduce" if dst == "R" else "reduce_scatter", full_bytes)
    if dst == "R":
        return Conversion("all_gather", full_bytes)
    return Conversion("all_to_all", full_bytes / group_size)


def local_fraction(layout: str, group_size: int) -> float:
    """Fraction of a tensor's logical bytes one member holds in ``layout``."""
    return 1.0 / group_size if layout in ("T", "F", "S") else 1.0
