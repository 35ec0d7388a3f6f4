"""Per-kernel cost formulas: padding and the integer tile split against the plain greedy."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dfmodel.graph.kernel import Kernel, KernelKind
from dfmodel.system.processor import fused_compute_time_s, padding_factor, tile_allocation


def greedy_from_ones(times, tiles):
    alloc = [1] * len(times)
    heap = [(-t, i) for i, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(tiles - len(times)):
        _, i = heapq.heappop(heap)
        alloc[i] += 1
        heapq.heappush(heap, (-times[i] / alloc[i], i))
    return alloc


@settings(max_examples=300, deadline=None)
@given(times=st.lists(st.floats(0, 10), min_size=1, max_size=8), extra=st.integers(0, 300))
def test_tile_split_matches_plain_greedy_optimum(times, extra):
    tiles = len(times) + extra
    fast, slow = tile_allocation(times, tiles), greedy_from_ones(times, tiles)
    assert sum(fast) == tiles and min(fast) >= 1
    worst = lambda a: max(t / k for t, k in zip(times, a))  # noqa: E731
    assert worst(fast) == pytest.approx(worst(slow), rel=1e-12, abs=1e-300)


def test_more_kernels_than_tiles():
    assert tile_allocation([1.0, 1.0, 1.0], 2) is None
    assert fused_compute_time_s([1.0, 1.0, 1.0], 2) is None


def test_padding():
    k = Kernel("g", KernelKind.matmul, {"m": 100, "n": 128, "k": 64}, flop=0, output_bytes=1)
    assert padding_factor(k, (128, 128, 64)) == pytest.approx(1.28)


def test_zero_work_split_is_the_greedys_and_instant():
    """A partition without arithmetic (communication kernels only) on a WSE-2-sized chip: the
    same split as the plain greedy (every spare tile to the first kernel), without 850,000
    heap steps (that took ~0.3 s per report and most of a wse2 search)."""
    import time

    assert tile_allocation([0.0, 0.0, 0.0], 50) == greedy_from_ones([0.0, 0.0, 0.0], 50)
    t0 = time.process_time()
    assert tile_allocation([0.0] * 4, 850_000) == [849_997, 1, 1, 1]
    assert time.process_time() - t0 < 0.05
    assert tile_allocation([], 10) == []
