"""The no-mapping diagnosis counts context parallelism (issue 11 round 2)."""

from dfmodel.inter_chip.config import Knobs
from dfmodel.inter_chip.diagnose import Context, diagnose


def test_cp_counts_in_the_chip_product():
    # tp 4 x cp 2 x pp 8 x dp 8 = 512: the chip check passes (MLPerf 405B is valid: 126 + 2
    # layers over 64 chunks); with 125 layers the real failure is interleaving.
    knobs = Knobs(tp=4, pp=8, dp=8, cp=2, micro_batch=1, interleave=8)
    assert diagnose(Context(512, 128, 8, 126, 1152, knobs)) is None
    why = diagnose(Context(512, 128, 8, 125, 1152, knobs))
    assert "125 layers are not a multiple of pp 8 x interleave 8" in why
    assert "must equal" not in why


def test_chip_message_names_cp_and_the_product():
    x = Context(512, 128, 8, 128, 1152, Knobs(tp=4, pp=8, dp=16, cp=2, micro_batch=1))
    why = diagnose(x)
    assert why.startswith("tp x cp x pp x dp must equal the 512 chips") and "cp 2" in why and "= 1024" in why


def test_without_cp_the_message_is_unchanged():
    x = Context(64, 32, 32, 32, 64, Knobs(tp=4, pp=4, dp=8, micro_batch=1))
    assert diagnose(x).startswith("tp x pp x dp must equal the 64 chips, but the fixed degrees give tp 4 x pp 4 x dp 8")


def test_megatron_core_split_counts_embedding_and_loss_as_layers():
    from dfmodel.inter_chip.pipeline import balance_layers, interleaved_split_accounts

    # MLPerf Llama 3.1 405B: 126 layers over pp 8 x v 8 = 64 chunks of 2 (the embedding and the
    # loss take one slot each): the first and last virtual chunks hold one layer.
    counts = balance_layers(126, 8, 8, 1.0)
    assert len(counts) == 64 and sum(counts) == 126
    assert counts[0] == 1 and counts[-1] == 1 and set(counts[1:-1]) == {2}
    # an even split stays even (identical to before); an impossible one stays impossible
    assert balance_layers(128, 8, 8, 1.0) == [2] * 64
    assert interleaved_split_accounts(124, 8, 8) is None
    # brute force: every (emb, loss) the function accepts really divides
    for L in range(1, 80):
        for pp in (2, 3, 4):
            for v in (2, 3, 5):
                acc = interleaved_split_accounts(L, pp, v)
                ok = [(e, l) for e, l in ((0, 0), (1, 1), (1, 0), (0, 1))
                      if (L + e + l) % (pp * v) == 0 and (L + e + l) // (pp * v) >= 1 + max(e, l)]
                assert acc == (ok[0] if ok else None)
