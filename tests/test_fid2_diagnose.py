"""The no-mapping diagnosis counts context parallelism (issue 11 round 2)."""

from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.diagnose import Context, diagnose


def test_cp_counts_in_the_chip_product():
    # tp 4 x cp 2 x pp 8 x dp 8 = 512: the chip check passes; the real failure is interleaving.
    x = Context(512, 128, 8, 126, 1152, Knobs(tp=4, pp=8, dp=8, cp=2, micro_batch=1, interleave=8))
    why = diagnose(x)
    assert "126 layers are not a multiple of pp 8 x interleave 8" in why
    assert "must equal" not in why


def test_chip_message_names_cp_and_the_product():
    x = Context(512, 128, 8, 128, 1152, Knobs(tp=4, pp=8, dp=16, cp=2, micro_batch=1))
    why = diagnose(x)
    assert why.startswith("tp x cp x pp x dp must equal the 512 chips") and "cp 2" in why and "= 1024" in why


def test_without_cp_the_message_is_unchanged():
    x = Context(64, 32, 32, 32, 64, Knobs(tp=4, pp=4, dp=8, micro_batch=1))
    assert diagnose(x).startswith("tp x pp x dp must equal the 64 chips, but the fixed degrees give tp 4 x pp 4 x dp 8")
