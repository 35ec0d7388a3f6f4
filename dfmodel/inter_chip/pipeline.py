"""Pipeline parallelism: stage balancing, the 1F1B schedule, its closed-form time, DP sync.

Conventions used by every function of this module:

- ``pp`` physical stages (chips groups), ``m`` micro-batches per iteration, interleaving ``v``
  (number of model chunks per stage; ``v = 1`` is plain 1F1B). Virtual stage ``c * pp + i`` is
  chunk ``c`` of stage ``i`` (Megatron's round-robin assignment of layer chunks).
- Stage times are given **per physical stage for one micro-batch through all of the stage's
  layers** (all ``v`` chunks together): ``stage_fwd_s[i]``, ``stage_bwd_s[i]`` (backward =
  data gradients + weight gradients, and recompute if any), split evenly over the ``v`` chunks.
  An entry may instead be a sequence of ``v`` chunk times (e.g. the embedding on chunk 0 of
  stage 0, the LM head on the last chunk of the last stage).
- ``p2p_s`` is the time of one point-to-point activation (forward) or activation-gradient
  (backward) transfer between two *different* stages; it is a latency on the dependency edge
  (asynchronous send/receive, it does not occupy either stage's compute).

References: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021 (1F1B = PipeDream-Flush, sec. 2.2.1; interleaved 1F1B, sec. 2.2.2,
bubble ``(p-1)/v``); Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198 (sec. 4.2.3, in-flight micro-batches); the schedule order is that of
Megatron-LM ``megatron/core/pipeline_parallel/schedules.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from numbers import Real
from typing import Literal, Sequence

from dfmodel.algorithms import balance_layers, interleaved_split_accounts  # noqa: F401 -- pure algorithms, re-exported here


# --------------------------------------------------------------------------------------------
# Schedule order (Megatron-LM 1F1B and interleaved 1F1B)
# --------------------------------------------------------------------------------------------


def _check_pipeline_args(pp: int, num_micro_batches: int, interleave: int) -> None:
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if interleave < 1:
        raise ValueError(f"interleave must be >= 1, got {interleave}")
    if interleave > 1 and pp < 2:
        raise ValueError("interleaving (interleave > 1) needs pp >= 2")
    if interleave > 1 and num_micro_batches % pp != 0:
        # Megatron-LM's classic requirement; without it the fixed interleaved order can deadlock.
        raise ValueError(
            f"interleaved 1F1B needs num_micro_batches % pp == 0, got m={num_micro_batches}, pp={pp}"
        )


def warmup_forwards(pp: int, stage: int, num_micro_batches: int, interleave: int = 1) -> int:
    """Forward passes a stage runs before its first backward (Megatron-LM's warm-up count).

    Counted in chunk-micro-batches (one forward of one model chunk for one micro-batch).
    Plain 1F1B: ``pp - stage - 1``; interleaved: ``2 (pp - stage - 1) + (v - 1) pp``; both
    capped at the stage's total number of forwards ``m v`` (then the stage runs all forwards
    first). Source: Megatron-LM ``forward_backward_pipelining_{without,with}_interleaving``
    (``microbatch_group_size_per_vp_stage = pp``).

    >>> warmup_forwards(4, 0, 8), warmup_forwards(4, 3, 8), warmup_forwards(4, 0, 8, 2)
    (3, 0, 10)
    """
    _check_pipeline_args(pp, num_micro_batches, interleave)
    if interleave == 1:
        w = pp - stage - 1
    else:
        w = 2 * (pp - stage - 1) + (interleave - 1) * pp
    return min(w, num_micro_batches * interleave)


def schedule_order(
    pp: int, stage: int, num_micro_batches: int, interleave: int = 1
) -> list[tuple[Literal["F", "B"], int, int]]:
    """The sequence of ``(kind, chunk, micro_batch)`` one stage executes under (interleaved) 1F1B.

    Warm-up forwards, then one-forward-one-backward, then cool-down backwards. With
    interleaving, forwards visit micro-batches in groups of ``pp``: for each group, chunk 0 of
    the group's micro-batches, then chunk 1, ...; backwards visit the same table with chunks
    reversed (Megatron-LM ``get_schedule_table``; also valid when ``m % pp != 0``).

    >>> schedule_order(2, 0, 3)
    [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
    """
    m, v = num_micro_batches, interleave
    table = [
        (mb, chunk)
        for g in range(0, m, pp)
        for chunk in range(v)
        for mb in range(g, min(g + pp, m))
    ]
    fwd = [("F", chunk, mb) for mb, chunk in table]
    bwd = [("B", v - 1 - chunk, mb) for mb, chunk in table]
    w = warmup_forwards(pp, stage, m, v)
    order: list = list(fwd[:w])
    for k in range(m * v - w):
        order.append(fwd[w + k])
        order.append(bwd[k])
    order.extend(bwd[m * v - w :])
    return order


# --------------------------------------------------------------------------------------------
# Event-driven simulation (the oracle)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One operation of the pipeline schedule: a forward or backward of one chunk, one micro-batch."""

    stage: int
    chunk: int
    micro_batch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float

    def to_dict(self) -> dict:
        return asdict(self)


StageTimes = Sequence["float | Sequence[float]"]


def _chunk_times(times: StageTimes, v: int, what: str) -> list[list[float]]:
    """``[stage][chunk]`` durations: a float per stage is split evenly over its ``v`` chunks;
    a sequence of ``v`` floats gives each chunk's own time."""
    out: list[list[float]] = []
    for i, t in enumerate(times):
        if isinstance(t, Real):
            row = [float(t) / v] * v
        else:
            row = [float(x) for x in t]
            if len(row) != v:
                raise ValueError(f"{what}[{i}] needs {v} chunk times, got {len(row)}")
        if any(x < 0 for x in row):
            raise ValueError(f"{what}[{i}] must be >= 0, got {t}")
        out.append(row)
    return out


def _stage_chunk_times(stage_fwd_s, stage_bwd_s, v):
    if len(stage_fwd_s) != len(stage_bwd_s) or len(stage_fwd_s) < 1:
        raise ValueError(
            f"stage_fwd_s and stage_bwd_s must be non-empty and of equal length "
            f"(got {len(stage_fwd_s)} and {len(stage_bwd_s)})"
        )
    return _chunk_times(stage_fwd_s, v, "stage_fwd_s"), _chunk_times(stage_bwd_s, v, "stage_bwd_s")


def _checked_chunks(stage_fwd_s, stage_bwd_s, num_micro_batches: int, interleave: int, p2p_s: float):
    """Validated per-chunk forward/backward times and the stage count (shared argument checks)."""
    fwd, bwd = _stage_chunk_times(stage_fwd_s, stage_bwd_s, interleave)
    pp = len(fwd)
    _check_pipeline_args(pp, num_micro_batches, interleave)
    if p2p_s < 0:
        raise ValueError(f"p2p_s must be >= 0, got {p2p_s}")
    return fwd, bwd, pp


def simulate_1f1b(
    stage_fwd_s: StageTimes,
    stage_bwd_s: StageTimes,
    num_micro_batches: int,
    interleave: int = 1,
    p2p_s: float = 0.0,
) -> list[Event]:
    """Event-driven simulation of (interleaved) 1F1B; returns every operation with its times.

    Each stage runs its :func:`schedule_order` one op at a time, each op as early as possible:
    when the stage is free and the op's input is there. F of (virtual stage ``s``, micro-batch
    ``j``) needs F of (``s - 1``, ``j``) plus ``p2p_s``; B of (``s``, ``j``) needs B of
    (``s + 1``, ``j``) plus ``p2p_s`` (the last virtual stage's B needs its own F, locally).
    Every virtual-stage boundary is a transfer between two different stages (for ``pp >= 2``).
    The makespan ``max(e.end_s)`` is the oracle for :func:`pipeline_time`.

    >>> ev = simulate_1f1b([1.0, 1.0], [2.0, 2.0], 4)
    >>> max(e.end_s for e in ev)  # (m + pp - 1) * (t_f + t_b)
    15.0
    """
    v, m = interleave, num_micro_batches
    fwd, bwd, pp = _checked_chunks(stage_fwd_s, stage_bwd_s, m, v, p2p_s)
    nvs = pp * v
    orders = [schedule_order(pp, i, m, v) for i in range(pp)]
    ptr = [0] * pp
    free = [0.0] * pp
    end: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(pp):
            while ptr[i] < len(orders[i]):
                kind, c, j = orders[i][ptr[i]]
                s = c * pp + i
                if kind == "F":
                    dep, delay = (("F", s - 1, j), p2p_s) if s > 0 else (None, 0.0)
                else:
                    dep, delay = (("B", s + 1, j), p2p_s) if s < nvs - 1 else (("F", s, j), 0.0)
                if dep is not None and dep not in end:
                    break
                ready = end[dep] + delay if dep is not None else 0.0
                if kind == "B":
                    ready = max(ready, end[("F", s, j)])  # own forward (always earlier in order)
                start = max(free[i], ready)
                dur = fwd[i][c] if kind == "F" else bwd[i][c]
                free[i] = start + dur
                end[(kind, s, j)] = free[i]
                events.append(Event(i, c, j, kind, start, free[i]))
                ptr[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - Megatron's order is deadlock-free
            raise RuntimeError(f"1F1B schedule deadlocked (pp={pp}, m={m}, v={v})")
    return events


def makespan_s(events: Sequence[Event]) -> float:
    """End of the last operation of a simulated schedule."""
    return max(e.end_s for e in events)


# --------------------------------------------------------------------------------------------
# Stage balancing
# --------------------------------------------------------------------------------------------


def stage_times(counts: Sequence[int], layer_time_s: float, first_extra_s: float = 0.0,
                last_extra_s: float = 0.0) -> list[float]:
    """Per-stage time of a split from :func:`balance_layers` (identical layers; extras on the ends).

    >>> stage_times([3, 3, 3, 1], 1.0, last_extra_s=2.0)
    [3.0, 3.0, 3.0, 3.0]
    """
    t = [c * layer_time_s for c in counts]
    t[0] += first_extra_s
    t[-1] += last_extra_s
    return t


# --------------------------------------------------------------------------------------------
# Closed-form pipeline time
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineTime:
    """Time of one iteration's forward+backward pipeline.

    ``total_s`` makespan; ``busy_s`` compute time of the bottleneck stage (``m`` times its
    forward+backward); ``bubble_s = total_s - busy_s`` its idle time (fill/drain bubble plus the
    point-to-point transfers on the critical path, ``p2p_exposed_s``). ``exact`` says whether
    ``total_s`` is the exact 1F1B makespan (see :func:`pipeline_time`).
    """

    total_s: float
    bubble_s: float
    busy_s: float
    p2p_exposed_s: float = 0.0
    exact: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def p2p_transfers_on_critical_path(pp: int, num_micro_batches: int, interleave: int = 1) -> int:
    """Point-to-point transfers on the critical path of (interleaved) 1F1B with equal stages.

    - Plain 1F1B: ``2 (pp - 1) + 2 floor((m - 1)(pp - 1) / pp)``. The first term is the fill
      (micro-batch 0's activations cross ``pp - 1`` boundaries forward) and the drain (the last
      gradient crosses them backward). The second is the steady state: 1F1B keeps at most
      ``pp`` micro-batches in flight, and each one's round trip carries ``2 (pp - 1)`` transfers
      that its warm-up cannot hide, so every micro-batch after the first adds
      ``2 (pp - 1)/pp`` transfers on average (Little's law; the floor is exact in the simulator).
    - Interleaved (``v > 1``): ``2 (pp v - 1)``, i.e. fill and drain across all ``pp v - 1``
      virtual-stage boundaries and nothing in the steady state. Megatron-LM's warm-up keeps
      ``2 (pp - i - 1)`` extra chunk-forwards on stage ``i``, which hides one transfer behind each
      op. That holds while ``p2p_s <= min(t_f, t_b) / v`` (one chunk op). Beyond it, this count is
      only a lower bound (see :func:`pipeline_time`).

    >>> p2p_transfers_on_critical_path(4, 1), p2p_transfers_on_critical_path(4, 8)
    (6, 16)
    >>> p2p_transfers_on_critical_path(4, 8, 2)
    14
    """
    _check_pipeline_args(pp, num_micro_batches, interleave)
    if interleave == 1:
        return 2 * (pp - 1) + 2 * ((num_micro_batches - 1) * (pp - 1) // pp)
    return 2 * (pp * interleave - 1)


def pipeline_time(
    stage_fwd_s: StageTimes,
    stage_bwd_s: StageTimes,
    num_micro_batches: int,
    interleave: int = 1,
    p2p_s: float = 0.0,
) -> PipelineTime:
    """Closed-form time of (interleaved) 1F1B (Narayanan et al. SC21, PipeDream-Flush).

    With ``T_i = t_f,i + t_b,i`` (stage ``i``, one micro-batch, all its chunks) and bottleneck
    ``T* = max_i T_i``::

        total = m T*  +  (sum_i T_i - T*) / v  +  K p2p_s

    i.e. the bottleneck stage sets the steady state and the other stages' times make up the
    fill and drain, shortened ``v``-fold by interleaving. ``K`` is
    :func:`p2p_transfers_on_critical_path`. For equal stages this is Narayanan et al.'s
    ``(m + (pp - 1)/v)(t_f + t_b)`` with bubble ``(pp - 1)/v (t_f + t_b)``, plus ``K p2p_s``.

    Accuracy against the event simulation :func:`simulate_1f1b` (all tested):

    - equal stages, ``v = 1``: exact for every ``p2p_s``;
    - equal stages, ``v > 1`` (``m % pp == 0``): exact when ``p2p_s <= min(t_f, t_b)/v``. Beyond
      that the latency leaks into the steady state, and the value is a lower bound (``exact``
      False). The makespan is a longest path, so it is convex in ``p2p_s``, and this is its first
      linear piece. Use :func:`pipeline_time_simulated` for the exact value;
    - unequal stages, ``v = 1``, same backward/forward ratio on every stage (layers with the
      same recompute policy, extras in proportion): an **upper** bound for every ``p2p_s``,
      tight when the slowest stage is the last. Checked, not proven: exhaustively for small
      integer times and on 30 000 random cases;
    - unequal stages otherwise (different ratios, or ``v > 1``): an estimate, not a bound.
      The fixed 1F1B order can make a fast stage wait (pp=3, m=2, t_f=(0,2,0), t_b=(2,0,0):
      simulated 8, formula 6). Interleaved, same ratio: within -12 % / +7 % of the simulation
      in random tests. Monotonicity gives a guaranteed upper bound: the equal-stage value at
      ``(max_i t_f,i, max_i t_b,i)``, in its exact regime.

    ``exact`` is True only in the two exact cases.

    >>> pt = pipeline_time([1.0] * 4, [2.0] * 4, 8)
    >>> pt.total_s, pt.bubble_s, pt.busy_s
    (33.0, 9.0, 24.0)
    >>> pipeline_time([1.0] * 4, [2.0] * 4, 8, interleave=3).bubble_s
    3.0
    """
    v, m = interleave, num_micro_batches
    fwd, bwd, pp = _checked_chunks(stage_fwd_s, stage_bwd_s, m, v, p2p_s)
    tf = [sum(r) for r in fwd]
    tb = [sum(r) for r in bwd]
    T = [a + b for a, b in zip(tf, tb)]
    t_star = max(T)
    k = p2p_transfers_on_critical_path(pp, m, v) if pp > 1 else 0
    p2p = k * p2p_s
    busy = m * t_star
    total = busy + (sum(T) - t_star) / v + p2p
    equal = all(r == fwd[0] for r in fwd) and all(r == bwd[0] for r in bwd)
    chunk_min = min(min(min(r) for r in fwd), min(min(r) for r in bwd))
    exact = equal and (v == 1 or p2p_s == 0 or p2p_s <= chunk_min)
    return PipelineTime(total_s=total, bubble_s=total - busy, busy_s=busy, p2p_exposed_s=p2p, exact=exact)


def pipeline_time_simulated(
    stage_fwd_s: StageTimes,
    stage_bwd_s: StageTimes,
    num_micro_batches: int,
    interleave: int = 1,
    p2p_s: float = 0.0,
) -> PipelineTime:
    """:class:`PipelineTime` from the event simulation (exact for any stage times; O(pp m v)).

    ``busy_s`` is the bottleneck stage's compute; ``p2p_exposed_s`` is the makespan minus the
    makespan of the same schedule without transfers. Runs :func:`_simulated_makespan`, the
    same arithmetic as :func:`simulate_1f1b` without building events, memoised: the search
    meets the same stage times under many placements (test_pipeline.py checks it against
    :func:`simulate_1f1b` bit for bit).

    >>> pipeline_time_simulated([1.0] * 4, [2.0] * 4, 8).total_s
    33.0
    """
    fwd, bwd, pp = _checked_chunks(stage_fwd_s, stage_bwd_s, num_micro_batches, interleave, p2p_s)
    fwd_t, bwd_t = tuple(map(tuple, fwd)), tuple(map(tuple, bwd))
    total, busy = _simulated_makespan(fwd_t, bwd_t, num_micro_batches, interleave, float(p2p_s))
    no_p2p = total if p2p_s == 0 else _simulated_makespan(fwd_t, bwd_t, num_micro_batches, interleave, 0.0)[0]
    return PipelineTime(total_s=total, bubble_s=total - busy, busy_s=busy,
                        p2p_exposed_s=total - no_p2p, exact=True)


@lru_cache(maxsize=4096)
def _schedule_orders(pp: int, num_micro_batches: int, interleave: int) -> tuple:
    """Every stage's :func:`schedule_order`, as ``(is_forward, chunk, micro_batch)`` tuples."""
    return tuple(tuple((k == "F", c, j) for k, c, j in schedule_order(pp, i, num_micro_batches, interleave))
                 for i in range(pp))


@lru_cache(maxsize=256)
def _stage_programs(pp: int, m: int, v: int) -> tuple:
    """Every stage's :func:`schedule_order` compiled for :func:`_simulated_makespan`: per op
    ``(dep, own, me, code, hop)`` -- the flat index of the end time it waits for (``dep``: the
    previous virtual stage's forward, the next one's backward, or its own forward on the last
    virtual stage), of its own forward (a backward; the always-zero slot for a forward), its
    own slot, its duration's index in the stage's ``forward chunks + backward chunks`` row, and
    whether a transfer precedes it. Flat indices: forward ``s m + j``, backward
    ``nvs m + s m + j``, the zero slot ``2 nvs m``."""
    nvs = pp * v
    zero = 2 * nvs * m
    out = []
    for i, order in enumerate(_schedule_orders(pp, m, v)):
        prog = []
        for is_f, c, j in order:
            s = c * pp + i
            if is_f:
                dep, hop = ((s - 1) * m + j, 1) if s > 0 else (zero, 0)
                prog.append((dep, zero, s * m + j, c, hop))
            else:
                dep, hop = ((nvs + s + 1) * m + j, 1) if s < nvs - 1 else (s * m + j, 0)
                prog.append((dep, s * m + j, (nvs + s) * m + j, v + c, hop))
        out.append(tuple(prog))
    return tuple(out)


@lru_cache(maxsize=8192)
def _simulated_makespan(fwd: tuple, bwd: tuple, m: int, v: int, p2p_s: float) -> tuple[float, float]:
    """(makespan, bottleneck stage's busy time) of :func:`simulate_1f1b` on per-chunk times
    ``fwd[stage][chunk]``, ``bwd[stage][chunk]``: the same event order and the same float
    operations (so the same bits), with end times in one flat list and each stage's schedule
    compiled once per (pp, m, v) (:func:`_stage_programs`)."""
    pp = len(fwd)
    progs = _stage_programs(pp, m, v)
    rows = [tuple(fwd[i]) + tuple(bwd[i]) for i in range(pp)]
    hops = (0.0, p2p_s)
    end: list = [None] * (2 * pp * v * m + 1)
    end[-1] = 0.0
    ptr = [0] * pp
    free = [0.0] * pp
    busy = [0.0] * pp
    remaining = sum(len(p) for p in progs)
    makespan = 0.0
    while remaining:
        progressed = False
        for i in range(pp):
            prog, row, k, f, b = progs[i], rows[i], ptr[i], free[i], busy[i]
            n = len(prog)
            while k < n:
                dep, own, me, code, hop = prog[k]
                d = end[dep]
                if d is None:
                    break
                ready = d + hops[hop]
                o = end[own]
                if o > ready:  # (max(ready, own forward's end), as simulate_1f1b)
                    ready = o
                start = f if f >= ready else ready
                f = start + row[code]
                b += f - start
                end[me] = f
                if f > makespan:
                    makespan = f
                k += 1
            if k != ptr[i]:
                remaining -= k - ptr[i]
                ptr[i], free[i], busy[i] = k, f, b
                progressed = True
        if not progressed:  # pragma: no cover - Megatron's order is deadlock-free
            raise RuntimeError(f"1F1B schedule deadlocked (pp={pp}, m={m}, v={v})")
    return makespan, max(busy)


def simulated_lower_bound_s(stage_fwd_s: StageTimes, stage_bwd_s: StageTimes, num_micro_batches: int,
                            interleave: int = 1, p2p_s: float = 0.0) -> float:
    """A valid lower bound on the simulated makespan, in O(pp) (the search skips simulating a
    candidate this bound already puts past its cutoff).

    Stage ``i`` runs all its ``m T_i`` of work, and cannot start before micro-batch 0 has gone
    forward through chunk 0 of stages ``0 .. i-1``, with a transfer after each:
    ``max_i (sum_{j<i} (F_j0 + p2p) + m T_i)``. test_pipeline.py checks it against the
    simulation on random cases.

    >>> simulated_lower_bound_s([1.0] * 4, [2.0] * 4, 8)  # stage 3: 3 x 1 + 8 x 3
    27.0
    """
    v, m = interleave, num_micro_batches
    fwd, bwd, pp = _checked_chunks(stage_fwd_s, stage_bwd_s, m, v, p2p_s)
    head = 0.0
    best = 0.0
    for i in range(pp):
        best = max(best, head + m * (sum(fwd[i]) + sum(bwd[i])))
        head += fwd[i][0] + p2p_s
    return best


def peak_in_flight(events: Sequence[Event], stage: int, interleave: int = 1) -> float:
    """Most micro-batches (in units of the stage's ``v`` chunks) whose activations ``stage`` holds.

    Activations of (chunk, micro-batch) are held from the start of its F to the end of its B.
    Used to check :func:`dfmodel.inter_chip.memory.in_flight_micro_batches`.
    """
    held = peak = 0
    for e in (e for e in events if e.stage == stage):  # events are in each stage's execution order
        held += 1 if e.kind == "F" else -1
        peak = max(peak, held)
    return peak / interleave


# --------------------------------------------------------------------------------------------
# Data-parallel gradient synchronisation
# --------------------------------------------------------------------------------------------


def dp_sync_time(
    grad_bytes_per_chip: float,
    allreduce_s: float,
    backward_s: float,
    overlap_fraction: float,
    *,
    bucket_bytes: float = 0.0,
) -> float:
    """Exposed time of the data-parallel gradient synchronisation after the last backward.

    ``allreduce_s`` is the collective's time for this chip's gradients, supplied by the caller
    from the collective-cost table: an all-reduce, or with a distributed optimizer a
    reduce-scatter of gradients plus an all-gather of updated parameters. Gradients are
    reduced in buckets while the backward of the last micro-batch still runs (Megatron-LM
    ``overlap_grad_reduce``; PyTorch DDP bucketing; Narayanan et al. SC21 sec. 3). At most
    ``overlap_fraction`` of ``backward_s`` (that micro-batch's backward on this stage) hides
    communication, and the last bucket (``bucket_bytes`` of ``grad_bytes_per_chip``) can only
    start once the backward is done:

        exposed = max(allreduce_s - overlap_fraction * backward_s,
                      allreduce_s * min(1, bucket_bytes / grad_bytes_per_chip))

    With pipelining, the first stage finishes its backward last, so the caller passes stage 0's
    values. Earlier-finishing stages overlap their sync with the drain.

    >>> dp_sync_time(1e9, allreduce_s=0.5, backward_s=0.4, overlap_fraction=0.5)
    0.3
    >>> dp_sync_time(1e9, 0.5, 10.0, 1.0, bucket_bytes=1e8)  # last bucket: 10 % of the bytes
    0.05
    """
    if min(grad_bytes_per_chip, allreduce_s, backward_s, bucket_bytes) < 0:
        raise ValueError("dp_sync_time: bytes and times must be >= 0")
    if not 0.0 <= overlap_fraction <= 1.0:
        raise ValueError(f"overlap_fraction must be in [0, 1], got {overlap_fraction}")
    if grad_bytes_per_chip == 0 or allreduce_s == 0:
        return 0.0
    tail = allreduce_s * min(1.0, bucket_bytes / grad_bytes_per_chip)
    return max(allreduce_s - overlap_fraction * backward_s, tail)


#: Megatron-LM's default DDP bucket: ``max(40,000,000, 1,000,000 * dp)`` gradient elements
#: (megatron/core/distributed, ``bucket_size`` of the DDP config / training ``--ddp-bucket-size``).
MEGATRON_BUCKET_ELEMENTS = 40_000_000


def megatron_bucket_elements(dp: int) -> int:
    """Megatron-LM's default gradient-bucket size in elements for ``dp`` replicas.

    >>> megatron_bucket_elements(8), megatron_bucket_elements(64)
    (40000000, 64000000)
    """
    return max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * dp)


def dp_sync_exposed_s(
    *,
    sync_s: float,
    grad_elements: float,
    chunk_backward_s: float,
    interleave: int,
    pp: int,
    overlap_fraction: float,
    bucket_elements: float,
    last_bucket_elements: float | None = None,
) -> float:
    """Exposed time of the data-parallel gradient sync of one stage after its last backward.

    ``sync_s``: the collective time for all this chip's gradients (reduce-scatter + all-gather
    with the distributed optimizer, else all-reduce), in the precision the framework reduces in
    (fp32 for bf16 / fp8 Megatron-LM); ``chunk_backward_s``: one micro-batch's backward through
    ONE model chunk of the stage (the whole stage when ``interleave == 1``).

    With ``overlap_grad_reduce`` the buckets of a chunk are reduced while that chunk's LAST
    backward still runs (Megatron-LM DDP hooks). With interleaving (``v`` chunks), chunk ``j``
    (0 = the last to finish) runs its last backward about ``j * pp`` chunk-backwards before the
    end of the cooldown (interleaved 1F1B drains the chunks in groups of ``pp`` micro-batches;
    Narayanan et al. SC21 sec. 2.2), so its ``1/v`` of the gradients may start then. The
    network runs one bucket at a time; the last bucket of each chunk cannot start before the
    chunk's backward ends (the tail). Simulated chunk by chunk, times relative to the end of the
    backward; only ``overlap_fraction`` of each window hides communication (0: the sync starts
    after the backward, as without ``overlap_grad_reduce``).

    ``last_bucket_elements`` (default ``bucket_elements``) is the bucket the whole sync ends
    with: the one holding the first chunk's first parameters. Megatron-Core fills buckets in
    reverse parameter order and closes one only after a whole parameter
    (``_ParamAndGradBuffer.__init__``, core_r0.8.0 param_and_grad_buffer.py), so the bucket
    holding the word embedding has at least the embedding's ``V h / tp`` elements, however
    small ``bucket_elements`` is; its gradients are ready when the backward ends.

    >>> dp_sync_exposed_s(sync_s=1.0, grad_elements=1e9, chunk_backward_s=0.4, interleave=1, pp=4,
    ...                   overlap_fraction=1.0, bucket_elements=1e8)
    0.6
    >>> dp_sync_exposed_s(sync_s=1.0, grad_elements=1e9, chunk_backward_s=10.0, interleave=1, pp=4,
    ...                   overlap_fraction=1.0, bucket_elements=1e8)  # the last bucket: 10 %
    0.1
    >>> dp_sync_exposed_s(sync_s=1.0, grad_elements=1e9, chunk_backward_s=10.0, interleave=1, pp=4,
    ...                   overlap_fraction=1.0, bucket_elements=1e8, last_bucket_elements=3e8)  # an embedding
    0.3
    """
    if min(sync_s, grad_elements, chunk_backward_s, bucket_elements) < 0 or interleave < 1 or pp < 1:
        raise ValueError("dp_sync_exposed_s: times and sizes must be >= 0, interleave and pp >= 1")
    if not 0.0 <= overlap_fraction <= 1.0:
        raise ValueError(f"overlap_fraction must be in [0, 1], got {overlap_fraction}")
    if sync_s == 0 or grad_elements == 0:
        return 0.0
    v = interleave
    chunk_sync_s = sync_s / v
    last = bucket_elements if last_bucket_elements is None else max(bucket_elements, last_bucket_elements)
    clock = float("-inf")
    f = overlap_fraction  # the share of every window that hides communication (0: none starts early)
    for j in reversed(range(v)):  # the chunk finishing first drains first
        end_j = -f * j * pp * chunk_backward_s  # its last backward ends here
        start_j = end_j - f * chunk_backward_s
        tail_s = chunk_sync_s * min(1.0, (last if j == 0 else bucket_elements) / (grad_elements / v))
        clock = max(max(clock, start_j) + chunk_sync_s, end_j + tail_s)
    return max(0.0, clock)
