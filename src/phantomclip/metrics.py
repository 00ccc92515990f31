"""Mismatch metrics: pure functions of trainer log-probs, engine log-probs and a mask.

Every figure is defined, with its formula and source, in docs/metrics.md; the dict keys returned here are
the names used there, in the JSON output and in the printed table.

Notation (per scored token t of a completion): ℓ_t = logp_t − logp_engine_t, the log importance ratio
log r_t of a PPO step taken at α = 0 (before the policy has moved). ℓ_t is then pure β: the precision/kernel
gap. r_t = exp(ℓ_t). The trust region is [1 − ε_low, 1 + ε_high] (PPO, Schulman et al. 2017; DAPO's
asymmetric ε, Yu et al. 2025).
"""

from __future__ import annotations

import math

import torch

LOW_P = 0.1
"""engine probability below which a token counts as low-probability."""
HIGH_P = 0.9
"""engine probability above which a token counts as high-probability."""


def mean_or_nan(x: torch.Tensor) -> float:
    """Mean in float64; NaN for an empty tensor (a step or a bucket with no tokens)."""
    return x.double().mean().item() if x.numel() else float("nan")


def quantile_or_nan(x: torch.Tensor, q: float) -> float:
    """q-quantile in float64 (linear interpolation); NaN for an empty tensor."""
    return torch.quantile(x.double(), q).item() if x.numel() else float("nan")


def trust_region_split(log_ratio: torch.Tensor, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(below, above) bool masks: r < 1 − ε_low and r > 1 + ε_high, compared in log space (ε = inf: no bound)."""
    low = math.log1p(-eps_low) if eps_low < 1 else -math.inf
    return log_ratio < low, log_ratio > math.log1p(eps_high)


def phantom_clip_mask(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Tokens whose clipped-surrogate gradient is exactly zero: (A > 0 and r > 1+ε_high) or (A < 0 and r < 1−ε_low).

    At α = 0 every such token is phantom-clipped: the clip fired although the policy did not move.
    """
    below, above = trust_region_split(log_ratio, eps_low, eps_high)
    return ((advantages > 0) & above) | ((advantages < 0) & below)


def kl_estimators(log_ratio: torch.Tensor) -> dict[str, float]:
    """Schulman's k1, k2, k3 estimators of KL(μ‖π) from samples of μ (the engine), with ℓ = log π − log μ.

    k1 = −ℓ (unbiased, high variance), k2 = ℓ²/2 (biased, low variance), k3 = (r − 1) − ℓ (unbiased, ≥ 0).
    http://joschu.net/blog/kl-approx.html
    """
    r = torch.exp(log_ratio.double())
    return {
        "kl_k1": mean_or_nan(-log_ratio),
        "kl_k2": mean_or_nan(0.5 * log_ratio.double() ** 2),
        "kl_k3": mean_or_nan((r - 1) - log_ratio.double()),
    }


def ess_share(log_w: torch.Tensor) -> float:
    """Normalised effective sample size (Σw)² / (n Σw²) in (0, 1], computed stably from log-weights."""
    if log_w.numel() == 0:
        return float("nan")
    lw = log_w.double()
    return (torch.exp(2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0)) / lw.numel()).item()


