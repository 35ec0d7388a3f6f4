"""Pure algorithms: plain functions on numbers, bitmasks and lists, no model objects.

- :func:`ideal_masks` / :func:`enumerate_ideals`: every down-set (ideal) of a small DAG, the
  lattice both the intra-chip DP (:mod:`dfmodel.intra_chip.ideals`) and the graph family's
  stage partition walk;
- :func:`min_max_chain`: exact min-max ordered partition of a DAG into at most ``pp`` stages
  (bottleneck path over the ideal lattice, A*);
- :func:`balance_layers`: exact min-max contiguous split of a layer chain over pipeline stages;
- :func:`pareto_front`: the non-dominated points of a 2-D cloud.

Each is checked against brute force in the tests; each has a docstring example.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from numbers import Real
from typing import Callable, Iterable, Sequence

import numpy as np

#: Above this many ideals of the (sharded) graph the exact stage partition is not attempted.
MAX_IDEALS = 20_000
#: Above this many lattice edges examined the exact stage partition gives up (TooLarge).
MAX_EDGES = 2_000_000
#: The intra-chip DP's default guard on the number of ideals.
DEFAULT_MAX_IDEALS = 50_000


class TooLarge(Exception):
    """The ideal lattice exceeds a guard."""


def ideal_masks(n: int, pred_masks, max_ideals: int = DEFAULT_MAX_IDEALS) -> set[int]:
    """Every down-set of a DAG of ``n`` kernels as a bitmask (``pred_masks[k]``: bitmask of k's
    producers); TooLarge past ``max_ideals``.

    >>> sorted(ideal_masks(3, [0, 1, 1]))  # a -> b, a -> c
    [0, 1, 3, 5, 7]
    """
    if n <= 64:
        return _ideal_masks_by_size(n, pred_masks, max_ideals)
    return _ideal_masks_dfs(n, pred_masks, max_ideals)


def _ideal_masks_dfs(n: int, pred_masks, max_ideals: int) -> set[int]:
    """:func:`ideal_masks` by a depth-first walk over Python integers (any ``n``)."""
    seen = {0}
    stack = [0]
    while stack:
        ideal = stack.pop()
        for k in range(n):
            if not (ideal >> k) & 1 and not (pred_masks[k] & ~ideal):
                nxt = ideal | (1 << k)
                if nxt not in seen:
                    seen.add(nxt)
                    if len(seen) > max_ideals:
                        raise TooLarge(f"more than {max_ideals} ideals")
                    stack.append(nxt)
    return seen


def _ideal_masks_by_size(n: int, pred_masks, max_ideals: int) -> set[int]:
    """:func:`ideal_masks` of a DAG of at most 64 kernels, one size at a time on 64-bit words:
    the ideals of size ``s + 1`` are those of size ``s`` plus one kernel not in them whose
    producers all are (every ideal is reached so: remove a sink). A depth-first walk in Python
    over every (ideal, kernel) took ~0.03 s per thousand ideals, seconds on a search's
    lattices; TooLarge past ``max_ideals``, as soon as a size's distinct ideals pass it."""
    bit = [np.uint64(1) << np.uint64(k) for k in range(n)]
    pred = [np.uint64(p) for p in pred_masks]
    level = np.zeros(1, dtype=np.uint64)
    found = [level]
    total = 1
    for _ in range(n):
        grown = [level[((level & b) == 0) & ((p & ~level) == 0)] | b for b, p in zip(bit, pred)]
        level = np.unique(np.concatenate(grown))
        if level.size == 0:
            break
        total += level.size
        if total > max_ideals:
            raise TooLarge(f"more than {max_ideals} ideals")
        found.append(level)
    return set(np.concatenate(found).tolist())


def enumerate_ideals(n: int, preds: list[int], max_ideals: int = MAX_IDEALS) -> list[int]:
    """Every down-set of a DAG of ``n`` kernels as a bitmask (``preds[k]``: bitmask of k's
    producers), sorted by size then value; TooLarge past ``max_ideals``.

    >>> enumerate_ideals(3, [0, 1, 1])  # a -> b, a -> c
    [0, 1, 3, 5, 7]
    """
    return sorted(ideal_masks(n, preds, max_ideals), key=lambda m: (m.bit_count(), m))


