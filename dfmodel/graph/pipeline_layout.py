"""Megatron-Core's custom pipeline layout: which layers each virtual pipeline stage holds.

Megatron-Core's ``--pipeline-model-parallel-layout`` (TransformerConfig
``pipeline_model_parallel_layout``; megatron/core/transformer/pipeline_parallel_layer_layout.py)
writes the split of a model over ``pp x vp`` virtual stages as one string: stages separated by
``|``, one letter per layer (``E`` the input embedding, ``t`` a transformer (decoder) layer, ``m``
a multi-token-prediction layer, ``L`` the loss with the output layer), ``(...)*n`` and ``x*n``
repeating, commas cosmetic. Stage ``k`` of the string is virtual stage ``k // pp`` of pipeline
rank ``k % pp``, so one string serves every ``pp`` that divides its stage count. DeepSeek-V3's
recipes use it to give the embedding's and loss's stages fewer layers (Megatron Bridge
recipes/deepseek/deepseek_v3.py: ``'Et|(tt|)*30mL'`` at pp 8 x vp 4).

>>> lay = parse_pipeline_layout("Et|(tt|)*30mL")
>>> lay.num_stages, lay.decoder_counts[:3], lay.decoder_counts[-1], lay.num_decoder_layers, lay.num_mtp_layers
(32, (1, 2, 2), 0, 61, 1)
>>> parse_pipeline_layout("E,t*3|t*4|t*4|tttL").decoder_counts
(3, 4, 4, 3)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: layer letters of Megatron-Core's layout strings (LayerType: embedding, decoder, mtp, loss)
LETTERS = frozenset("EtmL")
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SINGLE = re.compile(r"([^()|*\d])\*(\d+)")


@dataclass(frozen=True)
class PipelineLayout:
    """A parsed layout: ``stages[k]`` holds the layer letters of virtual stage ``k`` in the
    string's order (Megatron-Core's: ``k = vp_rank x pp + pp_rank``)."""

    text: str
    stages: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        """Virtual stages in all: ``pp x vp``."""
        return len(self.stages)

    @property
    def decoder_counts(self) -> tuple[int, ...]:
        """Transformer layers per virtual stage (the chunk split :func:`dfmodel.algorithms.balance_layers`
        would otherwise choose)."""
        return tuple(s.count("t") for s in self.stages)

    @property
    def num_decoder_layers(self) -> int:
        return sum(self.decoder_counts)

    @property
    def num_mtp_layers(self) -> int:
        return sum(s.count("m") for s in self.stages)

    def interleave(self, pp: int) -> int | None:
        """Virtual stages per pipeline rank at ``pp`` ranks (None: ``pp`` does not divide the
        stage count, which Megatron-Core rejects; one rank holds a one-stage layout only)."""
        if pp < 1 or self.num_stages % pp or (pp == 1 and self.num_stages > 1):
            return None
        return self.num_stages // pp


def parse_pipeline_layout(text: str) -> PipelineLayout:
    """Parse a layout string; ValueError (one line, what is allowed) on anything else.

    Checks what the model relies on: only the letters E, t, m, L; exactly one E, as the first
    layer of the first stage (the embedding runs on pipeline rank 0), and one L, as the last
    layer of the last stage (the output layer and loss run on the last rank); MTP layers after
    every transformer layer, all in the last stage (DFModel runs them on the last rank, beside
    the loss; Megatron-Core also allows the last virtual stage of another rank, not modelled).

    >>> parse_pipeline_layout("(tt|)*2")
    Traceback (most recent call last):
    ...
    ValueError: must hold exactly one E (the embedding) and one L (the loss), got 0 E and 0 L in '(tt|)*2'
    """
    flat = text.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _SINGLE):  # (..)*n first, then x*n (Megatron-Core's order)
        while pattern.search(flat):
            flat = pattern.sub(lambda g: g.group(1) * int(g.group(2)), flat)
    stages = tuple(flat.split("|"))
    bad = sorted(set("".join(stages)) - LETTERS)
    if bad:
        raise ValueError(f"unknown layer letter {bad[0]!r} in {text!r}; the letters are E (embedding), "
                         f"t (transformer layer), m (multi-token prediction), L (loss), '|' between stages, "
                         f"(..)*n and x*n to repeat")
    joined = "".join(stages)
    if joined.count("E") != 1 or joined.count("L") != 1:
        raise ValueError(f"must hold exactly one E (the embedding) and one L (the loss), got "
                         f"{joined.count('E')} E and {joined.count('L')} L in {text!r}")
    if not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise ValueError(f"the embedding E must open the first stage and the loss L close the last, in {text!r}")
    if "m" in joined and "t" in joined[joined.find("m"):]:
        raise ValueError(f"multi-token-prediction layers m must follow every transformer layer t, in {text!r}")
    if any("m" in s for s in stages[:-1]):
        raise ValueError(f"multi-token-prediction layers m must sit in the last stage, with the loss (a stage of MTP "
                         f"alone, Megatron-Core's standalone MTP, is not modelled), in {text!r}")
    return PipelineLayout(text, stages)


__all__ = ["PipelineLayout", "parse_pipeline_layout", "LETTERS"]
