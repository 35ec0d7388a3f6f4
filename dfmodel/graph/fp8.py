"""What each Transformer Engine FP8 recipe costs beyond the FP8 GEMM itself (issue 11 item 1).

One table, :data:`RECIPES`, read by the operand-preparation time
(:func:`dfmodel.system.processor.fp8_operand_prep_s`) and by the memory model (the FP8 weight
cache and the saved GEMM inputs, :mod:`dfmodel.inter_chip.memory`). Every figure is DRAM bytes
per element of the operand (16-bit input: 2 bytes read; FP8 output: 1 byte written per copy)
or a count of kernel launches, read off Transformer Engine's source
(NVIDIA/TransformerEngine @ d0067d0, 2026-08-22; "TE" below):

- ``delayed`` (``recipe.DelayedScaling``, TE's default): the scale comes from the amax history of
  earlier steps, so a cast is one kernel (read 2, write 1) and a layer norm writes its output in
  FP8 itself (``csrc/extensions/normalization.cpp``: ``Impl::FULLY_FUSED`` for
  ``Float8Quantizer``). The amax history (``amax_history_len`` fp32 per tensor, a few KiB per
  layer) is not counted.
- ``current`` (``Float8CurrentScaling``; MLPerf's ``FP8_RECIPE=tensorwise``): the scale comes from
  this tensor's own amax, so before the cast a pass reads the tensor (``csrc/quantizer.cpp``
  ``Float8CurrentScalingQuantizer::quantize_impl``: ``nvte_compute_amax``, then
  ``nvte_compute_scale_from_amax``, then ``nvte_quantize_v2``): a plain cast is read 2 (amax) +
  read 2 + write 1 in three kernels. A layer norm computes the amax as it writes a 16-bit output
  (``Impl::FUSED_NORM_AMAX_FP8``), which the cast then reads: 16-bit write instead of FP8 (+1),
  read 2, write 1, two kernels (scale, cast). The amax all-reduce over the TP group of
  sequence-parallel inputs (``with_amax_reduction``: one fp32, latency only) is not counted.
- ``mxfp8`` (``MXFP8BlockScaling``, Blackwell only: ``quantization.py`` ``_compute_mxfp8_support``
  needs compute capability 10.x): a scale (E8M0, 1 byte) per 32 elements, and because the scales
  run along one direction the cast writes a row-wise and a column-wise copy from the 16-bit input
  (the recipe's docstring: "during the quantization both versions are computed from the high
  precision input"): read 2, write 2 x (1 + 1/32), one kernel, no separate transpose. The layer
  norm does not fuse it (``Impl::UNFUSED`` unless ``NVTE_NORM_FWD_USE_CUDNN``): 16-bit write
  (+1) and the same cast.
- ``blockwise`` (``Float8BlockScaling``, DeepSeek-V3 style, sm >= 9.0 with CUDA >= 12.9): fp32
  scales per 1x128 tile of activations and gradients (4/128 bytes per element) and per 128x128
  block of weights, both copies from the 16-bit input (as ``mxfp8``), layer norm unfused
  (``Impl::UNFUSED``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: The FP8 recipes a workload may name (``training.fp8.recipe``).
RecipeName = Literal["delayed", "current", "mxfp8", "blockwise"]

#: Bytes of one 16-bit element read and of one FP8 element written.
_READ_16, _WRITE_8 = 2.0, 1.0
#: MXFP8: one E8M0 (1-byte) scale per 32 elements (OCP Microscaling spec v1.0, sec. 5.3; TE
#: ``MXFP8BlockScaling``: "Each group of 32 consecutive values is scaled together").
_MX_SCALE = 1.0 / 32
#: Float8BlockScaling: one fp32 scale per 1x128 tile (activations, gradients) and per 128x128
#: block (weights) (TE ``Float8BlockScaling`` ``x_block_scaling_dim=1, w_block_scaling_dim=2``;
#: DeepSeek-V3 report, arXiv:2412.19437 sec. 3.3.2).
_BLOCK_SCALE_1D, _BLOCK_SCALE_2D = 4.0 / 128, 4.0 / (128 * 128)


@dataclass(frozen=True)
class RecipeCost:
    """DRAM bytes per element and kernel launches of one recipe's FP8 operand preparation.

    ``cast_*``: quantising a 16-bit tensor (the attention output, every incoming gradient, MoE
    tokens); ``norm_*``: the input of a GEMM whose layer norm TE fuses with it (LayerNormLinear),
    counted beyond a norm that writes one FP8 copy itself; ``transposes``: a separate FP8
    transpose for the weight-gradient GEMM on chips whose FP8 GEMMs take only the TN layout (the
    recipes that write both copies in the cast need none); ``copy_bytes``: bytes per element of
    one FP8 copy with its scales (activations), ``weight_copy_bytes`` the same for weights.
    """

    cast_bytes: float
    cast_kernels: int
    norm_bytes: float
    norm_kernels: int
    transposes: bool
    copy_bytes: float
    weight_copy_bytes: float


#: The recipes' costs (see the module docstring for each figure's source).
RECIPES: dict[str, RecipeCost] = {
    "delayed": RecipeCost(cast_bytes=_READ_16 + _WRITE_8, cast_kernels=1, norm_bytes=0.0, norm_kernels=0,
                          transposes=True, copy_bytes=1.0, weight_copy_bytes=1.0),
    "current": RecipeCost(cast_bytes=_READ_16 + _READ_16 + _WRITE_8, cast_kernels=3,
                          norm_bytes=(_READ_16 - _WRITE_8) + _READ_16 + _WRITE_8, norm_kernels=2,
                          transposes=True, copy_bytes=1.0, weight_copy_bytes=1.0),
    "mxfp8": RecipeCost(cast_bytes=_READ_16 + 2 * (_WRITE_8 + _MX_SCALE), cast_kernels=1,
                        norm_bytes=(_READ_16 - _WRITE_8) + _READ_16 + 2 * (_WRITE_8 + _MX_SCALE), norm_kernels=1,
                        transposes=False, copy_bytes=1.0 + _MX_SCALE, weight_copy_bytes=1.0 + _MX_SCALE),
    "blockwise": RecipeCost(cast_bytes=_READ_16 + 2 * (_WRITE_8 + _BLOCK_SCALE_1D), cast_kernels=1,
                            norm_bytes=(_READ_16 - _WRITE_8) + _READ_16 + 2 * (_WRITE_8 + _BLOCK_SCALE_1D),
                            norm_kernels=1, transposes=False, copy_bytes=1.0 + _BLOCK_SCALE_1D,
                            weight_copy_bytes=1.0 + _BLOCK_SCALE_2D),
}


def recipe_cost(name: str) -> RecipeCost:
    """The cost record of recipe ``name``; a one-line error naming the field for anything else.

    >>> recipe_cost("current").cast_bytes - recipe_cost("delayed").cast_bytes  # the amax pass
    2.0
    """
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"training.fp8.recipe: {name!r} is not one of {', '.join(RECIPES)}") from None
