import torch

from phantomclip.base.numerics import parse_dtype, round_to, steps_to_cross, ulp


def test_ulp_hand_worked():
    # 1.0 = 2^0: bf16 keeps 7 stored mantissa bits -> spacing 2^-7; fp16 10 bits -> 2^-10; fp32 23 -> 2^-23.
    one = torch.tensor([1.0, 3.0, 0.1])
    assert ulp(one, torch.bfloat16).tolist()[0] == 2**-7
    assert ulp(one, torch.float16).tolist()[0] == 2**-10
    assert ulp(one, torch.float32).tolist()[0] == 2**-23
    # 3.0 lies in [2, 4): bf16 spacing 2^(1-7) = 2^-6.  0.1 lies in [2^-4, 2^-3): bf16 spacing 2^-11.
    assert ulp(one, torch.bfloat16).tolist()[1:] == [2**-6, 2**-11]


def test_round_to_bf16_tie():
    # 1 + 2^-8 is exactly half-way between bf16 neighbours 1 and 1 + 2^-7: round-to-even gives 1.
    # 1 + 3 * 2^-8 is half-way between 1 + 2^-7 and 1 + 2 * 2^-7: round-to-even gives the latter (even mantissa).
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8], dtype=torch.float32)
    assert round_to(x, torch.bfloat16).tolist() == [1.0, 1 + 2 * 2**-7]
    assert round_to(x, torch.bfloat16).dtype == torch.float32  # handed back in x's dtype


def test_steps_to_cross_matches_rule_of_thumb():
    # |w| = 1, eta = 1e-5: spacing 2^-7, half of it 2^-8 = 0.00390625 -> 391 steps; |w|/(256 eta) = 390.6.
    assert steps_to_cross(1.0, 1e-5) == 391
    assert abs(steps_to_cross(1.0, 1e-5) - 1 / (256 * 1e-5)) < 1


def test_parse_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("FP16") is torch.float16
    try:
        parse_dtype("int8")
    except ValueError as e:
        assert "bf16" in str(e)
    else:
        raise AssertionError("int8 accepted")
