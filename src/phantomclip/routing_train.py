"""The training loop's side of expert routing (routing.py): the producer captures the local engine's routes as it
samples, and each step of an MoE run logs the routing part of β; with `--intervention r3` (rollout routing replay)
every trainer-side forward of the step (the loss's, the shadow's, and the producer's θ_old forwards) chooses the
engine's experts.

Per step, at the current weights θ_t and in the trainer's recipe, two no-grad forwards of the packed batch: one with
the trainer's own routes (captured, for the flip rate) and one with the engine's replayed. Their difference is
β_route, exact per token (routing.route_split): what replay removes. The cost is two forwards of the batch per step
(`time/route_s`); the loss forward itself is unchanged (its own routes, or the engine's under r3).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from . import routing
from .engine import LocalEngine
from .metrics import mean_or_nan, trust_region_split


def capture_plan(engine, master: nn.Module, replay: bool) -> bool:
    """Whether the producer captures the engine's routes: on an MoE model (a supported family) with the local engine.
    `replay` (r3) refuses, in one line, a dense model, an unsupported MoE family or an engine that returns no
    routes."""
    if replay:
        routing.require_moe(master, "--intervention r3")
        if not isinstance(engine, LocalEngine):
            raise routing.RoutingError("--intervention r3 needs the engine's expert routes, which only the local "
                                       "engine returns here: use --engine local")
        return True
    try:
        return isinstance(engine, LocalEngine) and bool(routing.routers(master))
    except routing.RoutingError:  # an MoE family without an adapter trains as before, without route figures
        return False


def replaying(models: list[nn.Module | None], routes: routing.Routes | None, P: int, group: int,
              on: bool) -> contextlib.ExitStack:
    """A context in which each of `models` (None skipped) replays `routes` on the grouped forward of a packed batch
    (`scoring.score_completions`: the prompt once per group, then the completions); nothing when off."""
    stack = contextlib.ExitStack()
    if on and routes is not None:
        layout = routing.grouped_layout(P, routes.valid.shape[1], group)
        for model in models:
            if model is not None:
                stack.enter_context(routing.replay(model, routes, layout))
    return stack


def routed_step(step_fn: Callable, batch, ctx):
    """`step_fn(batch, ctx)` (the trainer's step) with the routing figures of the batch added to its row, and under
    r3 with the engine's routes replayed in the step's forwards. A batch without routes (dense model, vLLM) runs the
    step unchanged."""
    routes = batch.routes
    if routes is None:
        return step_fn(batch, ctx)
    cfg, P = ctx.cfg, batch.rollout.prompt_width
    t0 = time.perf_counter()
    figures = step_route_figures(ctx.policy, batch.packed, routes, P=P, group=cfg.group_size,
                                 temperature=cfg.temperature, eps=(ctx.plan.eps_low, ctx.plan.eps_high))
    figures["time/route_s"] = time.perf_counter() - t0
    with replaying([ctx.policy.layout, ctx.shadow, ctx.plain_shadow], routes, P, cfg.group_size,
                   ctx.plan.routes == "engine"):
        out = step_fn(batch, ctx)
    out.row.update(figures)
    return out


@torch.no_grad()
def step_route_figures(policy, packed: dict[str, torch.Tensor], routes: routing.Routes, P: int, group: int,
                       temperature: float, eps: tuple[float, float]) -> dict:
    """The step's route keys (docs/metrics.md, `route/*`): the trainer's own routes at θ_t against the engine's, and
    β_route = logp(own routes) − logp(engine's routes) at the sampled tokens, both forwards in the trainer's recipe;
    log r = β_route + the rest, exactly per token."""
    B, T = packed["input_ids"].shape
    with routing.capture(policy.layout) as rec:
        own = policy.logprobs(packed, P, group, grad=False, temperature=temperature)  # [B, L]
    with replaying([policy.layout], routes, P, group, True):
        replayed = policy.logprobs(packed, P, group, grad=False, temperature=temperature)  # [B, L]
    mine = rec.routes(routing.grouped_layout(P, T, group), B, T)
    stats = routing.route_stats(mine, routes, packed["attention_mask"].bool().cpu())
    mask = packed["completion_mask"][:, P:].bool()  # [B, L]
    split = routing.route_split(own, replayed, packed["logp_engine"][:, P:])  # float64 [B, L] each
    ok = mask & split["beta"].isfinite()  # [B, L]
    below, above = trust_region_split(split["beta_route"][ok], *eps)
    return {
        "route/flip_rate": stats["flip_rate"],
        "route/any_flip_share": stats["any_flip_share"],
        "route/beta_route_abs_mean": mean_or_nan(split["beta_route"][ok].abs()),
        "route/beta_route_outside_trust_region": mean_or_nan((below | above).double()),
        # logp(engine's routes, θ_t) − logp_engine(θ_old): β_rest plus the policy's change α at staleness > 0
        "route/log_ratio_rest_abs_mean": mean_or_nan(split["beta_rest"][ok].abs()),
        "route/touched_share": mean_or_nan((split["beta_route"][ok] != 0).double()),
    }
