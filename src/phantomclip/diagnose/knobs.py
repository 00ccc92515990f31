"""Knob advice: what each rollout-correction knob, at the user's setting, does to the measured β, and which setting
leaves a chosen share of tokens (or sequences) untouched. Pure functions of β [B, T] and a mask.

Notation as in maths/metrics.py: per scored token ℓ = β = logp − logp_engine (at α = 0), r = exp(β); per sequence s (a
row with at least one scored token) S_s = Σ_t β_t over its n_s tokens and G_s = S_s / n_s. The knobs, each a function of
maths/loss.py or of the PPO clip:

    clip            PPO's trust region: the clip fires where β < log(1 − ε_low) or β > log(1 + ε_high)
                    (Schulman et al. 2017; DAPO's ε_high, Yu et al. 2025)
    token_truncate  TIS: r truncated to C where r > C (Yao et al. 2025; loss._corr_token_truncate)
    token_mask      MIS: token dropped where r > C (loss._corr_token_mask)
    sequence_mask   sequence dropped where exp(S) > C (TRL's default vllm_importance_sampling_mode; maths/loss.py)
    sequence_truncate  the sequence's weight exp(S) truncated to C where exp(S) > C (TRL's sequence_truncate, verl's
                    rollout_is: sequence): it touches the sequences sequence_mask drops, and keeps their gradient
    geo_mask        sequence dropped where exp(G) is outside [1 − ε_low, 1 + ε_high] (GSPO's sequence-level ratio,
                    Zheng et al. 2025, clipped with the PPO ε)
    icepop          token dropped where r is outside [low, high] (IcePop, Ring-1T; loss._corr_icepop)

Every knob reports the share of tokens and of sequences it touches (truncates, masks or clips) at the sampled
lengths, and each correction the effective sample size of the weights it leaves (`ess`: metrics.ess_share of the
token weights, or of the sequence weights for a sequence knob; a masked unit weighs 0, a truncated one C); a token
knob touches a sequence when it touches one of its tokens, a sequence knob touches every token of
a sequence it drops. The setting for a keep share k leaves at least k of the tokens (token knobs) or of the
sequences (sequence knobs) untouched on the measured β; a two-sided knob gives each side half of the allowance 1 − k
(an equal-tailed band). Comparisons are strict and in float64 log space, as metrics.trust_region_split's.

Sequence sums grow with length. When the target completion length (diagnose's --max-tokens) is more than
EXTRAPOLATE_ABOVE times the sampled mean length, the sequence figures are also extrapolated to it: β is modelled as
a stationary series with the measured per-token mean μ, variance σ² and lag-1 autocorrelation ρ, whose
autocorrelation at lag k is ρ^k (AR(1)), so S_n has mean n·μ and variance `ar1_sum_variance(n, σ², ρ)`, and its
tail shares come from the normal approximation. A token knob's share of sequences at length n is 1 − (1 − p)^n
(independent tokens; touches that cluster, ρ > 0, make it smaller). Every extrapolated figure says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

from ..maths.metrics import ess_share, mean_or_nan, trust_region_split

EXTRAPOLATE_ABOVE = 1.5
"""extrapolate the sequence figures when the target length exceeds the sampled mean length by more than this
factor: below it the sampled lengths stand for the user's (a judgement: S's spread grows about as √n, so 1.5x the
length moves a tail share by about a fifth of its z-score)."""
_NORMAL = NormalDist()


@dataclass(frozen=True)
class KnobSettings:
    """The user's current setting of every knob."""

    eps_low: float = 0.2
    """PPO ε_low (clip and geo_mask)."""
    eps_high: float = 0.2
    """PPO ε_high (clip and geo_mask)."""
    token_cap: float = 3.0
    """C of token_truncate and token_mask (loss.CorrectionParams.cap)."""
    seq_mask_cap: float = 3.0
    """C of sequence_mask."""
    icepop_low: float = 0.5
    """IcePop: tokens with r below this are dropped."""
    icepop_high: float = 2.0
    """IcePop: tokens with r above this are dropped."""


