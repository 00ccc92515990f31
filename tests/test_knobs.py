"""diagnose/knobs.py on tiny made-up β tables, every expected number worked out by hand in the comments; the AR(1)
variance against a brute-force covariance sum; the keep settings against the shares they promise."""

import math
from statistics import NormalDist

import pytest
import torch

from phantomclip.diagnose.knobs import (
    EXTRAPOLATE_ABOVE,
    KnobSettings,
    ar1_fit,
    ar1_sum_variance,
    beta_table,
    cap_for,
    eps_high_for,
    eps_low_for,
    floor_for,
    knob_figures,
    threshold_above,
    threshold_below,
)

# 2 sequences x 3 tokens. Sums S = [0.3, −0.05]; geometric means G = S / 3 = [0.1, −0.01667].
BETA = torch.tensor([[0.1, -0.3, 0.5], [0.05, 0.0, -0.1]])
MASK = torch.ones(2, 3, dtype=torch.bool)
# ε 0.2 -> bounds log 0.8 = −0.2231, log 1.2 = +0.1823; C = 1.2 -> log C = 0.1823; sequence cap 1.25 -> 0.2231;
# IcePop [0.9, 1.1] -> [−0.1054, +0.0953]
SETTINGS = KnobSettings(eps_low=0.2, eps_high=0.2, token_cap=1.2, seq_mask_cap=1.25, icepop_low=0.9, icepop_high=1.1)
N = NormalDist()


def _figures(keep=0.99, length=3, settings=SETTINGS, beta=BETA, mask=MASK):
    return knob_figures(beta, mask, settings, keep, length)


def test_clip_shares_and_keep_setting():
    k = _figures()["clip"]
    # outside: −0.3 (below) and 0.5 (above), both in sequence 0: 2 of 6 tokens, 1 of 2 sequences
    assert k["unit"] == "token" and k["setting"] == {"epsilon_low": 0.2, "epsilon_high": 0.2}
    assert (k["tokens"], k["tokens_below"], k["tokens_above"], k["sequences"]) == pytest.approx((2 / 6, 1 / 6, 1 / 6,
                                                                                               0.5))
    # keep 0.99: each side may touch floor(6 · 0.005) = 0 tokens, so the band must hold the extremes −0.3 and 0.5:
    # ε_low = 1 − e^−0.3 = 0.25918, ε_high = e^0.5 − 1 = 0.64872
    assert k["keep"]["epsilon_low"] == pytest.approx(-math.expm1(-0.3)) and k["keep"]["epsilon_low"] > 0.2591
    assert k["keep"]["epsilon_high"] == pytest.approx(math.expm1(0.5))
    # keep 2/3: floor(6 · 1/6) = 1 token a side: the second smallest (−0.1) and second largest (0.1) values
    k = _figures(keep=2 / 3)["clip"]
    assert k["keep"]["epsilon_low"] == pytest.approx(-math.expm1(-0.1))  # 0.09516
    assert k["keep"]["epsilon_high"] == pytest.approx(math.expm1(0.1))  # 0.10517


def test_token_caps_and_icepop():
    f = _figures()
    for name in ("token_truncate", "token_mask"):
        k = f[name]
        # r > 1.2: only 0.5 (e^0.5 = 1.65): 1 of 6 tokens, 1 of 2 sequences; keep 0.99: C ≥ e^0.5 = 1.6487
        assert k["setting"] == {"cap": 1.2} and (k["tokens"], k["sequences"]) == pytest.approx((1 / 6, 0.5))
        assert k["keep"]["cap"] == pytest.approx(math.exp(0.5))
    # keep 5/6: floor(6 · (1 − 5/6) + 1e-9) = 1 (6 · 0.16666666666666663 = 0.9999999999999998 without the 1e-9):
    # one token may stay above, so C ≥ e^0.1 (the second largest β)
    assert _figures(keep=5 / 6)["token_mask"]["keep"]["cap"] == pytest.approx(math.exp(0.1))
    # −|β| with keep 0.5: 3 of 6 may go, the 4th largest of [0, −0.05, −0.1, −0.1, −0.3, −0.5] is −0.1 < 0, so
    # the cap is no constraint: C ≥ 1
    assert _figures(keep=0.5, beta=-BETA.abs())["token_mask"]["keep"]["cap"] == 1.0
    k = f["icepop"]
    # outside [−0.1054, 0.0953]: −0.3, 0.1, 0.5 (−0.1 stays inside): 3 of 6 tokens, sequence 0 only
    assert k["setting"] == {"low": 0.9, "high": 1.1} and (k["tokens"], k["sequences"]) == pytest.approx((0.5, 0.5))
    assert k["keep"]["low"] == pytest.approx(math.exp(-0.3)) and k["keep"]["high"] == pytest.approx(math.exp(0.5))


