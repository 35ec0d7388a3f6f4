"""Every FLOP and byte formula the graph builders use, each in exactly one place.

Matrix multiplications are counted exactly (``2*b*m*n*k``: one multiply and one add per
multiply-accumulate). Non-matrix kernels (norms, softmax, activations, losses) use the
first-order per-element counts of :data:`VECTOR_FLOP_PER_ELEMENT`; they matter little because
such kernels are bound by memory traffic, not arithmetic, on every chip we model.

>>> matmul_flop(1, 2048, 3072, 1024)
12884901888
>>> fft_flop(8, 1)
120.0
>>> lu_flop(4)
34
"""

from __future__ import annotations

import math

#: FLOP per element for vector kernels. First-order operation counts (one FLOP per add, multiply,
#: exp, divide), chosen once here so all builders agree:
#: - layernorm forward: mean (1), subtract (1), square-accumulate (2), scale by 1/std (1),
#:   gamma (1), beta (1) = 7; backward about twice that, including the gamma/beta gradients;
#: - softmax forward: scale (1), max (1), subtract (1), exp (1), sum (1), divide (1) = 6;
#:   backward dS = P * (dP - sum(dP * P)): 4;
#: - GELU (tanh approximation) forward 8, backward 16; SwiGLU silu(gate) * up forward 5
#:   (sigmoid 3, two multiplies), backward 10;
#: - residual add 1 (its backward is a copy, 0); bias add 1, bias gradient 1 (a column sum);
#: - ReLU 1, its backward (mask) 1; squared ReLU (Nemotron-4, So et al. 2021 "Primer")
#:   max(x, 0)^2 forward 2, backward (mask, 2x, times the gradient) 3;
#: - cross-entropy forward per logit (max, subtract, exp, sum) 4, backward (normalise, subtract
#:   one-hot) 2; the same counts are used for DLRM's sigmoid + binary cross-entropy;
#: - embedding pooling: 1 add per gathered element; scatter-add of the gradient: 1.
VECTOR_FLOP_PER_ELEMENT: dict[str, int] = {
    "layernorm": 7,
    "layernorm_bwd": 14,
    "softmax": 6,
    "softmax_bwd": 4,
    "gelu": 8,
    "gelu_bwd": 16,
    "swiglu": 5,
    "swiglu_bwd": 10,
    "residual": 1,
    "bias": 1,
    "bias_grad": 1,
    "relu": 1,
    "relu_bwd": 1,
    "squared_relu": 2,
    "squared_relu_bwd": 3,
    "cross_entropy": 4,
    "cross_entropy_bwd": 2,
    "embedding_pool": 1,
    "embedding_scatter": 1,
}

#: Bytes of one token id / sparse index (int32) and of one loss value (fp32).
INDEX_BYTES = 4
LOSS_BYTES = 4


def matmul_flop(b: int, m: int, n: int, k: int) -> int:
    """FLOP of ``b`` independent (m x k) @ (k x n) products: ``2*b*m*n*k`` (exact).

    >>> matmul_flop(2, 3, 4, 5)
    240
    """
    return 2 * b * m * n * k


def vector_flop(op: str, elements: int) -> int:
    """FLOP of a vector kernel: ``elements`` times the per-element count of ``op``.

    >>> vector_flop("layernorm", 10)
    70
    """
    return VECTOR_FLOP_PER_ELEMENT[op] * elements


def fft_flop(n: int, count: int) -> float:
    """FLOP of ``count`` complex 1-D FFTs of length ``n``: ``5 n log2 n`` each.

    This is the conventional nominal count of a radix-2 Cooley-Tukey FFT used by benchFFT/FFTW
    and HPC Challenge to report FFT performance; for lengths that are not powers of two it is
    the same nominal formula. Summed over the axes of a multi-dimensional transform it gives
    ``5 N log2 N`` with ``N`` the total number of points.

    >>> fft_flop(1024, 2)
    102400.0
    """
    return 5.0 * n * math.log2(n) * count


# -- LU factorisation (HPL) ------------------------------------------------------------------------
# Counts for the right-looking LU with partial pivoting on an r x r trailing matrix at a step of
# panel width w (comparisons for pivoting are not FLOP). Column i of an unblocked LU divides the
# (r-i-1) entries below the pivot and applies a rank-1 update to the (r-i-1) x (r-i-1) block below
# and to its right: (r-i-1) + 2 (r-i-1)^2. Splitting the columns of that update into the panel
# and the trailing part gives the three blocked kernels below, so summing them over all steps is
# exactly the unblocked count lu_flop(N), whatever the block size.


def lu_panel_flop(r: int, w: int) -> int:
    """Exact FLOP of factorising an r x w panel (r >= w): ``sum_i (r-i-1)(1 + 2(w-i-1))``.

    >>> lu_panel_flop(3, 3) == lu_flop(3)
    True
    """
    # sum over i=0..w-1 of (r-1-i)(2w-1-2i), expanded with S1 = sum i, S2 = sum i^2 (integers)
    s0, s1, s2 = w, w * (w - 1) // 2, (w - 1) * w * (2 * w - 1) // 6
    return (r - 1) * (2 * w - 1) * s0 - (2 * (r - 1) + (2 * w - 1)) * s1 + 2 * s2


def lu_trsm_flop(w: int, n: int) -> int:
    """Exact FLOP of solving the unit lower-triangular w x w block against n columns: ``w(w-1)n``."""
    return w * (w - 1) * n


def lu_update_flop(m: int, n: int, k: int) -> int:
    """Exact FLOP of the trailing update ``A22 -= L21 @ U12`` (m x k times k x n)."""
    return matmul_flop(1, m, n, k)


def lu_step_flop(r: int, w: int) -> tuple[int, int, int]:
    """(panel, trsm, update) FLOP of one blocked LU step on an r x r trailing matrix."""
    return lu_panel_flop(r, w), lu_trsm_flop(w, r - w), lu_update_flop(r - w, r - w, w)


def lu_flop(n: int) -> int:
    """Exact FLOP of LU with partial pivoting of an n x n matrix: ``(4n^3 - 3n^2 - n) / 6``.

    That is ``2/3 n^3 - 1/2 n^2 - 1/6 n``: ``sum_{k<n} k + 2 k^2``.

    >>> round(lu_flop(1000) / (2 / 3 * 1000**3), 6)
    0.99925
    """
    return (4 * n**3 - 3 * n**2 - n) // 6


def triangular_solve_flop(n: int) -> int:
    """FLOP of the two triangular solves after LU (unit L then U): ``n(n-1) + n^2 = 2n^2 - n``.

    With :func:`lu_flop` the total is ``2/3 n^3 + 3/2 n^2 - 7/6 n``, whose two leading terms are
    the operation count HPL itself reports (``2/3 N^3 + 3/2 N^2``, HPL's ``HPL_pdtest``).
    """
    return 2 * n * n - n
