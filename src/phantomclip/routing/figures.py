"""Two forwards' expert routes compared (routing/routes.py captures and replays them): where the chosen expert sets
differ (flips) per layer and over all, the router's top-k margins there, the exact split of β into β_route (the
trainer's own routes against the engine's) and β_rest, and a job's route table built from them.
"""

from __future__ import annotations

import torch

from ..maths.metrics import mean_or_nan, quantile_or_nan, trust_region_split
from .routes import Routes


def flips(a: Routes, b: Routes) -> torch.Tensor:
    """[layers, B, T] bool: the top-k expert *sets* differ (the order within the k does not count)."""
    return (a.ids.sort(dim=-1).values != b.ids.sort(dim=-1).values).any(dim=-1)


MARGIN_QUANTILES = (0.01, 0.1, 0.5)
"""quantiles of the router's top-k margin reported per layer."""


def flips_at(own: Routes, ref: Routes, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([layers, N] bool flips, [B, T] bool positions): `flips` at the N positions of `where` [B, T] that both
    routed."""
    at = where.bool() & own.valid & ref.valid  # [B, T]
    return flips(own, ref)[:, at], at


def flip_shares(flip: torch.Tensor) -> tuple[float, float]:
    """(share of (layer, position) choices that differ, share of positions that differ in some layer) of `flip`
    [layers, N] bool; NaN without positions."""
    return mean_or_nan(flip.double()), mean_or_nan(flip.any(0).double())


def route_stats(own: Routes, ref: Routes, where: torch.Tensor) -> dict:
    """Per MoE layer and over all: how often `own` (the trainer's routes) chose another expert set than `ref` (the
    engine's) at the positions `where` [B, T] bool that both routed, and the trainer's top-k margins there (keys in
    docs/metrics.md, `routing`)."""
    flip, at = flips_at(own, ref, where)  # [layers, N], [B, T]
    margin = own.margin[:, at]  # [layers, N]
    per_layer = []
    for layer in range(own.layers):
        m, f = margin[layer].double(), flip[layer]
        row = {"layer": layer, "flip_rate": mean_or_nan(f.double())}
        row.update({f"margin_p{round(q * 100):02d}": quantile_or_nan(m, q) for q in MARGIN_QUANTILES})
        row["margin_flipped_median"] = quantile_or_nan(m[f], 0.5)
        per_layer.append(row)
    first = flip.double().argmax(0) if flip.numel() else flip.new_zeros(0)  # [N] first flipped layer (0 if none)
    any_flip = flip.any(0)  # [N]
    flip_rate, any_flip_share = flip_shares(flip)
    return {
        "positions": int(at.sum()),
        "flip_rate": flip_rate,
        "any_flip_share": any_flip_share,
        "first_flip_layer_mean": mean_or_nan(first[any_flip].double()),
        "layers": per_layer,
    }


def part_stats(x: torch.Tensor, eps_low: float, eps_high: float) -> dict:
    """mean |.|, p99 |.|, max |.| and the share of tokens outside the trust region of one part of β ([N] float64):
    the share is how many tokens this part alone would push into phantom clipping."""
    below, above = trust_region_split(x, eps_low, eps_high)
    a = x.abs()
    return {"abs_mean": mean_or_nan(a), "abs_p99": quantile_or_nan(a, 0.99),
            "abs_max": a.max().item() if a.numel() else float("nan"),
            "outside_trust_region": mean_or_nan((below | above).double())}


def route_split(logp_own: torch.Tensor, logp_replayed: torch.Tensor, logp_engine: torch.Tensor) -> dict:
    """β = logp_own − logp_engine split per token in float64 ([B, T] each): β_route = logp_own − logp_replayed (the
    trainer's own routes against the engine's, same weights and recipe) and β_rest = logp_replayed − logp_engine
    (everything else at the engine's routes). Differences of fp32 values are exact in float64 (unless their
    magnitudes differ by more than 2^29), so β_route + β_rest == β exactly."""
    own, rep, eng = (t.detach().double() for t in (logp_own, logp_replayed, logp_engine))
    return {"beta": own - eng, "beta_route": own - rep, "beta_rest": rep - eng}


def route_figures(engine: Routes, own: dict[str, Routes], where: torch.Tensor, experts: int, split_recipe: str,
                  split: dict[str, torch.Tensor], mask: torch.Tensor, eps_low: float, eps_high: float,
                  source: str = "local engine decode") -> dict:
    """A job's route table (keys in docs/metrics.md, `routing`): what the engine routed, each recipe's routes against
    the engine's (`route_stats` at the real positions `where` [n, T]), and for `split_recipe` the split of its β at
    the sampled tokens `mask` [n, T] (`route_split`) with each part's size and the share of tokens it alone puts
    outside the trust region (the phantom-clip-prone share by cause)."""
    tokens = mask.bool() & torch.isfinite(split["beta"])  # [n, T]
    parts = {name: part_stats(x[tokens], eps_low, eps_high) for name, x in split.items()}
    out = {"engine": {"source": source, "layers": engine.layers, "experts": experts,
                      "k": engine.ids.shape[-1], "positions": int((where.bool() & engine.valid).sum()),
                      "route_bytes": engine.nbytes(with_weights=False)}}
    for name, r in own.items():
        out[name] = route_stats(r, engine, where)
    out[split_recipe] = {**out.get(split_recipe, {}), "tokens": int(tokens.sum()), **parts,
                         "route_touched_share": mean_or_nan((split["beta_route"][tokens] != 0).double())}
    return out
