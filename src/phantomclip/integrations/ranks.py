"""The monitor's figures over every rank's tokens: the same numbers on each rank as one process on the whole batch.

TRL reduces or gathers each of its own figures across ranks before it appends it to `_metrics`, and `log()` then
averages each rank's list while only rank 0 writes to the trackers (trl 1.16 trainer/grpo_trainer.py: `gather` for
rewards and lengths, a reduce of sums and counts in `global_masked_mean` for entropy and clip ratios). A figure
appended from one rank's tokens would be rank 0's alone, and a p99 cannot be averaged across ranks at all. Here:

- means and rates: one all-reduce of float64 sums and counts (token-weighted, as `global_masked_mean`);
- the p99 of |β|: exact, from each rank's largest values. Linear interpolation between the sorted values at ranks
  ⌊0.99 (N−1)⌋ and the one above (torch.quantile's rule) needs only the top k = N − ⌊0.99 (N−1)⌋ values of the N
  global ones, so each rank sends its own top k (padded with −inf): about 1% of its tokens, not all of them.

Both collectives run on every rank, in this order, at every call, whatever the rank holds (no token, NaN only): a
rank never skips one, so none waits forever. Without an initialised process group (one process) they are skipped
and the figures are the local ones, from the same code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..maths.metrics import phantom_clip_mask, trust_region_split

P99 = 0.99
_SUMS = ("tokens", "beta_sum", "beta_abs_sum", "outside", "phantom", "nonfinite", "alpha_sum", "alpha_tokens")
"""the float64 sums and counts reduced across ranks, in this order."""


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if _world() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    """[world * k] from each rank's [k] (k equal on every rank)."""
    world = _world()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def top_quantile(top: torch.Tensor, n: int, q: float) -> float:
    """torch.quantile(values, q) (linear) of n values of which `top` holds the largest, at least n − ⌊q (n−1)⌋ of
    them (any order, −inf padding allowed). NaN for n = 0."""
    if n == 0:
        return float("nan")
    desc = top.double().sort(descending=True).values  # desc[j] = the value at ascending rank n − 1 − j
    pos = q * (n - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    below, above = desc[n - 1 - lo], desc[n - 1 - hi]
    return torch.lerp(below, above, pos - lo).item()


def precision_stats(logp: torch.Tensor, logp_shadow: torch.Tensor, mask: torch.Tensor,
                           advantages: torch.Tensor, eps_low: float, eps_high: float,
                           logp_engine: torch.Tensor | None = None) -> dict[str, float]:
    """The monitor's figures over all ranks' tokens (keys of `integrations.trl.MONITOR_KEYS`, + shadow_minus_engine_mean
    with engine log-probs). Per-token tensors are [B, T] (advantages [B], [B, 1] or [B, T]), B may be 0 on a rank.

    β = logp − logp_shadow. A token whose logp or logp_shadow is not finite is left out of every β figure and
    counted in `nonfinite`; shadow_minus_engine_mean = mean(logp_shadow − logp_engine) (α + β_kernel, not α) over the
    tokens where both are finite.
    A figure with no token left on any rank is NaN. Definitions: docs/metrics.md (the TRL monitor's block).
    """
    m = mask.bool()  # [B, T]
    adv = advantages if advantages.dim() == 2 and advantages.shape[1] > 1 else advantages.reshape(-1, 1)
    adv = adv.expand_as(logp)  # [B, T]
    ok = m & torch.isfinite(logp) & torch.isfinite(logp_shadow)  # [B, T]
    beta = (logp - logp_shadow).double()[ok]  # [n] the same fp32 difference as metrics.mismatch_stats
    below, above = trust_region_split(beta, eps_low, eps_high)
    phantom = phantom_clip_mask(beta, adv[ok], eps_low, eps_high)
    if logp_engine is not None:
        ok_a = m & torch.isfinite(logp_shadow) & torch.isfinite(logp_engine)
        alpha = (logp_shadow.double() - logp_engine.double())[ok_a]  # [n_α]
    else:
        alpha = beta.new_zeros(0)
    local = [beta.numel(), beta.sum(), beta.abs().sum(), (below | above).sum(), phantom.sum(),
             (m & ~ok).sum(), alpha.sum(), alpha.numel()]
    sums = _all_reduce_sum(torch.tensor([float(v) for v in local], dtype=torch.float64, device=logp.device))
    total = dict(zip(_SUMS, sums.tolist()))
    n = int(total["tokens"])
    k = max(n - math.floor(P99 * (n - 1)), 1) if n else 1  # the same on every rank: n is global
    mine = beta.abs().topk(min(k, beta.numel())).values  # [≤ k]
    padded = torch.cat([mine, mine.new_full((k - mine.numel(),), -math.inf)])  # [k]
    tops = _all_gather(padded)  # [world * k]

    def rate(x: float, d: float) -> float:
        return x / d if d else float("nan")

    out = {
        "beta_mean": rate(total["beta_sum"], n),
        "beta_abs_mean": rate(total["beta_abs_sum"], n),
        "beta_abs_p99": top_quantile(tops, n, P99),
        "outside_trust_region": rate(total["outside"], n),
        "beta_clip_rate": rate(total["phantom"], n),
        "nonfinite": int(total["nonfinite"]),
    }
    if logp_engine is not None:
        out["shadow_minus_engine_mean"] = rate(total["alpha_sum"], total["alpha_tokens"])
    return out


def route_flip_stats(flips: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float]:
    """The route-flip figures of an MoE policy over every rank's real positions: `route_flip_rate` (share of
    (position, MoE layer) pairs whose expert set differs between the trainer's forward and the shadow's) and
    `route_any_flip_share` (share of positions with a flip in some layer). flips: [layers, B·T] bool or None (the
    forwards' routes did not line up: this rank counts nothing); mask: [B, T] real positions. One all-reduce, on every
    rank, whatever it holds."""
    real = mask.reshape(-1).bool().cpu()  # [B·T]
    sums = torch.zeros(4, dtype=torch.float64)
    if flips is not None:
        f = flips[:, real]  # [layers, N]
        sums += torch.tensor([f.sum().item(), f.numel(), f.any(0).sum().item(), f.shape[1]], dtype=torch.float64)
    sums = _all_reduce_sum(sums.to(mask.device)).cpu()
    rate = lambda x, d: x / d if d > 0 else math.nan  # noqa: E731
    return {"route_flip_rate": rate(sums[0].item(), sums[1].item()),
            "route_any_flip_share": rate(sums[2].item(), sums[3].item())}
