"""The training loop's side of expert routing (routing/routes.py): the producer captures the local engine's routes as it
samples, and each step of an MoE run logs the routing part of β; with `--intervention r3` (rollout routing replay)
every trainer-side forward of the step (the loss's, the shadow's, and the producer's θ_old forwards) chooses the
engine's experts.

Per step, at the current weights θ_t and in the trainer's recipe, the split needs two forwards of the packed batch:
one with the trainer's own routes (captured, for the flip rate) and one with the engine's replayed. Their difference
is β_route, exact per token (figures.route_split): what replay removes. The loss's own forward is one of the two (its
own routes, or the engine's under r3), at θ_t before the update, on the same batch in the same shapes; its log-probs
are those of the same forward without grad bit for bit (the same kernels: tested), so each step runs only the other
one more (`time/route_s`), no-grad, before the loss (the weights then are θ_t too).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..engines.local import LocalEngine
from ..maths.metrics import mean_or_nan, trust_region_split
from . import routes as routing
from .figures import flip_shares, flips_at, route_split


def capture_plan(engine, master: nn.Module, replay: bool) -> bool:
    """Whether the producer captures the engine's routes: on an MoE model (a supported family) with the local engine.
    `replay` (r3) refuses, in one line, a dense model, an unsupported MoE family or an engine that returns no
    routes."""
    if replay:
        routing.require_moe(master, "--intervention r3")
        if not isinstance(engine, LocalEngine):
            raise routing.RoutingError(routing.no_engine_routes(engine.describe().get("kind", "engine"),
                                                                "--intervention r3"))
        return True
    try:
        return isinstance(engine, LocalEngine) and bool(routing.routers(master))
    except routing.RoutingError:  # an MoE family without an adapter trains as before, without route figures
        return False


def engine_routes_note(engine, master: nn.Module) -> str | None:
    """The one line an MoE run prints when its engine returns no routes (vLLM): its steps log no `route/*`. None for
    a dense model or the local engine."""
    if isinstance(engine, LocalEngine) or not routing.is_moe(master):
        return None
    return routing.no_engine_routes(engine.describe().get("kind", "engine"))


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
    step unchanged.

    `step_fn` scores the batch once with `ctx.policy.logprobs(batch.packed, P, group, grad=True, temperature)` before
    it updates the weights (the loss forward, `step.train_step`); the figures take that forward's log-probs (and
    its routes without r3) and run only the other forward here."""
    routes = batch.routes
    if routes is None:
        return step_fn(batch, ctx)
    cfg, P, packed = ctx.cfg, batch.rollout.prompt_width, batch.packed
    replay_on = ctx.plan.routes == "engine"
    args = (P, cfg.group_size, cfg.temperature)
    t0 = time.perf_counter()
    # the forward the loss does not run: own routes (captured) under r3, else the engine's replayed
    other = _forward(ctx.policy, packed, routes, *args, replay=not replay_on)
    seconds = time.perf_counter() - t0
    with _loss_forward(ctx.policy, packed, *args, capture=not replay_on) as loss, \
            replaying([ctx.policy.layout, ctx.shadow, ctx.plain_shadow], routes, P, cfg.group_size, replay_on):
        out = step_fn(batch, ctx)
    if loss.logp is None:
        raise RuntimeError("the step did not score its batch with ctx.policy.logprobs: routed_step has no loss "
                           "forward to take the route figures from")
    t0 = time.perf_counter()
    own, replayed = (other, loss) if replay_on else (loss, other)
    figures = route_row(own.logp, own.routes, replayed.logp, packed, routes, P=P, group=cfg.group_size,
                        eps=(ctx.plan.eps_low, ctx.plan.eps_high))
    figures["time/route_s"] = seconds + time.perf_counter() - t0
    out.row.update(figures)
    return out


@dataclass
class _Scored:
    logp: torch.Tensor | None = None  # [B, L] completion log-probs, detached
    routes: routing.Recorder | None = None  # the forward's own routes, where captured


