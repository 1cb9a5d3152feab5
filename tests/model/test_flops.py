"""The FLOP model behind the benchmark's MFU, against counts worked out by hand."""

from helpers import random_model, tiny_config

from nanochat.model import flops


def tiny_gpt(n_layer=1, window_pattern="L"):
    """One head of width 64 over 400 tokens: the sizes the FLOP counts below are worked out for."""
    return random_model(tiny_config(sequence_len=128, vocab_size=400, n_layer=n_layer, n_head=1, n_kv_head=1,
                                    window_pattern=window_pattern))


def test_flops_match_hand_computed_values():
    # one layer, width 64, one head; vocab 400 padded to 448. Matmul weights: q, k, v, proj 4 * 64^2,
    # MLP 2 * 64 * 256, lm_head 448 * 64 = 77824 -> 6 * 77824 = 466944 per trained token.
    model = tiny_gpt()
    assert flops.matmul_flops_per_token(model) == 466944
    assert flops.train_flops_per_token(model, 100) == 466944 + 12 * 64 * 100
    assert flops.train_flops_per_token(model, 128) == model.estimate_flops()  # T = sequence_len
    # two layers with windows S (64 keys back) and L: 2 * 466944 - 448 * 64 * 6 of the shared lm_head
    windowed = tiny_gpt(n_layer=2, window_pattern="SL")
    assert flops.train_flops_per_token(windowed, 100) == 2 * 466944 - 448 * 64 * 6 + 12 * 64 * (64 + 100)
    # rollouts, forward only (155648 per token): a 3-token prompt prefilled once (queries see 1, 2, 3 keys),
    # a row of 1 step (no decode) and a row of 3 steps (decode queries see 4 and 5 keys); 4 * 64 per key
    assert flops.rollout_flops(model, 3, 1, [1, 3]) == (3 * 155648 + 256 * 6) + (2 * 155648 + 256 * 9)
    assert flops.rollout_flops(model, 3, 2, [1]) == 2 * (3 * 155648 + 256 * 6)
    assert flops._sum_min(5, 3, 7) == 3 + 4 + 5 + 5 + 5
    assert flops._sum_min(5, 6, 8) == 15 and flops._sum_min(9, 2, 4) == 9 and flops._sum_min(9, 4, 3) == 0
