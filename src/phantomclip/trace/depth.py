"""The error of one forward against another, site by site along a decoder's depth: the sites (`trace_sites`), running
statistics of an error (`ErrorStats`) and the forward hooks that reduce it as activations are produced (`SiteHooks`).
What `phantomclip trace` (trace/job.py) reports per site, and what `trace --run` (trace/growth.py) follows along a
training run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..base.errors import PhantomclipError
from ..precision.recipes import Recipe, decoder_body, final_norm, forward_context, lm_head
from ..precision.scoring import position_ids_from_mask


class TraceError(PhantomclipError):
    """Bad trace input: unknown module name, recipe, or a model whose layers cannot be found."""


def trace_sites(model: nn.Module) -> list[tuple[str, int, nn.Module]]:
    """(name, depth, module) of every traced output, in forward order; depth = layer index, −1 before, L after."""
    body = decoder_body(model)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TraceError(f"cannot find the decoder layers of {type(model).__name__}: expected a ModuleList "
                         f"`layers` under its body {type(body).__name__} "
                         f"(the module tree root is {type(model).__name__})")
    sites = [("embed", -1, model.get_input_embeddings())]
    for i, layer in enumerate(layers):
        for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            if isinstance(getattr(layer, sub, None), nn.Module):
                sites.append((f"layers.{i}.{sub}", i, getattr(layer, sub)))
        sites.append((f"layers.{i}.residual", i, layer))
    sites += [("final_norm", len(layers), final_norm(model)), ("logits", len(layers), lm_head(model))]
    return sites


@dataclass
class ErrorStats:
    """Running sums of one site's error over the real tokens of every sub-batch (float64 sums)."""

    sq_diff: float = 0.0
    """Σ (x − x_ref)²."""
    sq_ref: float = 0.0
    """Σ x_ref²."""
    max_diff: float = 0.0
    """max |x − x_ref|."""
    max_ref: float = 0.0
    """max |x_ref|."""
    count: int = 0
    """values summed."""

    def add(self, x: torch.Tensor, ref: torch.Tensor) -> None:
        d, r = (x.double() - ref.double()), ref.double()  # [N, H]
        self.sq_diff += d.square().sum().item()
        self.sq_ref += r.square().sum().item()
        self.max_diff = max(self.max_diff, d.abs().max().item() if d.numel() else 0.0)
        self.max_ref = max(self.max_ref, r.abs().max().item() if r.numel() else 0.0)
        self.count += r.numel()

    def summary(self) -> dict[str, float]:
        return {
            "rel_error": math.sqrt(self.sq_diff / self.sq_ref) if self.sq_ref > 0 else 0.0,
            "max_abs_error": self.max_diff,
            "ref_rms": math.sqrt(self.sq_ref / max(self.count, 1)),
            "ref_max_abs": self.max_ref,
        }


def first_tensor(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class SiteHooks:
    """Forward hooks on the same sites of two models. The reference's outputs are held; each output of the traced
    model is reduced against the held one at once and the held one is dropped."""

    def __init__(self, model: nn.Module, ref_model: nn.Module, stats: dict[str, ErrorStats]):
        self.stats, self.held = stats, {}
        self.mask: torch.Tensor | None = None  # [b, T] real tokens of the current sub-batch
        self.handles = [m.register_forward_hook(self._hook(name, store=True)) for name, _, m in trace_sites(ref_model)]
        self.handles += [m.register_forward_hook(self._hook(name, store=False)) for name, _, m in trace_sites(model)]

    def _hook(self, name: str, store: bool):
        def hook(module, args, output):
            x = first_tensor(output).detach()[self.mask]  # [N, H]: real tokens only
            if store:
                self.held[name] = x.float()
            else:
                self.stats[name].add(x, self.held.pop(name))

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def full_logits(model: nn.Module, recipe: Recipe, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Full logits [b, T, V] of one sub-batch, through the model's own forward (so the hooks see every site)."""
    with torch.no_grad(), forward_context(recipe, ids.device):
        return model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                     use_cache=False).logits


def site_errors(model: nn.Module, recipe: Recipe, ref_model: nn.Module, reference: Recipe,
                batches) -> dict[str, dict[str, float]]:
    """Every site's `ErrorStats.summary()` of `model` under `recipe` against `ref_model` under `reference`, over the
    real tokens of `batches`, an iterable of (input_ids, attention_mask) [b, T]."""
    stats = {name: ErrorStats() for name, _, _ in trace_sites(model)}
    hooks = SiteHooks(model, ref_model, stats)
    try:
        for ids, attn in batches:
            hooks.mask = attn.bool()
            full_logits(ref_model, reference, ids, attn)  # its sites are held for the next forward
            full_logits(model, recipe, ids, attn)
    finally:
        hooks.remove()
    return {name: st.summary() for name, st in stats.items()}