@torch.no_grad()
def _forward(policy, packed: dict[str, torch.Tensor], routes: routing.Routes, P: int, group: int,
             temperature: float, replay: bool) -> _Scored:
    """One no-grad forward of the batch in the trainer's recipe: with the engine's `routes` replayed, or with its own
    routes captured."""
    # the step logs no router margins (route_row): capture skips them
    hooks = (replaying([policy.layout], routes, P, group, True) if replay
             else routing.capture(policy.layout, margins=False))
    with hooks as rec:
        logp = policy.logprobs(packed, P, group, grad=False, temperature=temperature)  # [B, L]
    return _Scored(logp, None if replay else rec)


@contextlib.contextmanager
def _loss_forward(policy, packed: dict[str, torch.Tensor], P: int, group: int, temperature: float,
                  capture: bool) -> Iterator[_Scored]:
    """Inside the block, `policy`'s forward with grad over `packed` (the loss's) keeps its log-probs, detached, and
    with `capture` its own routes, in the yielded record; other calls pass through. The instance's `logprobs` is
    wrapped for the block and restored after it."""
    seen = _Scored()
    original, key = policy.logprobs, (P, group, temperature)

    def logprobs(batch, prompt_width, group_size, grad=True, temperature=1.0):  # TrainerForward.logprobs' signature
        mine = grad and batch is packed and (prompt_width, group_size, temperature) == key
        with routing.capture(policy.layout, margins=False) if mine and capture else contextlib.nullcontext() as rec:
            logp = original(batch, prompt_width, group_size, grad=grad, temperature=temperature)
        if mine:
            seen.logp, seen.routes = logp.detach(), rec
        return logp

    policy.logprobs = logprobs
    try:
        yield seen
    finally:
        del policy.logprobs  # the class's method again


def route_row(own: torch.Tensor, own_routes: routing.Recorder, replayed: torch.Tensor,
              packed: dict[str, torch.Tensor], routes: routing.Routes, P: int, group: int,
              eps: tuple[float, float]) -> dict:
    """The step's route keys (docs/metrics.md, `route/*`) from the trainer's two forwards at θ_t: `own` [B, L] with
    its routes `own_routes` (recorded on the grouped layout) against the engine's `routes`, and β_route = own −
    `replayed` [B, L] (the engine's routes) at the sampled tokens; log r = β_route + the rest, exactly per token."""
    B, T = packed["input_ids"].shape
    mine = own_routes.routes(routing.grouped_layout(P, T, group), B, T)
    flip, _ = flips_at(mine, routes, packed["attention_mask"].bool().cpu())  # [layers, N]
    flip_rate, any_flip_share = flip_shares(flip)  # (route_stats' per-layer table: not logged per step)
    mask = packed["completion_mask"][:, P:].bool()  # [B, L]
    split = route_split(own, replayed, packed["logp_engine"][:, P:])  # float64 [B, L] each
    ok = mask & split["beta"].isfinite()  # [B, L]
    below, above = trust_region_split(split["beta_route"][ok], *eps)
    return {
        "route/flip_rate": flip_rate,
        "route/any_flip_share": any_flip_share,
        "route/beta_route_abs_mean": mean_or_nan(split["beta_route"][ok].abs()),
        "route/beta_route_outside_trust_region": mean_or_nan((below | above).double()),
        # logp(engine's routes, θ_t) − logp_engine(θ_old): β_rest plus the policy's change α at staleness > 0
        "route/log_ratio_rest_abs_mean": mean_or_nan(split["beta_rest"][ok].abs()),
        "route/touched_share": mean_or_nan((split["beta_route"][ok] != 0).double()),
    }


def step_route_figures(policy, packed: dict[str, torch.Tensor], routes: routing.Routes, P: int, group: int,
                       temperature: float, eps: tuple[float, float]) -> dict:
    """`route_row` with both forwards run here, no-grad (the figures of a batch outside a training step)."""
    own = _forward(policy, packed, routes, P, group, temperature, replay=False)
    replayed = _forward(policy, packed, routes, P, group, temperature, replay=True)
    return route_row(own.logp, own.routes, replayed.logp, packed, routes, P=P, group=group, eps=eps)