def mismatch_stats(
    logp: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    seq_mask_cap: float = 3.0,
    advantages: torch.Tensor | None = None,
) -> dict[str, float]:
    """All mismatch figures for one trainer recipe against one engine.

    logp, logp_engine, mask: [B, T] (mask True on scored completion tokens); advantages: [B] or [B, T].
    Non-finite log-probs (fp16 overflow) are counted in `nonfinite` and left out of every other figure.
    """
    mask = mask.bool()
    finite = torch.isfinite(logp) & torch.isfinite(logp_engine)
    ok = mask & finite  # [B, T]
    lr = (logp - logp_engine).double()  # [B, T] log r at α = 0 (= β)
    lr = torch.where(ok, lr, torch.zeros_like(lr))
    beta = lr[ok]  # [N]
    abs_beta = beta.abs()
    below, above = trust_region_split(beta, eps_low, eps_high)
    p_engine = torch.exp(logp_engine.double()[ok])  # [N]
    low, high = p_engine < LOW_P, p_engine > HIGH_P
    low_mean, high_mean = mean_or_nan(abs_beta[low]), mean_or_nan(abs_beta[high])

    # Sequences: Σℓ over a sequence's tokens (TRL sequence modes); geometric mean exp(mean ℓ) (GSPO).
    n_tok = ok.sum(-1)  # [B]
    has = n_tok > 0
    seq_sum = lr.sum(-1)[has]  # [S]
    seq_geo = seq_sum / n_tok[has]  # [S]
    g_below, g_above = trust_region_split(seq_geo, eps_low, eps_high)

    stats = {
        "tokens": int(ok.sum().item()),
        "nonfinite": int((mask & ~finite).sum().item()),
        "beta_mean": mean_or_nan(beta),
        "beta_abs_mean": mean_or_nan(abs_beta),
        "beta_abs_p50": quantile_or_nan(abs_beta, 0.5),
        "beta_abs_p90": quantile_or_nan(abs_beta, 0.9),
        "beta_abs_p99": quantile_or_nan(abs_beta, 0.99),
        "beta_abs_max": abs_beta.max().item() if abs_beta.numel() else float("nan"),
        "outside_trust_region": mean_or_nan((below | above).double()),
        "outside_below": mean_or_nan(below.double()),
        "outside_above": mean_or_nan(above.double()),
        "beta_abs_mean_lowp": low_mean,
        "beta_abs_mean_highp": high_mean,
        "lowp_highp_ratio": low_mean / high_mean if high_mean > 0 else float("nan"),
        "tokens_lowp": int(low.sum().item()),
        "tokens_highp": int(high.sum().item()),
        "sequences": int(has.sum().item()),
        "seq_logratio_mean": mean_or_nan(seq_sum),
        "seq_product_ratio_median": math.exp(quantile_or_nan(seq_sum, 0.5)) if seq_sum.numel() else float("nan"),
        "seq_geo_ratio_mean": mean_or_nan(torch.exp(seq_geo)),
        "seq_geo_outside_trust_region": mean_or_nan((g_below | g_above).double()),
        "seq_mask_drop_share": mean_or_nan((seq_sum > math.log(seq_mask_cap)).double()),
        **kl_estimators(beta),
        "chi2": mean_or_nan((torch.exp(beta) - 1) ** 2),
        "ess_token": ess_share(beta),
        "ess_seq": ess_share(seq_sum),
    }
    if advantages is not None:
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)
        stats["phantom_clip_rate"] = mean_or_nan(phantom_clip_mask(beta, adv[ok], eps_low, eps_high).double())
    return stats


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation; NaN when either side is constant or empty."""
    if x.numel() < 2:
        return float("nan")
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return (x * y).sum().div(denom).item() if denom > 0 else float("nan")


def alpha_beta_stats(
    logp: torch.Tensor,
    logp_shadow: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    zeroed_by_clip: torch.Tensor,
    masked: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> dict[str, float]:
    """One training step's decomposition log r = α + β and its clip accounting (keys in docs/metrics.md).

    α = logp_shadow − logp_engine (real policy change, in the engine's precision), β = logp − logp_shadow
    (trainer vs engine precision on the same weights); both in float64, where the differences of fp32
    log-probs are exact for all but extreme magnitudes, so mean α + mean β = mean log r to rounding (~1e-16).
    `zeroed_by_clip` is the loss's own clip mask (from whatever ratio it clipped on), `masked` the rollout
    correction's; a clipped token is phantom-clipped when the clip on α alone would not have fired.
    logp*, mask, zeroed_by_clip, masked: [B, T]; advantages: [B].
    """
    m = mask.bool()
    adv = advantages[:, None].expand_as(logp)[m].double()  # [N]
    alpha = (logp_shadow.double() - logp_engine.double())[m]  # [N]
    beta = (logp.detach().double() - logp_shadow.double())[m]  # [N]
    log_r = (logp.detach().double() - logp_engine.double())[m]  # [N]
    alpha_clips = phantom_clip_mask(alpha, adv, eps_low, eps_high)  # would the clip fire on α alone?
    clipped = zeroed_by_clip.bool()[m]
    zeroed = clipped | masked.bool()[m]
    b_below, b_above = trust_region_split(beta, eps_low, eps_high)
    abs_adv = adv.abs()
    return {
        "mismatch/log_ratio_mean": mean_or_nan(log_r),
        "mismatch/alpha_mean": mean_or_nan(alpha),
        "mismatch/alpha_abs_mean": mean_or_nan(alpha.abs()),
        "mismatch/beta_mean": mean_or_nan(beta),
        "mismatch/beta_abs_mean": mean_or_nan(beta.abs()),
        "mismatch/beta_abs_p99": quantile_or_nan(beta.abs(), 0.99),
        "mismatch/beta_outside_trust_region": mean_or_nan((b_below | b_above).double()),
        "mismatch/corr_beta_adv": pearson(beta, adv),
        "clip/rate": mean_or_nan(clipped.double()),
        "clip/phantom_rate": mean_or_nan((clipped & ~alpha_clips).double()),
        "clip/real_rate": mean_or_nan((clipped & alpha_clips).double()),
        "clip/masked_rate": mean_or_nan(masked.bool()[m].double()),
        "clip/zeroed_adv_share": (abs_adv[zeroed].sum() / abs_adv.sum()).item() if abs_adv.sum() > 0 else float("nan"),
    }