def pack_masks(masks: list[int], n: int) -> np.ndarray:
    """Bitmasks over ``n`` kernels as rows of 64-bit words (for vectorised subset tests)."""
    words = max(1, -(-n // 64))
    full = (1 << 64) - 1
    return np.array([[(m >> (64 * w)) & full for w in range(words)] for m in masks], dtype=np.uint64)


@dataclass
class Chain:
    """An ordered partition: ``stages`` are the non-empty kernel sets (bitmasks) in order."""

    value: float  # the slowest stage
    stages: list[int]
    evaluated: int  # distinct stage sets costed
    ideals: int | None  # size of the lattice (None: pp = 1, no lattice built)


def min_max_chain(n: int, preds: list[int], pp: int, cost, lower=None, *, edge_lower=None,
                  max_ideals: int = MAX_IDEALS, max_edges: int = MAX_EDGES) -> Chain | None:
    """Ordered partition of ``n`` kernels into at most ``pp`` stages (each the difference of two
    nested down-sets) minimising ``max cost(stage)``; None when every chain has an infinite stage.

    ``cost(mask) -> float`` (``inf`` = infeasible) is called lazily, at most once per set;
    ``lower`` (``n`` or ``n x c``, ``>= 0``) holds per-kernel terms of ``c`` components such that
    for every set the largest component sum is a lower bound on its cost (None: 0);
    ``edge_lower(J, Js) -> array`` optionally adds a further lower bound for the stages
    ``Js[i] - J`` (on top of the component bound); masks come packed as :func:`pack_masks` rows. Exact: an A* search for the bottleneck path
    over states ``(ideal J, stages used h)`` with value ``g`` = the slowest stage so far, ordered
    by ``f = max(g, max_c (component c of the kernels not in J) / (pp - h))`` -- the rest needs at
    most ``pp - h`` more stages, so one of them takes at least the average. This estimate is
    consistent (``f`` never decreases along an edge: per component, if a stage's bound is below
    the parent's average, what is left after it has a larger average), so the first complete
    chain popped is optimal. A state is dominated by the same ideal reached
    with no more stages and no larger ``g``. Edges are visited lazily in increasing order of
    their bound ``max(g, lower of the stage, estimate of the child)`` and costed only when popped.

    >>> min_max_chain(3, [0, 1, 2], 2, lambda m: float(m.bit_count())).value  # chain a -> b -> c
    2.0
    """
    full = (1 << n) - 1
    cache: dict[int, float] = {}

    def c(mask: int) -> float:
        if mask not in cache:
            cache[mask] = float(cost(mask))
        return cache[mask]

    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if pp == 1 or n <= 1:
        v = c(full)
        return Chain(v, [full], len(cache), None) if math.isfinite(v) else None
    ideals = enumerate_ideals(n, preds, max_ideals)
    packed = pack_masks(ideals, n)
    lo = np.zeros((n, 1)) if lower is None else \
        np.maximum(np.asarray(lower, dtype=float).reshape(n, -1), 0.0) * (1 - 1e-9)  # guard rounding
    bits = np.array([[(m >> k) & 1 for k in range(n)] for m in ideals], dtype=float)
    F = bits @ lo  # component sums of the lower terms over each ideal
    rest = np.max(np.maximum(F[-1] - F, 0.0), axis=1)  # ... over the kernels outside it (largest)
    size = np.array([m.bit_count() for m in ideals])
    last = len(ideals) - 1  # the full ideal (largest)
    rest[last] = 0.0

    def estimate(js: np.ndarray, h: int) -> np.ndarray:
        """Lower bound on the slowest of the stages still to come from ideals ``js`` after ``h``."""
        if h >= pp:
            return np.where(js == last, 0.0, np.inf)
        return rest[js] / (pp - h)

    settled: dict[int, list[tuple[int, float]]] = {}
    parents: dict[tuple[int, int], tuple[int, int] | None] = {}
    heap: list = [(float(estimate(np.array([0]), 0)[0]), 0.0, 0, "arrive", (0, 0, None))]
    seq = 1
    edges = 0

    def dominated(j: int, h: int, g: float) -> bool:
        return any(h2 <= h and g2 <= g for h2, g2 in settled.get(j, ()))

    while heap:
        f, g, _, kind, payload = heapq.heappop(heap)
        if kind == "arrive":
            j, h, parent = payload
            if dominated(j, h, g):
                continue
            settled.setdefault(j, []).append((h, g))
            parents[(j, h)] = parent
            if j == last:
                stages, state = [], (j, h)
                while parents[state] is not None:
                    prev = parents[state]
                    stages.append(ideals[state[0]] & ~ideals[prev[0]])
                    state = prev
                return Chain(g, stages[::-1], len(cache), len(ideals))
            if h >= pp:
                continue
            cand = np.flatnonzero((size > size[j]) & np.all((packed[j] & ~packed) == 0, axis=1))
            if h + 1 >= pp:
                cand = cand[cand == last]
            if cand.size == 0:
                continue
            stage_lb = np.max(np.maximum(F[cand] - F[j], 0.0), axis=1)
            if edge_lower is not None:
                stage_lb = stage_lb + np.asarray(edge_lower(packed[j], packed[cand]), dtype=float)
            bound = np.maximum(stage_lb, estimate(cand, h + 1))
            bound = np.maximum(bound, g)
            keep = np.isfinite(bound)
            cand, bound = cand[keep], bound[keep]
            if cand.size == 0:
                continue
            order = np.argsort(bound, kind="stable")
            cand, bound = cand[order], bound[order]
            heapq.heappush(heap, (float(bound[0]), g, seq, "edges", [j, h, g, cand, bound, 0]))
            seq += 1
        else:
            j, h, g0, cand, bound, pos = payload
            jj = int(cand[pos])
            payload[5] = pos + 1
            if pos + 1 < cand.size:
                heapq.heappush(heap, (float(bound[pos + 1]), g0, seq, "edges", payload))
                seq += 1
            edges += 1
            if edges > max_edges:
                raise TooLarge(f"more than {max_edges} lattice edges examined")
            if dominated(jj, h + 1, g0):
                continue
            t = c(ideals[jj] & ~ideals[j])
            if math.isfinite(t):
                g1 = max(g0, t)
                f1 = max(g1, float(estimate(np.array([jj]), h + 1)[0]))
                heapq.heappush(heap, (f1, g1, seq, "arrive", (jj, h + 1, (j, h))))
                seq += 1
    return None


def interleaved_split_accounts(num_layers: int, pp: int, interleave: int) -> tuple[int, int] | None:
    """How Megatron-Core splits ``num_layers`` into ``pp * interleave`` equal virtual chunks:
    ``(embedding, loss)`` counted as extra layers, or None when no split is even.

    Megatron-Core (``TransformerConfig.account_for_embedding_in_pipeline_split`` /
    ``account_for_loss_in_pipeline_split``, "the embedding layer [loss] will be treated as a
    standard transformer layer in the context of partition and placement for pipeline
    parallelism") counts the input embedding as a layer of the first virtual chunk and the loss
    as one of the last, so ``num_layers + embedding + loss`` must divide by ``pp * interleave``.
    NeMo's llama31_405b recipe sets both (126 + 2 = 128 layers over pp 8 x interleave 8; the
    MLPerf Training Llama 3.1 405B reference is built on it). A split without either is preferred.

    >>> interleaved_split_accounts(128, 8, 8), interleaved_split_accounts(126, 8, 8)
    ((0, 0), (1, 1))
    >>> interleaved_split_accounts(125, 8, 8) is None
    True
    """
    if pp < 2 or interleave < 1:
        return None
    chunks = pp * interleave
    for emb, loss in ((0, 0), (1, 1), (1, 0), (0, 1)):
        total = num_layers + emb + loss
        if total % chunks == 0 and total // chunks >= 1 + max(emb, loss):  # every chunk keeps a layer
            return emb, loss
    return None


def balance_layers(
    num_layers: int,
    pp: int,
    interleave: int,
    layer_time_s: "float | Sequence[float]",
    first_extra_s: float = 0.0,
    last_extra_s: float = 0.0,
    *,
    min_layers_per_stage: int = 1,
    fits: "Callable[[int, int, int], bool] | None" = None,
) -> list[int] | None:
    """Layers per stage minimising the slowest stage (exact contiguous chain partition).

    Stage ``i`` takes the next ``n_i`` layers; its time is the sum of their times (``layer_time_s``:
    one number for identical layers, or one per layer) plus ``first_extra_s`` on stage 0 (input
    embedding) and ``last_extra_s`` on stage ``pp - 1`` (final norm, LM head, loss; both on the
    single stage when ``pp == 1``). The optimal bottleneck is one of the finitely many values
    "sum of a contiguous run of layers + that stage's extra"; binary search over them with a
    greedy feasibility test is exact: filling stages from the **last** one, each as full as the
    bound allows while leaving ``min_layers_per_stage`` (0 or 1) for each stage before it, covers all
    layers whenever any split does (exchange argument; checked against brute force in the tests).
    Among the optimal splits it returns one with layer counts as even as the bound allows, the
    extra layers going to later stages, because the early stages hold the most micro-batches in
    flight and so the most activation memory.

    Interleaving (``interleave = v > 1``): Megatron-LM needs equal chunks, ``num_layers % (pp v)
    == 0``; returns ``pp v`` equal counts, one per virtual stage ``c pp + i``, or raises
    ``ValueError``. When the embedding and / or loss count as layers
    (:func:`interleaved_split_accounts`) the first / last virtual chunk holds one transformer
    layer fewer.

    ``fits(stage, start, stop)``: whether layers ``start .. stop - 1`` fit stage ``stage``'s
    memory; the split is then the least bottleneck among those whose every stage fits (None if
    none does), the greedy's own (later stages as full as the bound and memory allow: the early
    stages hold the most micro-batches in flight), not the even tie-break. Megatron-Core runs such
    splits (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``,
    ``--pipeline-model-parallel-layout``). The back-to-front greedy stays exact when ``fits`` is
    monotone (a sub-run of a run that fits a stage fits it) and no stricter on a later middle
    stage (a run fitting stage ``i`` fits stage ``j``, ``i < j < pp - 1``: activations in flight
    never grow with the stage, and only stage 0 holds the embedding), which memory is; checked
    against brute force in the tests. Plain 1F1B only (interleaved chunks are equal).

    >>> balance_layers(8, 4, 1, 1.0), balance_layers(10, 4, 1, 1.0, last_extra_s=2.0)
    ([2, 2, 2, 2], [3, 3, 3, 1])
    >>> balance_layers(8, 2, 2, 1.0)
    [2, 2, 2, 2]
    >>> balance_layers(8, 2, 1, 1.0, fits=lambda stage, a, b: b - a <= (3 if stage == 0 else 6))
    [3, 5]
    """
    if num_layers < 1 or pp < 1 or interleave < 1:
        raise ValueError(f"num_layers, pp, interleave must be >= 1, got {num_layers}, {pp}, {interleave}")
    if interleave > 1 and fits is not None:
        raise ValueError("fits applies to plain 1F1B splits (interleave 1)")
    if interleave > 1:
        chunks = pp * interleave
        accounts = interleaved_split_accounts(num_layers, pp, interleave)
        if accounts is None:
            raise ValueError(
                f"interleaved pipeline needs pp >= 2 and num_layers (+1 for the embedding, +1 for the loss) "
                f"% (pp * interleave) == 0, got num_layers={num_layers}, pp={pp}, interleave={interleave}"
            )
        emb, loss = accounts
        per = (num_layers + emb + loss) // chunks
        counts = [per] * chunks
        counts[0] -= emb  # virtual stage 0: first chunk of stage 0 holds the embedding
        counts[-1] -= loss  # virtual stage pp v - 1: last chunk of stage pp - 1 holds the loss
        return counts
    if min_layers_per_stage not in (0, 1):  # the greedy test is exact for 0 and 1 (see tests)
        raise ValueError(f"min_layers_per_stage must be 0 or 1, got {min_layers_per_stage}")
    if min_layers_per_stage * pp > num_layers:
        raise ValueError(
            f"cannot give each of {pp} stages {min_layers_per_stage} of {num_layers} layers"
        )
    uniform = isinstance(layer_time_s, Real)
    if uniform:
        times = [float(layer_time_s)] * num_layers
    else:
        times = [float(x) for x in layer_time_s]
        if len(times) != num_layers:
            raise ValueError(f"layer_time_s needs {num_layers} entries, got {len(times)}")
    if min(times) < 0 or first_extra_s < 0 or last_extra_s < 0:
        raise ValueError("layer and extra times must be >= 0")
    extra = [0.0] * pp
    extra[0] += first_extra_s
    extra[-1] += last_extra_s
    prefix = [0.0]
    for x in times:
        prefix.append(prefix[-1] + x)

    def seg(i: int, j: int) -> float:  # time of layers i..j-1
        return prefix[j] - prefix[i]

    def within(x: float, bound: float) -> bool:  # <= up to rounding of differently summed prefixes
        return x <= bound + 1e-12 * abs(bound)

    def room(st: int, start: int, end: int) -> bool:  # memory, when the caller gave it
        return fits is None or start == end or fits(st, start, end)

    def split(bound: float) -> list[int] | None:
        counts = [0] * pp
        end = num_layers
        for st in range(pp - 1, -1, -1):
            lo = min_layers_per_stage * st  # layers the earlier stages must keep
            start = end - min_layers_per_stage
            if start < lo or not within(seg(start, end) + extra[st], bound) or not room(st, start, end):
                return None
            # the earliest start within the bound and memory: both hold on a suffix of the starts
            # (layer times >= 0, memory monotone), so bisect (log L memory checks, not L)
            a = lo
            while a < start:
                mid = (a + start) // 2
                if within(seg(mid, end) + extra[st], bound) and room(st, mid, end):
                    start = mid
                else:
                    a = mid + 1
            counts[st] = end - start
            end = start
        return counts if end == 0 else None

    if fits is not None and split(math.inf) is None:  # no split fits memory, whatever the time
        return None
    n = num_layers
    # every segment time plus each stage extra, sorted and distinct (numpy: the same IEEE
    # differences and sums as seg(i, j) + e, built without a Python loop over the n^2 pairs)
    pre = np.asarray(prefix)
    i_idx, j_idx = np.triu_indices(n + 1, k=min_layers_per_stage)
    segs = pre[j_idx] - pre[i_idx]
    candidates = np.unique(np.concatenate([segs + e for e in set(extra)])).tolist()
    lo, hi = 0, len(candidates) - 1  # candidates[-1] (everything + largest extra) is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if split(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    bound = candidates[lo]
    assert split(bound) is not None
    if fits is not None:
        return split(bound)

    # Tie-break among the splits meeting the optimal bound: as even as possible, extra layers on
    # the later stages (early stages hold more micro-batches in flight).
    if uniform:
        # Identical layers: stage i holds at most cap_i layers within the bound; water-fill to the
        # lowest level lam with sum_i min(cap_i, lam) >= n, the last remainder on the latest stages.
        # This minimises the largest count among optimal splits.
        cap = []
        for st in range(pp):
            k = min_layers_per_stage
            while k + 1 <= n and within(seg(0, k + 1) + extra[st], bound):
                k += 1
            cap.append(k)
        lam = max(1, min_layers_per_stage)
        while sum(min(c, lam) for c in cap) < n:
            lam += 1
        counts = [max(min_layers_per_stage, min(c, lam - 1)) for c in cap]
        rest = n - sum(counts)
        for st in range(pp - 1, -1, -1):
            if rest > 0 and cap[st] >= lam and counts[st] < lam:
                counts[st] += 1
                rest -= 1
        assert rest == 0, (counts, cap, lam)
        return counts
    # Layers of different times: back to front, aim each stage at an even share of what is left,
    # within the bound and what the earlier stages can still cover. reach[k] = the longest
    # prefix stages 0..k-1 can cover within the bound (front greedy, exact like the back one).
    reach = [0] * pp
    pos = 0
    for k in range(pp - 1):
        nxt = pos + min_layers_per_stage
        while nxt + 1 <= n and within(seg(pos, nxt + 1) + extra[k], bound):
            nxt += 1
        pos = nxt
        reach[k + 1] = pos
    counts = [0] * pp
    end = n
    for st in range(pp - 1, 0, -1):
        fit_lo = end - min_layers_per_stage  # earliest start keeping this stage within the bound
        while fit_lo - 1 >= 0 and within(seg(fit_lo - 1, end) + extra[st], bound):
            fit_lo -= 1
        target = end - -(-end // (st + 1))  # start giving this stage ceil(end / (st + 1)) layers
        start = max(fit_lo, min(target, reach[st], end - min_layers_per_stage))
        counts[st] = end - start
        end = start
    counts[0] = end
    return counts


def pareto_front(points: Iterable[tuple[float, float]], *, minimize_x: bool = True,
                 maximize_y: bool = True) -> list[int]:
    """Indices of the non-dominated points, sorted by x.

    A point dominates another when it is at least as good on both axes and better on one
    (default: lower x, higher y). Equal points are all kept.

    >>> pareto_front([(1, 1), (2, 3), (3, 2), (2, 2)])
    [0, 1]
    """
    pts = [(float(a), float(b)) for a, b in points]
    sx = 1 if minimize_x else -1
    sy = 1 if maximize_y else -1

    def dominates(p, q):
        better_eq = sx * p[0] <= sx * q[0] and sy * p[1] >= sy * q[1]
        return better_eq and (p[0] != q[0] or p[1] != q[1])

    front = [i for i, q in enumerate(pts) if not any(dominates(p, q) for p in pts)]
    return sorted(front, key=lambda i: (sx * pts[i][0], -sy * pts[i][1]))


__all__ = ["TooLarge", "ideal_masks", "enumerate_ideals", "pack_masks", "Chain", "min_max_chain",
           "balance_layers", "pareto_front", "MAX_IDEALS", "MAX_EDGES"]
