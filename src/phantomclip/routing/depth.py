"""Where expert-routing flips start along the depth (`trace` on an MoE model), and whether each flip is the router's
own rounding at a near-tie or the error the hidden state carried into the router.

Both models run the same tokens in one pass. Per MoE layer: the share of positions whose expert set differs between
the traced recipe and the reference (a flip), the share whose *first* flip (in depth) is at this layer, and the
traced recipe's router run on the reference's own router input: where that alone picks another set, the flip is
local (the router's arithmetic in the recipe's precision crossed the top-k margin); where the recipe flipped but its
router on the reference's input did not, the flip follows the error the hidden state carried in from below.
"""

from __future__ import annotations

import torch
from torch import nn

from ..maths.metrics import mean_or_nan, quantile_or_nan
from ..precision.recipes import Recipe, forward_context
from ..precision.scoring import score
from . import routes as routing
from .figures import flips


def _routes_and_inputs(model: nn.Module, recipe: Recipe, ids: torch.Tensor,
                       attn: torch.Tensor) -> tuple[routing.Routes, list[torch.Tensor]]:
    """The routes of one full forward and each MoE layer's router input [B·T, H] (detached)."""
    inputs: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach().reshape(
        -1, args[0].shape[-1]))) for r, _ in routing.routers(model)]
    try:
        with routing.capture(model) as rec:
            score(model, recipe, ids, attn, entropy=False)
    finally:
        for h in handles:
            h.remove()
    B, T = ids.shape
    return rec.routes(routing.full_layout(T), B, T), inputs


@torch.no_grad()
def route_depth(model: nn.Module, recipe: Recipe, ref_model: nn.Module, reference: Recipe,
                packed: dict[str, torch.Tensor]) -> dict:
    """`trace`'s `routing` figures (docs/metrics.md): per MoE layer the flip rate of `recipe` against `reference`
    over the batch's real positions, where first flips happen, and the local / carried-in split of the flips."""
    ids, attn = packed["input_ids"], packed["attention_mask"]
    where = attn.bool().cpu()  # [B, T]
    ref, ref_inputs = _routes_and_inputs(ref_model, reference, ids, attn)
    mine, _ = _routes_and_inputs(model, recipe, ids, attn)
    flip = flips(mine, ref)[:, where]  # [layers, N]
    first = torch.zeros_like(flip)
    first[flip.double().argmax(0), torch.arange(flip.shape[1])] = True
    first &= flip.any(0)  # [layers, N]: the first flipped layer of each position with a flip
    rows = []
    for layer, (router, _) in enumerate(routing.routers(model)):
        with forward_context(recipe, ids.device):
            weight = next(router.parameters())
            _, _, local_ids = router(ref_inputs[layer].to(weight.dtype))  # [B·T, k]: the recipe's router, same input
        local = (local_ids.sort(-1).values.cpu() != ref.ids[layer].reshape(-1, local_ids.shape[-1]).long()
                 .sort(-1).values).any(-1).reshape(where.shape)[where]  # [N]
        f = flip[layer]
        rows.append({
            "layer": layer, "flip_rate": mean_or_nan(f.double()),
            "first_flip_share": mean_or_nan(first[layer].double()), "local_flip_rate": mean_or_nan(local.double()),
            "flips_local_share": mean_or_nan((f & local)[f].double()),
            "margin_flipped_median": quantile_or_nan(ref.margin[layer][where][f].double(), 0.5),
        })
    return {"positions": int(where.sum()), "flip_rate": mean_or_nan(flip.double()),
            "any_flip_share": mean_or_nan(flip.any(0).double()), "layers": rows}


def trace_routing(model: nn.Module, recipe: Recipe, ref_model: nn.Module, reference: Recipe,
                  packed: dict[str, torch.Tensor]) -> dict:
    """{'routing': route_depth(...)} on an MoE model with a supported router family; {'routing': {'unsupported':
    line}} on another MoE family (the rest of trace still runs); {} on a dense model."""
    if not routing.is_moe(model):
        return {}
    try:
        routing.routers(model)
    except routing.RoutingError as e:
        return {"routing": {"unsupported": str(e)}}
    return {"routing": route_depth(model, recipe, ref_model, reference, packed)}