@dataclass(frozen=True)
class BetaTable:
    """The scored tokens of β [B, T] in float64, per token and per sequence."""

    beta: torch.Tensor  # [B, T] β, 0 off the scored tokens
    ok: torch.Tensor  # [B, T] bool: scored tokens (mask and finite β)
    has: torch.Tensor  # [B] bool: rows that are sequences (at least one scored token)
    seq_sum: torch.Tensor  # [S] S_s
    seq_len: torch.Tensor  # [S] n_s, float64


def beta_table(beta: torch.Tensor, mask: torch.Tensor) -> BetaTable:
    """β [B, T] and its mask [B, T] -> a BetaTable; non-finite β is left out, as in metrics.mismatch_stats."""
    b = beta.detach().double()  # [B, T]
    ok = mask.bool() & torch.isfinite(b)  # [B, T]
    b = torch.where(ok, b, torch.zeros_like(b))
    n = ok.sum(-1)  # [B]
    has = n > 0  # [B]
    return BetaTable(beta=b, ok=ok, has=has, seq_sum=b.sum(-1)[has], seq_len=n[has].double())


# ------------------------------------------------------------------------------------- the AR(1) model


def ar1_sum_variance(n: int, var: float, rho: float) -> float:
    """Var(Σ_{t=1}^n x_t) for a stationary series with variance σ² = `var` and autocorrelation ρ^k at lag k:

        n·σ²·(1 + 2·Σ_{k=1}^{n−1} (1 − k/n)·ρ^k)

    (the n − k pairs at lag k each add 2·σ²·ρ^k to the variance of the sum). ρ = 0: n·σ²; ρ = 1: n²·σ²."""
    if n <= 0:
        return 0.0
    k = torch.arange(1, n, dtype=torch.float64)  # [n − 1] lags
    powers = torch.full((n - 1,), float(rho), dtype=torch.float64).cumprod(0)  # [n − 1] ρ^k (negative ρ too)
    # ρ < 0 cancels: the exact 0 of ρ = −1, n even, can round to −1e-15; a variance is never below 0
    return max(0.0, n * var * (1 + 2 * ((1 - k / n) * powers).sum().item()))


def ar1_fit(t: BetaTable) -> tuple[float, float, float]:
    """(μ, σ, ρ) of the scored tokens: the mean, the standard deviation (divisor N) and the lag-1 autocorrelation,
    pooled over the sequences: ρ = mean over adjacent scored pairs of (β_t − μ)(β_{t+1} − μ), divided by σ². NaN
    without tokens (σ, ρ: without a spread; ρ: without a pair); ρ is clamped to [−1, 1], where every ρ^k series is
    a valid autocorrelation."""
    x = t.beta[t.ok]  # [N]
    mu = mean_or_nan(x)
    var = mean_or_nan((x - mu) ** 2)
    d = torch.where(t.ok, t.beta - mu, torch.zeros_like(t.beta))  # [B, T] deviations, 0 off the tokens
    pair = t.ok[:, :-1] & t.ok[:, 1:]  # [B, T − 1] adjacent scored tokens
    cov = mean_or_nan((d[:, :-1] * d[:, 1:])[pair])
    rho = max(-1.0, min(1.0, cov / var)) if var > 0 and math.isfinite(cov) else math.nan
    return mu, math.sqrt(var) if math.isfinite(var) else math.nan, rho


@dataclass(frozen=True)
class SumModel:
    """The normal model of S_n = Σ of n tokens' β: mean n·μ, standard deviation `sd`."""

    n: int
    mean: float
    sd: float

    def above(self, x: float) -> float:
        """P(S_n > x)."""
        return _tail(self.mean, self.sd, x)

    def quantile(self, p: float) -> float:
        """The p-quantile of S_n."""
        return self.mean + self.sd * _NORMAL.inv_cdf(p)


