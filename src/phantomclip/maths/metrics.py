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
        stats["beta_clip_rate"] = mean_or_nan(phantom_clip_mask(beta, adv[ok], eps_low, eps_high).double())
    return stats


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation; NaN when either side is constant or empty."""
    if x.numel() < 2:
        return float("nan")
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = (x.square().sum() * y.square().sum()).sqrt()
    return (x * y).sum().div(denom).item() if denom > 0 else float("nan")


def _part_stats(name: str, x: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """mean, mean |.|, p99 |.| and the share outside the trust region of one part of log r (float64, [N])."""
    below, above = trust_region_split(x, eps_low, eps_high)
    return {
        f"mismatch/{name}_mean": mean_or_nan(x),
        f"mismatch/{name}_abs_mean": mean_or_nan(x.abs()),
        f"mismatch/{name}_abs_p99": quantile_or_nan(x.abs(), 0.99),
        f"mismatch/{name}_outside_trust_region": mean_or_nan((below | above).double()),
    }


def ratio_split(
    logp: torch.Tensor, logp_shadow: torch.Tensor, logp_shadow_old: torch.Tensor, logp_engine: torch.Tensor,
    logp_plain_shadow: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The exact three-way split of log r = logp − logp_engine, per token, in float64 (all [B, T]):

        α           = logp_shadow(θ_t) − logp_shadow(θ_old)   the policy's change, one forward (engine recipe)
                                                              on both sides
        β_kernel    = logp_shadow(θ_old) − logp_engine(θ_old)  same weights and dtype, the engine's kernels
                                                               (decode path)
        β_precision = logp(θ_t) − logp_shadow(θ_t)             the trainer's recipe against the engine's
        β           = β_kernel + β_precision                   the whole mismatch

    α + β_kernel + β_precision telescopes to log r. The difference of two fp32 values is exact in float64 unless
    their magnitudes differ by more than 2^29 (24 significant bits each, 53 in float64), so per token the identity
    holds to the rounding of two float64 additions (a few 1e-16 of |log r|).

    With an FP8 engine the shadow carries the engine's quantisers, and `logp_plain_shadow` is the same recipe
    without them at θ_t; β_precision then splits once more (one float64 addition more in the identity):

        β_quant     = logp_plain_shadow(θ_t) − logp_shadow(θ_t)  the quantisers alone (β = trainer − engine, so the
                                                                   engine's quantisation enters with a minus sign)
        β_precision = logp(θ_t) − logp_plain_shadow(θ_t)        the trainer's recipe against the unquantised engine's
    """
    lp, sh, sh_old, eng = (t.detach().double() for t in (logp, logp_shadow, logp_shadow_old, logp_engine))
    if logp_plain_shadow is None:
        beta_kernel, beta_precision = sh_old - eng, lp - sh
        return {"alpha": sh - sh_old, "beta_kernel": beta_kernel, "beta_precision": beta_precision,
                "beta": beta_kernel + beta_precision, "log_ratio": lp - eng}
    plain = logp_plain_shadow.detach().double()
    beta_kernel, beta_quant, beta_precision = sh_old - eng, plain - sh, lp - plain
    return {"alpha": sh - sh_old, "beta_kernel": beta_kernel, "beta_quant": beta_quant,
            "beta_precision": beta_precision, "beta": beta_kernel + beta_quant + beta_precision, "log_ratio": lp - eng}