def test_sequence_knobs():
    f = _figures()
    k = f["sequence_mask"]
    # S = [0.3, −0.05] against log 1.25 = 0.2231: sequence 0 is dropped, with its 3 of the 6 tokens
    assert k["unit"] == "sequence" and (k["sequences"], k["tokens"]) == pytest.approx((0.5, 0.5))
    assert k["keep"]["cap"] == pytest.approx(math.exp(0.3))  # 0 of 2 may go: C ≥ e^0.3 = 1.3499
    assert _figures(keep=0.5)["sequence_mask"]["keep"]["cap"] == 1.0  # 1 may go: e^−0.05 < 1, so C ≥ 1
    k = f["geo_mask"]
    # G = [0.1, −0.0167] lies inside [−0.2231, 0.1823]: nothing dropped; keep: the band must hold both G
    assert (k["sequences"], k["tokens"]) == (0.0, 0.0)
    assert k["keep"]["epsilon_high"] == pytest.approx(math.expm1(0.1))
    assert k["keep"]["epsilon_low"] == pytest.approx(-math.expm1(-0.05 / 3))  # 0.016529
    # ε 0.05: log 1.05 = 0.0488 < 0.1, log 0.95 = −0.0513 < −0.0167: sequence 0 dropped
    tight = KnobSettings(eps_low=0.05, eps_high=0.05)
    assert _figures(settings=tight)["geo_mask"]["sequences"] == 0.5


def test_effective_sample_size_of_what_each_correction_leaves():
    """ess = (Σw)² / (n Σw²) of the weights a correction leaves (metrics.ess_share). Worked on BETA (r = e^β):
    token_truncate C = 1.2: w = [e^0.1, e^-0.3, 1.2, e^0.05, 1, e^-0.1]; token_mask: 0.5's weight is 0 instead;
    icepop [0.9, 1.1]: 1 for the 3 kept, 0 for the 3 dropped: 3² / (6 · 3) = 0.5; sequence_mask C = 1.25: S = 0.3 is
    dropped, e^-0.05 kept: ESS = 1/2; sequence_truncate: [1.25, e^-0.05]."""
    f = _figures()

    def ess(w: list[float]) -> float:
        return sum(w) ** 2 / (len(w) * sum(x * x for x in w))

    # BETA is fp32: each β is off the decimal by up to half an ulp (|β| · 2^-24 ≤ 3e-8), which moves e^β, and the
    # ESS (a ratio of sums of them), by a relative 1e-7 at most: 1e-6 bounds it
    e, rel = math.exp, 1e-6
    assert f["token_truncate"]["ess"] == pytest.approx(ess([e(0.1), e(-0.3), 1.2, e(0.05), 1.0, e(-0.1)]), rel=rel)
    assert f["token_mask"]["ess"] == pytest.approx(ess([e(0.1), e(-0.3), 0.0, e(0.05), 1.0, e(-0.1)]), rel=rel)
    assert f["icepop"]["ess"] == pytest.approx(0.5, rel=rel)
    assert f["sequence_mask"]["ess"] == pytest.approx(0.5, rel=rel)
    assert f["sequence_truncate"]["ess"] == pytest.approx(ess([1.25, e(-0.05)]), rel=rel)
    # sequence_truncate touches the sequences sequence_mask drops (its weight is capped, not zeroed)
    k, m = f["sequence_truncate"], f["sequence_mask"]
    assert (k["sequences"], k["tokens"], k["keep"]) == (m["sequences"], m["tokens"], m["keep"])