def sum_model(n: int, mu: float, sigma: float, rho: float) -> SumModel:
    """S_n under the AR(1) model (ρ NaN, no pair measured: independent tokens)."""
    var = ar1_sum_variance(n, sigma**2, 0.0 if math.isnan(rho) else rho)
    return SumModel(n=n, mean=n * mu, sd=math.sqrt(max(var, 0.0)))


def _tail(mean: float, sd: float, x: float) -> float:
    """P(X > x) for X ~ N(mean, sd²); a step at the mean when sd = 0."""
    if sd > 0:
        return 1 - _NORMAL.cdf((x - mean) / sd)
    return float(mean > x)


# ------------------------------------------------------------------------------- settings for a keep share


def _allowed(count: int, share: float) -> int:
    """How many of `count` values may be touched when `share` of them may (the 1e-9 absorbs 1 − 0.99 = 0.0100...)."""
    return math.floor(count * share + 1e-9)


def threshold_above(x: torch.Tensor, allowed: float) -> float:
    """The smallest t with at most floor(len(x)·allowed) values of x strictly above it: the (m+1)-th largest value,
    m = floor(len(x)·allowed); NaN for an empty x."""
    if not x.numel():
        return math.nan
    m = min(_allowed(x.numel(), allowed), x.numel() - 1)
    return torch.sort(x.double(), descending=True).values[m].item()


def threshold_below(x: torch.Tensor, allowed: float) -> float:
    """The largest t with at most floor(len(x)·allowed) values of x strictly below it (threshold_above of −x)."""
    return -threshold_above(-x, allowed)


def _settle(value: float, fine, toward: float) -> float:
    """Step `value` toward `toward` by one float at a time until fine(value): undo the rounding of exp/log1p, so
    the setting leaves the threshold's own token untouched under the strict comparison."""
    while math.isfinite(value) and not fine(value):
        value = math.nextafter(value, toward)
    return value


def _exp(t: float, minus_one: bool = False) -> float:
    """e^t (or e^t − 1), +inf past float64's range instead of OverflowError (a long sequence's S can be large)."""
    try:
        return math.expm1(t) if minus_one else math.exp(t)
    except OverflowError:
        return math.inf


def eps_high_for(t: float) -> float:
    """The smallest ε_high ≥ 0 whose bound log(1 + ε_high) is not below t."""
    if math.isnan(t) or t <= 0:
        return math.nan if math.isnan(t) else 0.0
    return _settle(_exp(t, minus_one=True), lambda e: math.log1p(e) >= t, math.inf)


def eps_low_for(t: float) -> float:
    """The smallest ε_low ≥ 0 whose bound log(1 − ε_low) is not above t (1 when t is −inf-like: e^t rounds to 0)."""
    if math.isnan(t) or t >= 0:
        return math.nan if math.isnan(t) else 0.0
    return _settle(-math.expm1(t), lambda e: e >= 1 or math.log1p(-e) <= t, 1.0)


def cap_for(t: float) -> float:
    """The smallest cap C ≥ 1 with log C not below t."""
    if math.isnan(t) or t <= 0:
        return math.nan if math.isnan(t) else 1.0
    return _settle(_exp(t), lambda c: math.log(c) >= t, math.inf)


def floor_for(t: float) -> float:
    """The largest lower bound L ≤ 1 with log L not above t."""
    if math.isnan(t) or t >= 0:
        return math.nan if math.isnan(t) else 1.0
    return _settle(math.exp(t), lambda c: c <= 0 or math.log(c) <= t, 0.0)


# ---------------------------------------------------------------------------------------------- the knobs


