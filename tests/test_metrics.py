import math

import pytest
import torch

from phantomclip.metrics import (
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
    assert "phantom_clip_rate" not in s


def test_mismatch_stats_advantages_and_nonfinite():
    logp_engine = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, float("nan"), -0.3], [0.3, -0.3, float("-inf")]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    s = mismatch_stats(logp, logp_engine, mask, advantages=torch.tensor([1.0, -1.0]))
    assert s["nonfinite"] == 2 and s["tokens"] == 4
    # seq 0 (A>0): 0.3 zeroed, -0.3 not; seq 1 (A<0): 0.3 not, -0.3 zeroed -> 2 of 4
    assert s["phantom_clip_rate"] == pytest.approx(0.5)
    assert math.isfinite(s["beta_abs_mean"]) and s["beta_abs_mean"] == pytest.approx(0.3)