def test_mask_and_nonfinite_tokens_are_left_out():
    beta = torch.tensor([[0.1, -0.3, 0.5, math.nan], [0.05, 0.0, -0.1, 9.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    f = _figures(beta=beta, mask=mask)
    assert f["beta"]["tokens"] == 6 and f["beta"]["sequences"] == 2  # the NaN, the 9 and the empty row are out
    assert f["clip"]["tokens"] == pytest.approx(2 / 6) and f["sequence_mask"]["keep"]["cap"] == pytest.approx(
        math.exp(0.3))


def test_empty_table_is_nan_not_an_error():
    f = _figures(mask=torch.zeros(2, 3, dtype=torch.bool))
    assert f["beta"]["tokens"] == 0 and not f["length"]["extrapolated"]
    assert math.isnan(f["clip"]["tokens"]) and math.isnan(f["clip"]["keep"]["epsilon_high"])
    assert math.isnan(f["sequence_mask"]["keep"]["cap"]) and math.isnan(f["sequence_mask"]["tokens"])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 50])
@pytest.mark.parametrize("rho", [-1.0, -0.7, 0.0, 0.3, 0.95, 1.0])
def test_ar1_sum_variance_against_the_covariance_sum(n, rho):
    """Var(Σ x) = 1ᵀ C 1 with C_ij = σ² ρ^|i−j|: every pair summed by brute force. Both sides add up to n² terms
    of size at most σ² in float64, so they agree to a few eps_64 · n² σ² (1e-14 · n² σ² leaves a margin of ~20);
    ρ = −1 with n even cancels to 0 exactly, where only that absolute bound applies."""
    var = 0.04
    brute = sum(var * rho ** abs(i - j) for i in range(n) for j in range(n))
    assert ar1_sum_variance(n, var, rho) == pytest.approx(brute, rel=1e-12, abs=1e-14 * n * n * var)
    assert ar1_sum_variance(n, var, rho) >= 0


def test_ar1_sum_variance_by_hand():
    # n = 2: 2σ²(1 + ρ); n = 3, σ² = 1, ρ = 0.5: 3·(1 + 2·(2/3 · 0.5 + 1/3 · 0.25)) = 5.5 = 3 + 2·(2·0.5 + 0.25)
    assert ar1_sum_variance(2, 0.5, 0.2) == pytest.approx(2 * 0.5 * 1.2)
    assert ar1_sum_variance(3, 1.0, 0.5) == pytest.approx(5.5)
    assert ar1_sum_variance(0, 1.0, 0.5) == 0.0


def _fit(beta: list, mask: list | None = None) -> tuple[float, float, float]:
    b = torch.tensor(beta)
    return ar1_fit(beta_table(b, torch.ones_like(b, dtype=torch.bool) if mask is None else torch.tensor(mask).bool()))


def test_ar1_fit_by_hand():
    fit = _fit
    # [1, 2, 3]: μ = 2, σ² = 2/3; pairs (−1)(0), (0)(1): ρ = 0
    mu, sd, rho = fit([[1.0, 2.0, 3.0]])
    assert (mu, sd**2, rho) == pytest.approx((2.0, 2 / 3, 0.0))
    # [1, 1, 3, 3]: μ = 2, σ² = 1; pairs 1, −1, 1: ρ = 1/3
    assert fit([[1.0, 1.0, 3.0, 3.0]])[2] == pytest.approx(1 / 3)
    # pairs do not cross sequences: [1, 3] and [3, 1] each give (−1)(1) = −1: ρ = −1
    assert fit([[1.0, 3.0], [3.0, 1.0]])[2] == pytest.approx(-1.0)
    # nor masked tokens: no adjacent pair left, ρ unknown
    assert math.isnan(fit([[1.0, 5.0, 3.0]], [[1, 0, 1]])[2])


def test_extrapolation_to_a_longer_completion():
    """β = [[0, 0.2], [0.2, 0.2]]: μ = 0.15, deviations [−0.15, 0.05], [0.05, 0.05], σ² = (0.0225 + 3 · 0.0025) / 4
    = 0.0075; pairs (−0.15)(0.05) = −0.0075 and (0.05)(0.05) = 0.0025: ρ = −0.0025 / 0.0075 = −1/3.
    At n = 4 (2x the mean length 2, beyond EXTRAPOLATE_ABOVE): Var S_4 = 4 · 0.0075 · (1 + 2·(3/4 · (−1/3)
    + 2/4 · 1/9 + 1/4 · (−1/27))) = 0.03 · 16/27 = 4/225, so S_4 ~ N(0.6, (2/15)²)."""
    beta = torch.tensor([[0.0, 0.2], [0.2, 0.2]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    assert 4 > EXTRAPOLATE_ABOVE * 2 >= 3
    assert _figures(beta=beta, mask=mask, length=3)["clip"]["at_length"] is None  # 3 = 1.5 x 2: not beyond
    f = _figures(beta=beta, mask=mask, length=4, settings=KnobSettings(seq_mask_cap=math.exp(0.7)))
    assert f["length"] == {"sampled_mean": 2.0, "target": 4, "extrapolated": True}
    assert (f["beta"]["mean"], f["beta"]["std"] ** 2, f["beta"]["lag1_autocorr"]) == pytest.approx((0.15, 0.0075,
                                                                                                     -1 / 3))
    sm = f["sequence_mask"]["at_length"]
    # P(S_4 > 0.7) = 1 − Φ((0.7 − 0.6) / (2/15)) = 1 − Φ(0.75) = 0.22663
    assert sm["extrapolated"] and sm["sequences"] == pytest.approx(1 - N.cdf(0.75)) == pytest.approx(0.22663, abs=1e-5)
    assert sm["keep"]["cap"] == pytest.approx(math.exp(0.6 + N.inv_cdf(0.99) * 2 / 15))  # e^0.9102 = 2.4848
    geo = f["geo_mask"]["at_length"]
    # G_4 ~ N(0.15, (1/30)²): above log 1.2 = 0.18232 with 1 − Φ(0.9696); below log 0.8 practically never
    above, below = 1 - N.cdf((math.log1p(0.2) - 0.15) * 30), N.cdf((math.log(0.8) - 0.15) * 30)
    assert geo["sequences"] == pytest.approx(above + below) and below < 1e-20
    z = N.inv_cdf(0.995)  # 2.5758
    assert geo["keep"]["epsilon_high"] == pytest.approx(math.expm1(0.15 + z / 30))  # 0.2660
    assert geo["keep"]["epsilon_low"] == 0.0  # the band's low end 0.15 − 0.0859 > 0: any ε_low ≥ 0
    # a token knob: 3 of 4 tokens are above log 1.2, so an independent 4-token sequence escapes with (1/4)^4
    clip = f["clip"]["at_length"]
    assert clip["method"] == "independent tokens" and clip["sequences"] == pytest.approx(1 - 0.25**4)


def test_keep_settings_leave_the_promised_share_and_no_more():
    """On 1,000 random β (ties included): each setting touches at most floor(N(1 − k)) tokens in all (half a side for
    two-sided knobs), and a setting a hair tighter touches more, unless the setting sits at its floor (ε = 0, C = 1:
    nothing tighter exists)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, generator=g) * 0.1).round(decimals=3).double()  # [N], rounding makes ties
    above = lambda t: int((x > t).sum())  # noqa: E731
    below = lambda t: int((x < t).sum())  # noqa: E731
    for keep in (0.5, 0.9, 0.99, 0.999):
        side, m = math.floor(1000 * (1 - keep) / 2 + 1e-9), math.floor(1000 * (1 - keep) + 1e-9)
        hi, lo = threshold_above(x, (1 - keep) / 2), threshold_below(x, (1 - keep) / 2)
        eh, el, c = eps_high_for(hi), eps_low_for(lo), cap_for(threshold_above(x, 1 - keep))
        assert above(math.log1p(eh)) <= side and below(math.log1p(-el)) <= side and above(math.log(c)) <= m
        assert below(math.log(floor_for(lo))) <= side and above(math.log(cap_for(hi))) <= side
        assert eh == 0 or above(math.log1p(eh * 0.999)) > side
        assert el == 0 or below(math.log1p(-el * 0.999)) > side
        assert c == 1 or above(math.log(c * 0.9999)) > m
    assert eps_high_for(threshold_above(x, 0.005)) > 0 and cap_for(threshold_above(x, 0.01)) > 1  # checked above


def test_settings_survive_the_rounding_of_exp_and_log():
    """The value at the threshold stays untouched under the strict comparison, whatever exp/log1p round to."""
    for t in torch.linspace(-0.5, 0.5, 1001, dtype=torch.float64).tolist():
        assert math.log1p(eps_high_for(t)) >= t or eps_high_for(t) == 0
        assert eps_low_for(t) == 0 or math.log1p(-eps_low_for(t)) <= t
        assert math.log(cap_for(t)) >= t
        assert math.log(floor_for(t)) <= t


def test_settings_past_float_range():
    """A long sequence's S can exceed log(float max) = 709.8: the cap is then +inf, not an OverflowError."""
    assert cap_for(800.0) == eps_high_for(800.0) == math.inf
    assert eps_low_for(-800.0) == 1.0 and floor_for(-800.0) == 0.0
    assert (cap_for(-1.0), floor_for(1.0), eps_high_for(-1.0), eps_low_for(1.0)) == (1.0, 1.0, 0.0, 0.0)