def _token_knob(t: BetaTable, touched: torch.Tensor, setting: dict, keep: dict) -> dict:
    """Shares of a token knob that touches the tokens in `touched` [B, T] (bool, any value off the tokens)."""
    hit = touched & t.ok  # [B, T]
    return {"unit": "token", "setting": setting, "tokens": mean_or_nan(hit[t.ok].double()),
            "sequences": mean_or_nan(hit.any(-1)[t.has].double()), "keep": keep}


def _sequence_knob(t: BetaTable, touched: torch.Tensor, setting: dict, keep: dict) -> dict:
    """Shares of a sequence knob that drops the sequences in `touched` [S] (bool): every token of a dropped
    sequence is touched."""
    tokens = (t.seq_len * touched).sum().item() / t.seq_len.sum().item() if t.seq_len.numel() else math.nan
    return {"unit": "sequence", "setting": setting, "tokens": tokens,
            "sequences": mean_or_nan(touched.double()), "keep": keep}


def clip_knob(t: BetaTable, s: KnobSettings, keep: float) -> dict:
    x = t.beta[t.ok]  # [N]
    below, above = trust_region_split(t.beta, s.eps_low, s.eps_high)  # [B, T] each
    half = (1 - keep) / 2
    out = _token_knob(t, below | above, {"epsilon_low": s.eps_low, "epsilon_high": s.eps_high},
                      {"epsilon_low": eps_low_for(threshold_below(x, half)),
                       "epsilon_high": eps_high_for(threshold_above(x, half))})
    out["tokens_below"] = mean_or_nan(below[t.ok].double())
    out["tokens_above"] = mean_or_nan(above[t.ok].double())
    return out


def _capped(log_w: torch.Tensor, cap: float, truncate: bool) -> torch.Tensor:
    """Log-weights log r [N] as a correction at cap C leaves them: truncated to log C, or −inf (weight 0) past it."""
    log_c = math.log(cap)
    return log_w.clamp(max=log_c) if truncate else log_w.masked_fill(log_w > log_c, -math.inf)


def cap_knob(t: BetaTable, cap: float, keep: float, truncate: bool = True) -> dict:
    """token_truncate (`truncate`) and token_mask at cap C: both touch the tokens with r > C (one truncates, one
    drops them)."""
    out = _token_knob(t, t.beta > math.log(cap), {"cap": cap},
                      {"cap": cap_for(threshold_above(t.beta[t.ok], 1 - keep))})
    out["ess"] = ess_share(_capped(t.beta[t.ok], cap, truncate))
    return out


def icepop_knob(t: BetaTable, low: float, high: float, keep: float) -> dict:
    x, half = t.beta[t.ok], (1 - keep) / 2  # [N]
    touched = (t.beta < math.log(low)) | (t.beta > math.log(high))  # [B, T]
    out = _token_knob(t, touched, {"low": low, "high": high},
                      {"low": floor_for(threshold_below(x, half)), "high": cap_for(threshold_above(x, half))})
    out["ess"] = ess_share(torch.zeros_like(x).masked_fill(touched[t.ok], -math.inf))  # weight 1 kept, 0 dropped
    return out


def sequence_mask_knob(t: BetaTable, cap: float, keep: float, truncate: bool = False) -> dict:
    """sequence_mask, or sequence_truncate (`truncate`), at cap C: both touch the sequences with exp(S) > C."""
    out = _sequence_knob(t, t.seq_sum > math.log(cap), {"cap": cap},
                         {"cap": cap_for(threshold_above(t.seq_sum, 1 - keep))})
    out["ess"] = ess_share(_capped(t.seq_sum, cap, truncate))
    return out


def geo_mask_knob(t: BetaTable, s: KnobSettings, keep: float) -> dict:
    g, half = t.seq_sum / t.seq_len, (1 - keep) / 2  # [S] G_s
    below, above = trust_region_split(g, s.eps_low, s.eps_high)  # [S] each
    return _sequence_knob(t, below | above, {"epsilon_low": s.eps_low, "epsilon_high": s.eps_high},
                          {"epsilon_low": eps_low_for(threshold_below(g, half)),
                           "epsilon_high": eps_high_for(threshold_above(g, half))})


