"""Kernel sets as 64-bit masks, and sums of per-item terms over them by chunk look-up tables.

The exact DP costs millions of kernel sets (DeepSeek-V3's MoE backward on sn30: ~20 M per
search), and :meth:`CostModel.terms_of` read each one tensor by tensor and consumer by consumer
(78 items, ~320 ns a set). Most of a set's terms are sums over *items* (a kernel's extra bytes,
a weight read by any of its readers, a tensor entering, leaving or staying inside the set), each
a function of the bits of the few kernels it joins, and most items join kernels close together
in topological order. So the bits are cut into contiguous chunks of at most :data:`CHUNK_BITS`
and, per chunk, one table holds the sum of the terms of the items lying wholly in that chunk for
every value of its bits: a set's sum is one gather per chunk, plus the few items that span two
chunks, evaluated directly on the masks.

Exact where it is used: every item's term is an integer number of bytes and all of them together
stay below 2**53, so every partial sum is an integer a float64 holds exactly, and any order of
summation gives the same bits as the item-by-item loop (:func:`exact_integer_sum`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

#: widest chunk: a table of ``2**12`` rows of a few float64 terms stays in the L2 cache
CHUNK_BITS = 12
#: kernels a set mask holds at most
MAX_KERNELS = 64


def pack_rows(S: np.ndarray) -> np.ndarray:
    """Boolean rows ``S[m, n]`` (``n <= 64``) as uint64 masks (bit k: kernel k)."""
    m, n = S.shape
    if n > MAX_KERNELS:
        raise ValueError(f"{n} kernels do not fit a 64-bit mask")
    as_bytes = np.zeros((m, 8), dtype=np.uint8)
    as_bytes[:, : -(-n // 8)] = np.packbits(np.asarray(S, dtype=bool), axis=1, bitorder="little")
    return as_bytes.view("<u8").ravel().astype(np.uint64, copy=False)


def unpack_fortran(codes: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_rows` as ``np.asfortranarray`` makes a boolean matrix ``[m, n]``,
    strides included: einsum's order of addition depends on them (one row keeps its row-major
    strides, and its einsum sums differently from one with column strides)."""
    as_bytes = np.ascontiguousarray(codes, dtype="<u8").view(np.uint8).reshape(-1, 8)
    if as_bytes.shape[0] <= 1:
        return np.asfortranarray(np.unpackbits(as_bytes, axis=1, count=n, bitorder="little").view(bool))
    columns = np.unpackbits(np.ascontiguousarray(as_bytes.T), axis=0, count=n, bitorder="little")  # (n, m), C order
    return columns.view(bool).T


def exact_integer_sum(values: Sequence[float], multiplier: float = 1.0) -> bool:
    """Whether sums of any subset of ``values`` (each times at most ``multiplier``) are exact in
    float64 in any order: all integers, their total below ``2**53``."""
    v = np.abs(np.asarray(values, dtype=float))
    return bool(np.all(v == np.round(v)) and float(v.sum()) * multiplier < 2.0**53)


class ChunkSum:
    """``f(codes) = sum over items i of value_i(codes)`` (``Q`` terms per code) by look-up tables.

    ``masks[i]``: the kernels item ``i`` depends on (a Python int bitmask); ``evaluate(codes,
    items)`` the summed terms ``(len(codes), Q)`` of the items ``items`` for each mask of
    ``codes`` (it must read only the bits of each item's mask). Each table covers at most
    ``width`` kernel bits and sums the items lying wholly in them, for every value of those
    bits: first contiguous chunks of the bits, then tables over the union of the kernels of
    the items the chunks cut. Calling returns ``(Q, len(codes))``, the rows contiguous."""

    def __init__(self, n: int, masks: Sequence[int], evaluate: Callable[[np.ndarray, list[int]], np.ndarray],
                 width: int = CHUNK_BITS):
        self.evaluate = evaluate
        groups = [((1 << bits) - 1) << off for off, bits in _chunk_bounds(n, masks, width)]
        owner = [next((g for g, bits in enumerate(groups) if m & ~bits == 0), -1) for m in masks]
        chunks = len(groups)
        cut = [i for i, o in enumerate(owner) if o < 0 and masks[i].bit_count() <= width]
        for i in sorted(cut, key=lambda i: masks[i] & -masks[i]):  # cut items: tables of their kernels
            g = next((g for g in range(chunks, len(groups)) if (groups[g] | masks[i]).bit_count() <= width), None)
            if g is None:
                groups.append(0)
                g = len(groups) - 1
            groups[g] |= masks[i]
            owner[i] = g
        self.direct = [i for i, o in enumerate(owner) if o < 0]
        self.tables = [(_runs(bits), self._table(bits, [i for i, o in enumerate(owner) if o == g]))
                       for g, bits in enumerate(groups)]

    def _table(self, bits: int, items: list[int]) -> np.ndarray:
        """Terms of ``items`` for every value of the kernels ``bits``, by compact index."""
        positions = [k for k in range(bits.bit_length()) if (bits >> k) & 1]
        index = np.arange(1 << len(positions), dtype=np.uint64)
        codes = np.zeros(index.size, dtype=np.uint64)
        for i, k in enumerate(positions):
            codes |= ((index >> np.uint64(i)) & np.uint64(1)) << np.uint64(k)
        return np.ascontiguousarray(self.evaluate(codes, items))

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        codes = np.asarray(codes, dtype=np.uint64)
        out = None
        for runs, table in self.tables:
            part = np.take(table, _index(codes, runs), axis=0)
            out = part if out is None else out.__iadd__(part)
        if self.direct:
            out += self.evaluate(codes, self.direct)
        return np.ascontiguousarray(out.T)


