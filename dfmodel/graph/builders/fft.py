"""Distributed complex FFT graphs: local FFT stages (``fft`` kernels) separated by transposes
(``comm`` kernels, all_to_all).

- 3-D pencil (2-D process grid): FFT along x, transpose within process rows, FFT along y,
  transpose within process columns, FFT along z (3 stages, 2 transposes);
- 3-D slab (1-D process grid): 2-D FFT over x-y planes, one transpose, FFT along z;
- 2-D: FFT along x, transpose, FFT along y;
- 1-D of length n: the four-step algorithm with n = n1 * n2 (n1 the largest divisor <= sqrt n):
  n2 FFTs of length n1, transpose, n1 FFTs of length n2 (output in transposed order, like
  FFTW-MPI's ``TRANSPOSED_OUT``; twiddle multiplications are inside the nominal count).

FLOP use the nominal ``5 n log2 n`` per length-n transform (:func:`~.formulas.fft_flop`), so the
total is ``5 N log2 N`` per transform of N points, times ``batch``. Transposes move the whole
array (``comm_bytes`` = all points; the mapping pass divides by the group size).
"""

from __future__ import annotations

import math

from dfmodel.graph.builders.base import GraphBuilder
from dfmodel.graph.builders.formulas import fft_flop
from dfmodel.graph.graph import DataflowGraph
from dfmodel.graph.kernel import KernelKind
from dfmodel.graph.workload import FFTWorkload


def four_step_split(n: int) -> tuple[int, int]:
    """n = n1 * n2 with n1 the largest divisor of n not above sqrt(n).

    >>> four_step_split(1 << 20), four_step_split(12), four_step_split(13)
    ((1024, 1024), (3, 4), (1, 13))
    """
    n1 = math.isqrt(n)
    while n % n1:
        n1 -= 1
    return n1, n // n1


def fft_plan(dims: list[int], decomposition: str) -> list[tuple[str, tuple[int, ...]] | tuple[str, str]]:
    """Stages in order: ("fft", axis lengths) or ("transpose", comm_group).

    >>> fft_plan([8, 8, 8], "pencil")
    [('fft', (8,)), ('transpose', 'row'), ('fft', (8,)), ('transpose', 'col'), ('fft', (8,))]
    >>> fft_plan([8, 8, 8], "slab")
    [('fft', (8, 8)), ('transpose', 'all'), ('fft', (8,))]
    """
    if len(dims) == 3 and decomposition == "pencil":
        nx, ny, nz = dims
        return [("fft", (nx,)), ("transpose", "row"), ("fft", (ny,)), ("transpose", "col"), ("fft", (nz,))]
    if len(dims) == 3:
        nx, ny, nz = dims
        return [("fft", (nx, ny)), ("transpose", "all"), ("fft", (nz,))]
    if len(dims) == 2:
        return [("fft", (dims[0],)), ("transpose", "all"), ("fft", (dims[1],))]
    n1, n2 = four_step_split(dims[0])
    if n1 == 1:  # prime length: one local transform, nothing to distribute
        return [("fft", (n2,))]
    return [("fft", (n1,)), ("transpose", "all"), ("fft", (n2,))]


def build_fft(w: FFTWorkload, batch: int) -> DataflowGraph:
    """The whole transform of ``batch`` arrays.

    >>> from dfmodel.graph.workload import load_workload
    >>> g = build_fft(load_workload({"kind": "fft", "name": "f", "dims": [16, 16, 16]}), 1)
    >>> g.total_flop() == 5 * 16**3 * 12
    True
    """
    N = math.prod(w.dims)
    nbytes = N * batch * w.point_bytes
    plan = fft_plan(list(w.dims), w.decomposition)
    g = GraphBuilder()
    prev, prev_t, axis, stage, t_count = None, "u", 0, 0, 0
    for step, arg in plan:
        if step == "fft":
            lengths = arg  # type: ignore[assignment]
            if len(w.dims) > 1:  # name by the axes transformed: fft.x, fft.xy, ...
                label = "xyz"[axis : axis + len(lengths)]
            else:  # four-step stages of a 1-D transform
                label = f"n{stage + 1}" if len(plan) > 1 else "n"
            stage += 1
            size = math.prod(lengths)
            flop = sum(fft_flop(n_i, N * batch // n_i) for n_i in lengths)
            name = g.kernel(f"fft.{label}", KernelKind.fft, {"n": size, "batch": N * batch // size}, flop=flop,
                            output_bytes=nbytes, group="fft")
            axis += len(lengths)
        else:
            name = g.kernel(f"transpose{t_count}", KernelKind.comm, {"n": N, "batch": batch}, flop=0,
                            output_bytes=nbytes, collective="all_to_all", comm_bytes=nbytes, comm_group=str(arg),
                            group="transpose")
            t_count += 1
        g.tensor(prev_t, prev, name, nbytes, "x")
        prev, prev_t = name, f"{name}.out"
    g.tensor("u_hat", prev, None, nbytes, "x")
    meta = {"family": "fft", "workload": w.name, "batch": batch, "dims": list(w.dims), "points": N,
            "decomposition": w.decomposition if len(w.dims) == 3 else "transpose",
            "precision": w.precision.value, "bytes_per_point": w.point_bytes}
    return g.build(f"{w.name}.fft", meta)
