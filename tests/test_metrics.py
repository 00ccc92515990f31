import math

import pytest
import torch

from phantomclip.maths.metrics import (
    ess_share,
    kl_estimators,
    mismatch_stats,
    phantom_clip_mask,
    trust_region_split,
)


def test_trust_region_split_hand_worked():
    # ε = 0.2: log(0.8) = -0.2231, log(1.2) = 0.1823.
    lr = torch.tensor([-0.25, -0.2, 0.0, 0.18, 0.19])
    below, above = trust_region_split(lr, 0.2, 0.2)
    assert below.tolist() == [True, False, False, False, False]
    assert above.tolist() == [False, False, False, False, True]
    # asymmetric: ε_high = 0.28 -> log(1.28) = 0.2469, so 0.19 is inside
    assert not trust_region_split(lr, 0.2, 0.28)[1].any()


def test_phantom_clip_mask_signs():
    lr = torch.tensor([0.3, 0.3, -0.3, -0.3, 0.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    # zeroed: A>0 with r above; A<0 with r below. The other two are still inside the un-clipped branch.
    assert phantom_clip_mask(lr, adv, 0.2, 0.2).tolist() == [True, False, False, True, False]


def test_kl_and_ess_hand_worked():
    lr = torch.tensor([0.1, -0.1])
    kl = kl_estimators(lr)
    assert kl["kl_k1"] == pytest.approx(0.0)
    assert kl["kl_k2"] == pytest.approx(0.005)  # (0.01/2 + 0.01/2) / 2
    # k3 = mean(e^l - 1 - l) = (e^0.1 + e^-0.1 - 2)/2 = cosh(0.1) - 1
    assert kl["kl_k3"] == pytest.approx(math.cosh(0.1) - 1)
    # ESS with weights e^0.1, e^-0.1: (2 cosh 0.1)^2 / (2 (e^0.2 + e^-0.2)) = 4cosh²(0.1)/(4cosh(0.2))
    assert ess_share(lr) == pytest.approx(math.cosh(0.1) ** 2 / math.cosh(0.2))
    assert ess_share(torch.zeros(5)) == pytest.approx(1.0)


def test_mismatch_stats_hand_made():
    # Two sequences; masked-out entries carry garbage that must not leak in.
    logp_engine = torch.log(torch.tensor([[0.05, 0.95, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    beta = torch.tensor([[0.3, -0.01, 0.0, 99.0], [-0.3, 0.05, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    s = mismatch_stats(logp_engine + beta, logp_engine, mask, eps_low=0.2, eps_high=0.2, seq_mask_cap=1.3)
    assert s["tokens"] == 5 and s["nonfinite"] == 0 and s["sequences"] == 2
    assert s["beta_mean"] == pytest.approx((0.3 - 0.01 + 0 - 0.3 + 0.05) / 5)
    assert s["beta_abs_mean"] == pytest.approx((0.3 + 0.01 + 0 + 0.3 + 0.05) / 5)
    assert s["beta_abs_max"] == pytest.approx(0.3)
    # 0.3 > log 1.2 (above), -0.3 < log 0.8 (below): 1/5 each
    assert s["outside_above"] == pytest.approx(0.2) and s["outside_below"] == pytest.approx(0.2)
    assert s["outside_trust_region"] == pytest.approx(0.4)
    # low-p (p<0.1): only the 0.05 token (|β| 0.3); high-p (p>0.9): only the 0.95 token (|β| 0.01)
    assert s["beta_abs_mean_lowp"] == pytest.approx(0.3) and s["beta_abs_mean_highp"] == pytest.approx(0.01)
    assert s["lowp_highp_ratio"] == pytest.approx(30.0)
    # sequence sums: 0.29 and -0.25; cap 1.3 -> log 1.3 = 0.262 -> the first sequence is dropped
    assert s["seq_logratio_mean"] == pytest.approx((0.29 - 0.25) / 2)
    assert s["seq_mask_drop_share"] == pytest.approx(0.5)
    # geometric means: 0.29/3 and -0.25/2
    assert s["seq_geo_ratio_mean"] == pytest.approx((math.exp(0.29 / 3) + math.exp(-0.125)) / 2)
    assert s["chi2"] == pytest.approx(sum((math.exp(b) - 1) ** 2 for b in [0.3, -0.01, 0, -0.3, 0.05]) / 5)
    assert "beta_clip_rate" not in s


def test_mismatch_stats_advantages_and_nonfinite():
    logp_engine = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, float("nan"), -0.3], [0.3, -0.3, float("-inf")]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    s = mismatch_stats(logp, logp_engine, mask, advantages=torch.tensor([1.0, -1.0]))
    assert s["nonfinite"] == 2 and s["tokens"] == 4
    # seq 0 (A>0): 0.3 zeroed, -0.3 not; seq 1 (A<0): 0.3 not, -0.3 zeroed -> 2 of 4
    assert s["beta_clip_rate"] == pytest.approx(0.5)
    assert math.isfinite(s["beta_abs_mean"]) and s["beta_abs_mean"] == pytest.approx(0.3)


# ---------------------------------------------------------------------------------------------- shift-share


def test_shift_share_by_hand():
    """A: bucket 0 holds |β| 1, 3 and bucket 1 holds 10 (w = 2/3, 1/3; m = 2, 10; mean 14/3). B: bucket 0 holds 2,
    bucket 1 holds 12, 14, 10 (w = 1/4, 3/4; m = 2, 12; mean 9.5). Change 29/6 = mix (−5/12·2 + 5/12·10 = 10/3)
    + within (2/3·0 + 1/3·2 = 2/3) + interaction (−5/12·0 + 5/12·2 = 5/6). Float64 sums of a few terms of size
    ≤ 10: exact to a few ulps of 10 (1e-14 is ~50 ulps)."""
    from phantomclip.maths.metrics import shift_share

    out = shift_share(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0, 0, 1]),
                      torch.tensor([2.0, 12.0, 14.0, 10.0]), torch.tensor([0, 1, 1, 1]), n_buckets=3)
    expected = {"mean_a": 14 / 3, "mean_b": 9.5, "change": 29 / 6, "mix": 10 / 3, "within": 2 / 3,
                "interaction": 5 / 6}
    assert all(abs(out[k] - v) < 1e-14 for k, v in expected.items()), (out, expected)
    assert abs(out["mix"] + out["within"] + out["interaction"] - out["change"]) < 1e-14


def test_shift_share_empty_buckets_count_as_mix_and_the_identity_holds_on_random_data():
    from phantomclip.maths.metrics import shift_share

    # bucket 2 is empty in A: B's 6 there takes A's side as its own mean, so it adds w_B·6 = 6/2 to mix only
    out = shift_share(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 6.0]), torch.tensor([0, 2]),
                      n_buckets=4)
    assert abs(out["change"] - 2.5) < 1e-14 and abs(out["within"]) < 1e-14 and abs(out["interaction"]) < 1e-14
    assert abs(out["mix"] - (-0.5 * 1.0 + 0.5 * 6.0)) < 1e-14
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        na, nb = (int(torch.randint(1, 50, (1,), generator=g)) for _ in range(2))
        va, vb = torch.rand(na, generator=g, dtype=torch.float64), torch.rand(nb, generator=g, dtype=torch.float64)
        ba, bb = torch.randint(0, 8, (na,), generator=g), torch.randint(0, 8, (nb,), generator=g)
        out = shift_share(va, ba, vb, bb, n_buckets=8)
        # values ≤ 1, ≤ 24 float64 terms: the three parts and the change agree to ~1e-15
        assert abs(out["mix"] + out["within"] + out["interaction"] - out["change"]) < 1e-12, out


def test_prob_buckets_edges():
    from phantomclip.maths.metrics import PROB_EDGES, prob_buckets

    p = torch.tensor([0.005, 0.01, 0.05, 0.4, 0.95, 0.995, 1.0], dtype=torch.float64)
    assert prob_buckets(p.log()).tolist() == [0, 1, 1, 3, 6, 7, 7]
    assert len(PROB_EDGES) - 1 == 8