def _runs(bits: int) -> list[tuple[int, int, int]]:
    """(lowest kernel, length, position in the compact index) of each run of ones of ``bits``."""
    out, pos, k = [], 0, 0
    while bits >> k:
        if (bits >> k) & 1:
            length = 0
            while (bits >> (k + length)) & 1:
                length += 1
            out.append((k, length, pos))
            pos, k = pos + length, k + length
        else:
            k += 1
    return out


def _index(codes: np.ndarray, runs: list[tuple[int, int, int]]) -> np.ndarray:
    """The compact table index of each code: its bits of each run, side by side."""
    idx = None
    for lo, length, pos in runs:
        part = (codes >> np.uint64(lo)) & np.uint64((1 << length) - 1)
        if pos:
            part <<= np.uint64(pos)
        idx = part if idx is None else idx.__ior__(part)
    return idx.view(np.int64)


def _chunk_bounds(n: int, masks: Sequence[int], width: int) -> list[tuple[int, int]]:
    """Contiguous chunks of at most ``width`` bits covering ``0..n-1`` that cut the fewest items
    (an item is cut by every chunk boundary between its lowest and highest bit): a shortest
    path over the boundary positions."""
    spans = [(m.bit_length() - 1, (m & -m).bit_length() - 1) for m in masks if m]  # (highest, lowest)
    cut = [sum(1 for hi, lo in spans if lo < b <= hi) for b in range(n + 1)]
    best, prev = [0] + [None] * n, [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(max(0, b - width), b):
            c = best[a] + (cut[b] if b < n else 0)
            if best[b] is None or c < best[b]:
                best[b], prev[b] = c, a
    out, b = [], n
    while b > 0:
        out.append((prev[b], b - prev[b]))
        b = prev[b]
    return out[::-1] or [(0, 1)]


Items = tuple[list[int], Callable[[np.ndarray, list[int]], np.ndarray]]


def joined_items(parts: Sequence[tuple[Items, list[int]]], columns: int) -> Items:
    """The items of several ``(masks, evaluate)`` lists as one list for a :class:`ChunkSum`
    of ``columns`` terms, each part's terms going to its own columns."""
    masks = [m for (part_masks, _), _ in parts for m in part_masks]
    starts = np.cumsum([0] + [len(part_masks) for (part_masks, _), _ in parts])

    def evaluate(codes: np.ndarray, which: list[int]) -> np.ndarray:
        out = np.zeros((codes.size, columns))
        which = np.asarray(which, dtype=np.int64)
        for ((_, part_evaluate), cols), lo, hi in zip(parts, starts, starts[1:]):
            mine = which[(which >= lo) & (which < hi)] - lo
            if mine.size:
                out[:, cols] += part_evaluate(codes, [int(i) for i in mine])
        return out

    return masks, evaluate


def any_bits(codes: np.ndarray, mask: int) -> np.ndarray:
    """Per code, whether it holds any kernel of ``mask``."""
    return (codes & np.uint64(mask)) != 0


def all_bits(codes: np.ndarray, mask: int) -> np.ndarray:
    """Per code, whether it holds every kernel of ``mask``."""
    return (codes & np.uint64(mask)) == np.uint64(mask)