def alpha_beta_stats(
    split: dict[str, torch.Tensor],
    mask: torch.Tensor,
    advantages: torch.Tensor,
    zeroed_by_clip: torch.Tensor,
    masked: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> dict[str, float]:
    """One training step's decomposition log r = α + β_kernel + β_precision and its clip accounting (keys in
    docs/metrics.md). `split` is `ratio_split(...)`.

    `zeroed_by_clip` is the loss's own clip mask (from whatever ratio it clipped on), `masked` the rollout
    correction's. A clipped token is phantom-clipped when the clip on α alone would not have fired: its gradient
    was lost to the mismatch (kernel or precision), not to the policy's own move.
    mask, zeroed_by_clip, masked: [B, T]; advantages: [B].
    """
    m = mask.bool()
    adv = advantages[:, None].expand_as(m)[m].double()  # [N]
    part = {name: x[m] for name, x in split.items()}  # each [N]
    alpha_clips = phantom_clip_mask(part["alpha"], adv, eps_low, eps_high)  # would the clip fire on α alone?
    clipped = zeroed_by_clip.bool()[m]
    phantom = clipped & ~alpha_clips
    zeroed = clipped | masked.bool()[m]
    abs_adv = adv.abs()
    adv_sum = abs_adv.sum().item()
    share_of_adv = lambda sel: abs_adv[sel].sum().item() / adv_sum if adv_sum > 0 else float("nan")  # noqa: E731
    stats = {"mismatch/tokens": int(m.sum().item()), "mismatch/log_ratio_mean": mean_or_nan(part["log_ratio"])}
    for name in ("alpha", "beta", "beta_kernel", "beta_precision", "beta_quant"):
        if name in part:  # beta_quant: FP8 engines only
            stats.update(_part_stats(name, part[name], eps_low, eps_high))
    return {
        **stats,
        "mismatch/corr_beta_adv": pearson(part["beta"], adv),
        "clip/rate": mean_or_nan(clipped.double()),
        "clip/phantom_rate": mean_or_nan(phantom.double()),
        "clip/real_rate": mean_or_nan((clipped & alpha_clips).double()),
        "clip/masked_rate": mean_or_nan(masked.bool()[m].double()),
        "clip/zeroed_adv_share": share_of_adv(zeroed),
        "clip/phantom_adv_share": share_of_adv(phantom),
        "adv/abs_sum": adv_sum,
    }


RUN_WINDOW = 5
"""steps at each end of a run over which 'start' and 'end' figures are averaged (a single step is noisy: one
batch of a few hundred tokens)."""


PROB_EDGES = (0.0, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
"""engine-probability bucket edges of the shift-share decomposition: finer at both ends, where |β| differs most
(low-probability tokens carry tens of times the |β| of confident ones)."""


def prob_buckets(logp_engine: torch.Tensor, edges: tuple[float, ...] = PROB_EDGES) -> torch.Tensor:
    """Bucket index (0 .. len(edges) − 2) of each token's engine probability p = exp(logp_engine): bucket i holds
    edges[i] <= p < edges[i+1], the last one also p = 1 (a NaN log-prob lands in the last bucket: leave such tokens
    out, as shift_share does by their value)."""
    p = logp_engine.double().exp()  # [N]
    inner = torch.tensor(edges[1:-1], dtype=torch.float64, device=p.device)
    return torch.bucketize(p, inner, right=True)  # [N]


def bucket_means(values: torch.Tensor, buckets: torch.Tensor, n_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, m) over buckets [K]: w_k the share of tokens in bucket k, m_k the mean of `values` there (NaN if empty)."""
    counts = torch.bincount(buckets, minlength=n_buckets).double()  # [K]
    sums = torch.zeros(n_buckets, dtype=torch.float64, device=values.device).index_add_(0, buckets, values.double())
    w = counts / counts.sum() if counts.sum() > 0 else counts
    return w, torch.where(counts > 0, sums / counts.clamp(min=1), torch.full_like(sums, float("nan")))


def shift_share(
    values_a: torch.Tensor, buckets_a: torch.Tensor, values_b: torch.Tensor, buckets_b: torch.Tensor, n_buckets: int,
) -> dict[str, float]:
    """The change of a mean between two token sets A and B (e.g. |β| at two snapshots of a run), split exactly into
    the part due to the bucket mix and the part within buckets (a shift-share decomposition):

        mean_B − mean_A = Σ_k (w_B − w_A) m_A   [mix: which buckets the tokens fall in]
                        + Σ_k w_A (m_B − m_A)   [within: the mean at a given bucket]
                        + Σ_k (w_B − w_A)(m_B − m_A)   [interaction]

    with w the bucket shares and m the bucket means (`bucket_means`). The three terms add up to the change for any
    m of an empty bucket (its w is 0 on that side); an empty bucket takes the other side's mean, so all of its change
    counts as mix. values_*: [N_*] float; buckets_*: [N_*] int in 0 .. n_buckets − 1. A non-finite value (a token
    with a NaN log-prob) is left out with its bucket, on either side.
    """
    keep_a, keep_b = values_a.isfinite(), values_b.isfinite()  # [N_a], [N_b]
    values_a, buckets_a, values_b, buckets_b = values_a[keep_a], buckets_a[keep_a], values_b[keep_b], buckets_b[keep_b]
    w_a, m_a = bucket_means(values_a, buckets_a, n_buckets)
    w_b, m_b = bucket_means(values_b, buckets_b, n_buckets)
    m_a, m_b = torch.where(m_a.isnan(), m_b, m_a), torch.where(m_b.isnan(), m_a, m_b)
    m_a, m_b = m_a.nan_to_num(0.0), m_b.nan_to_num(0.0)  # empty on both sides: w is 0 on both, any m will do
    mix, within, both = ((w_b - w_a) * m_a).sum(), (w_a * (m_b - m_a)).sum(), ((w_b - w_a) * (m_b - m_a)).sum()
    return {"mean_a": mean_or_nan(values_a), "mean_b": mean_or_nan(values_b),
            "change": mean_or_nan(values_b) - mean_or_nan(values_a),
            "mix": mix.item(), "within": within.item(), "interaction": both.item()}


def _token_weighted(rows: list[dict], key: str, weight: str = "mismatch/tokens") -> float:
    """Σ key·weight / Σ weight over rows (rows whose key is NaN or missing are left out); NaN when none remain."""
    pairs = [(r[key], r[weight]) for r in rows if r.get(key) is not None and math.isfinite(r[key]) and r.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else float("nan")


def run_phantom_summary(rows: list[dict], window: int = RUN_WINDOW) -> dict[str, float]:
    """Whole-run clip accounting from a run's metric rows (each step weighted by its token count, or by its Σ|A|
    for the advantage share), so a run is read over all its steps rather than a window chosen in advance.

    phantom_rate: phantom-clipped tokens / all tokens; phantom_rate_last: the same over the last `window` steps;
    phantom_share_of_clipped: phantom-clipped / clipped tokens; phantom_adv_share: Σ|A| over phantom-clipped tokens
    / Σ|A|; beta_abs_mean_start / _end: mean |β| over the first / last `window` steps, and end / start;
    beta_outside_end: share of tokens whose β alone is outside the trust region over the last `window` steps.
    """
    first, last = rows[:window], rows[-window:]
    clip_rate = _token_weighted(rows, "clip/rate")
    phantom = _token_weighted(rows, "clip/phantom_rate")
    start, end = _token_weighted(first, "mismatch/beta_abs_mean"), _token_weighted(last, "mismatch/beta_abs_mean")
    return {
        "phantom_rate": phantom,
        "phantom_rate_last": _token_weighted(last, "clip/phantom_rate"),
        "clip_rate": clip_rate,
        "phantom_share_of_clipped": phantom / clip_rate if clip_rate > 0 else float("nan"),
        "phantom_adv_share": _token_weighted(rows, "clip/phantom_adv_share", weight="adv/abs_sum"),
        "beta_abs_mean_start": start,
        "beta_abs_mean_end": end,
        "beta_growth": end / start if start > 0 else float("nan"),
        "beta_outside_end": _token_weighted(last, "mismatch/beta_outside_trust_region"),
    }


# Two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30 (any statistics table, e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.2); beyond 30 the Cornish-Fisher expansion around the normal quantile is within 1e-3.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """t_{0.975} with `df` degrees of freedom (df ≥ 1)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 values (df >= 1), got df = {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: list[float]) -> dict[str, float]:
    """Mean and two-sided 95% Student-t interval, mean ± t_{0.975, n−1} · s / √n (s: the unbiased std).

    Assumes the values are independent draws (one per seed); with n = 1 the interval is NaN (unknown), and NaN
    values (a figure a run could not measure) are left out, with n counting only the rest."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    mean = sum(xs) / n
    if n == 1:
        return {"mean": mean, "low": float("nan"), "high": float("nan"), "n": 1}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile_975(n - 1) * sd / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}
