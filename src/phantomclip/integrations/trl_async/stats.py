"""The async monitor's figures over every rank's tokens (integrations.trl_async): the decomposition of TRL's
ratio log r = α + β_precision + β_kernel per token, the clip on log r against the clip on α alone, and the staleness
of the tokens, each as a float64 sum reduced across ranks (as `ranks.precision_stats` does for GRPOTrainer), and the
p99 of |β| exactly from each rank's largest values."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...maths.metrics import phantom_clip_mask
from ..ranks import P99, top_quantile


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_SUMS = ("tokens", "alpha_sum", "alpha_abs_sum", "beta_sum", "beta_abs_sum", "beta_kernel_abs_sum",
         "beta_precision_abs_sum", "clip", "alpha_clip", "phantom", "nonfinite", "no_shadow", "trained")
"""the float64 sums and counts reduced across ranks, in this order, then one count per staleness. `tokens`: those
the figures are over (every input finite); `trained`: every trained token, over which staleness is counted."""
MEANS = {"alpha_mean": "alpha_sum", "alpha_abs_mean": "alpha_abs_sum", "beta_mean": "beta_sum",
         "beta_abs_mean": "beta_abs_sum", "beta_kernel_abs_mean": "beta_kernel_abs_sum",
         "beta_precision_abs_mean": "beta_precision_abs_sum", "clip_rate": "clip", "alpha_clip_rate": "alpha_clip",
         "phantom_rate": "phantom"}
"""logged key -> its sum; each is that sum over the token count (definitions: docs/metrics.md)."""


def async_precision_stats(logp: torch.Tensor, logp_engine: torch.Tensor, logp_shadow: torch.Tensor,
                          logp_shadow_old: torch.Tensor, advantages: torch.Tensor, staleness: torch.Tensor, *,
                          eps_low: float, eps_high: float, max_staleness: int) -> dict:
    """The async monitor's figures over every rank's tokens. All tensors are per trained token [M] (M may be 0 on a
    rank): the loss's own log-probs, the server's, the current weights' shadow, the sample version's shadow, the
    advantage and the staleness. Returns {"sums": global sums (keys _SUMS, then staleness_<k> for k = 0 ..
    max_staleness and staleness_over), "beta_abs_p99": float}. A token whose version has no shadow (logp_shadow_old
    NaN, the rest finite) is left out of every figure and counted in `no_shadow`; one with another non-finite input
    in `nonfinite`. The staleness is counted over every trained token, with or without its shadow: `staleness_over`
    counts those trained more than max_staleness versions late (TRL's filter runs at dequeue, before the prefetch's
    syncs: trl_async.versions).

    log r = logp − logp_engine (TRL's ratio) = α + β; α = logp_shadow − logp_shadow_old; β = β_precision + β_kernel,
    β_precision = logp − logp_shadow, β_kernel = logp_shadow_old − logp_engine. `clip`: TRL's clip fires on log r
    given the advantage (metrics.phantom_clip_mask); `alpha_clip`: it would fire on α alone; `phantom`: the first
    without the second. Collectives: one all-reduce and one all-gather, on every rank at every call."""
    parts = (logp, logp_engine, logp_shadow, logp_shadow_old)
    ok = torch.ones_like(logp, dtype=torch.bool)  # [M]
    for x in parts:
        ok &= torch.isfinite(x)
    lp, le, ls, lo = (x.double()[ok] for x in parts)  # [n] each: fp32 values, differences taken in float64
    adv = advantages.double()[ok]
    alpha, beta_p, beta_k = ls - lo, lp - ls, lo - le
    beta = beta_p + beta_k
    clip = phantom_clip_mask(lp - le, adv, eps_low, eps_high)
    alpha_clip = phantom_clip_mask(alpha, adv, eps_low, eps_high)
    no_shadow = torch.isnan(logp_shadow_old) & torch.isfinite(logp) & torch.isfinite(logp_engine) & torch.isfinite(
        logp_shadow)  # [M]
    local = [alpha.numel(), alpha.sum(), alpha.abs().sum(), beta.sum(), beta.abs().sum(), beta_k.abs().sum(),
             beta_p.abs().sum(), clip.sum(), alpha_clip.sum(), (clip & ~alpha_clip).sum(), (~ok & ~no_shadow).sum(),
             no_shadow.sum(), logp.numel()]
    local += [(staleness == k).sum() for k in range(max_staleness + 1)] + [(staleness > max_staleness).sum()]
    sums = torch.tensor([float(v) for v in local], dtype=torch.float64, device=logp.device)
    if _world() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    names = [*_SUMS, *(f"staleness_{k}" for k in range(max_staleness + 1)), "staleness_over"]
    total = dict(zip(names, sums.tolist()))
    n = int(total["tokens"])
    k = max(n - math.floor(P99 * (n - 1)), 1) if n else 1  # the same on every rank: n is global
    mine = beta.abs().topk(min(k, beta.numel())).values  # [≤ k]
    top = torch.cat([mine, mine.new_full((k - mine.numel(),), -math.inf)])  # [k]
    if _world() > 1:
        gathered = [torch.empty_like(top) for _ in range(_world())]
        dist.all_gather(gathered, top)
        top = torch.cat(gathered)
    return {"sums": total, "beta_abs_p99": top_quantile(top, n, P99)}


def async_figures(stats: dict) -> dict[str, float]:
    """The logged figures of one `async_precision_stats` result as plain numbers (NaN without tokens)."""
    s = stats["sums"]
    n = s["tokens"]
    out = {key: (s[name] / n if n else math.nan) for key, name in MEANS.items()}
    m = s["trained"]
    out.update({key.replace("staleness_", "staleness_share_"): (v / m if m else math.nan)
                for key, v in s.items() if key.startswith("staleness_")})
    out["beta_abs_p99"] = stats["beta_abs_p99"]
    out["nonfinite_total"] = s["nonfinite"]
    out["no_shadow_total"] = s["no_shadow"]
    return out


OFFPOLICY_PAIRS = ("staleness_mean", "clip_rate", "weight_mean", "capped_share")
"""the fix's off-policy figures logged as (sum, count) pairs (definitions: docs/metrics.md, "offpolicy/*")."""


def offpolicy_stats(staleness: torch.Tensor, clip_log: torch.Tensor, advantages: torch.Tensor,
                    weight: torch.Tensor | None, capped: torch.Tensor | None, missing: torch.Tensor, *,
                    substitute: torch.Tensor | None = None, eps_low: float, eps_high: float, bound: int) -> dict:
    """What the fix logs on every micro-batch under every ratio, over every rank's trained tokens [M]: their
    staleness, |α| per staleness k = 0 .. bound (α: the log-ratio the fix's clip decides on, the policy's move since
    the sample's version as that ratio measures it: 0 by definition under "decoupled"), the share the clip cuts,
    and the importance weight on the advantage (None: 1): its mean, max, effective sample size (Σw)² / (n·Σw²) and
    the share outside [floor, cap]. `missing`: tokens whose version has no kept copy and none newer (clipped against
    μ: left out of |α| and the clip rate, counted in no_copy_total). `substitute` (None: none): tokens clipped
    against a kept version newer than their own ("trust-region" keeping fewer versions than a token may have): the
    clip decides on their logged ratio, so they count in the clip rate, but that ratio is not the move since their
    own version, so they are left out of |α| per staleness and counted in substitute_total. Returns {"pairs": {key:
    (sum, count)}, "max": {key: value}, "weight_ess", "no_copy_total", "substitute_total"}. Collectives: one sum and
    one max all-reduce, on every rank at every call."""
    from ...maths.metrics import phantom_clip_mask

    n = staleness.numel()
    w = torch.ones_like(clip_log, dtype=torch.float64) if weight is None else weight.double()  # [M]
    capped = torch.zeros_like(missing) if capped is None else capped
    substitute = torch.zeros_like(missing) if substitute is None else substitute & ~missing
    have = ~missing  # [M] the clip decided on a kept version's ratio
    own = have & ~substitute  # [M] ... on the move since the token's own version
    a, st = clip_log.double()[own].abs(), staleness[own]
    cut = phantom_clip_mask(clip_log.double()[have], advantages.double()[have], eps_low, eps_high)
    local = [n, float(staleness.sum()), float(have.sum()), float(cut.sum()), float(w.sum()), float((w * w).sum()),
             float(capped.sum()), float(missing.sum()), float(substitute.sum())]
    for k in range(bound + 1):
        local += [float(a[st == k].sum()), float((st == k).sum())]
    sums = torch.tensor(local, dtype=torch.float64, device=clip_log.device)
    peaks = torch.tensor([float(staleness.max()) if n else -math.inf, float(w.max()) if n else -math.inf],
                         dtype=torch.float64, device=clip_log.device)
    if _world() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    s = sums.tolist()
    pairs = {"staleness_mean": (s[1], s[0]), "clip_rate": (s[3], s[2]), "weight_mean": (s[4], s[0]),
             "capped_share": (s[6], s[0])}
    pairs.update({f"alpha_abs_mean_s{k}": (s[9 + 2 * k], s[10 + 2 * k]) for k in range(bound + 1)})
    ess = s[4] ** 2 / (s[0] * s[5]) if s[0] and s[5] else math.nan
    return {"pairs": pairs, "max": {"staleness_max": peaks[0].item(), "weight_max": peaks[1].item()},
            "weight_ess": ess, "no_copy_total": s[7], "substitute_total": s[8]}


def offpolicy_figures(stats: dict) -> dict[str, float]:
    """One `offpolicy_stats` result as plain numbers (NaN where a count is 0)."""
    out = {k: (num / den if den else math.nan) for k, (num, den) in stats["pairs"].items()}
    out.update(stats["max"])
    for key in ("weight_ess", "no_copy_total", "substitute_total"):
        out[key] = stats[key]
    return out