# ---------------------------------------------------------------------------------------- at a length


def _at_length_token(knob: dict, n: int) -> dict:
    """A token knob's share of n-token sequences it touches: 1 − (1 − p)^n, independent tokens."""
    p = knob["tokens"]
    return {"extrapolated": True, "method": "independent tokens",
            "sequences": 1 - (1 - p) ** n if math.isfinite(p) else math.nan}


def _at_length_sequence_mask(m: SumModel, cap: float, keep: float) -> dict:
    """exp(S_n) > C with S_n ~ N(n·μ, sd²); the keep setting is the k-quantile of S_n."""
    return {"extrapolated": True, "method": "AR(1) normal", "sequences": m.above(math.log(cap)),
            "keep": {"cap": cap_for(m.quantile(keep))}}


def _at_length_geo(m: SumModel, s: KnobSettings, keep: float) -> dict:
    """exp(G_n) outside [1 − ε_low, 1 + ε_high] with G_n = S_n / n ~ N(μ, sd²/n²); the keep setting is the
    equal-tailed band of G_n."""
    mean, sd = m.mean / m.n, m.sd / m.n
    lo = math.log1p(-s.eps_low) if s.eps_low < 1 else -math.inf
    share = (1 - _tail(mean, sd, lo)) + _tail(mean, sd, math.log1p(s.eps_high))
    z = _NORMAL.inv_cdf(1 - (1 - keep) / 2)
    return {"extrapolated": True, "method": "AR(1) normal", "sequences": share,
            "keep": {"epsilon_low": eps_low_for(mean - z * sd), "epsilon_high": eps_high_for(mean + z * sd)}}


def knob_figures(beta: torch.Tensor, mask: torch.Tensor, s: KnobSettings, keep: float, length: int) -> dict:
    """Every knob's shares and keep settings on β [B, T] (mask [B, T]) at the sampled lengths, and its `at_length`
    figures extrapolated to `length` tokens when that exceeds EXTRAPOLATE_ABOVE times the sampled mean length (else
    `at_length` is None). Keys in docs/metrics.md ("Knob advice")."""
    t = beta_table(beta, mask)
    mu, sigma, rho = ar1_fit(t)
    mean_len = mean_or_nan(t.seq_len)
    extrapolate = math.isfinite(mean_len) and math.isfinite(sigma) and length > EXTRAPOLATE_ABOVE * mean_len
    knobs = {
        "clip": clip_knob(t, s, keep),
        "token_truncate": cap_knob(t, s.token_cap, keep),
        "token_mask": cap_knob(t, s.token_cap, keep, truncate=False),
        "sequence_mask": sequence_mask_knob(t, s.seq_mask_cap, keep),
        "sequence_truncate": sequence_mask_knob(t, s.seq_mask_cap, keep, truncate=True),
        "geo_mask": geo_mask_knob(t, s, keep),
        "icepop": icepop_knob(t, s.icepop_low, s.icepop_high, keep),
    }
    at: dict[str, dict] = {}
    if extrapolate:
        m = sum_model(length, mu, sigma, rho)
        at = {"sequence_mask": _at_length_sequence_mask(m, s.seq_mask_cap, keep),
              "sequence_truncate": _at_length_sequence_mask(m, s.seq_mask_cap, keep),
              "geo_mask": _at_length_geo(m, s, keep)}
    for name, knob in knobs.items():
        knob["at_length"] = (at.get(name) or _at_length_token(knob, length)) if extrapolate else None
    return {
        "keep_share": keep,
        "length": {"sampled_mean": mean_len, "target": length, "extrapolated": extrapolate},
        "beta": {"tokens": int(t.ok.sum().item()), "sequences": int(t.has.sum().item()), "mean": mu, "std": sigma,
                 "lag1_autocorr": rho},
        **knobs,
    }
