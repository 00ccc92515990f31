"""The interventions of the reference analysis as a registry, and the `Plan` a run follows once they are applied.

An intervention is a small dict of changes to a `Plan` (one function per variant, composable with ','); two
interventions that set the same field to different values conflict and are refused when the config is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ..base.errors import ConfigError
from ..base.numerics import parse_dtype
from ..maths.loss import CORRECTIONS, KNOBS, clip_range
from ..precision.recipes import RecipeError, engine_quants, engine_recipe, get_recipe, with_quant


class TrainConfigError(ConfigError):
    """A training configuration that cannot run (bad value, unknown name, conflicting interventions)."""


@dataclass(frozen=True)
class Plan:
    """What a run does once its interventions are applied."""

    trainer_recipe: str
    engine_recipe: str
    ratio_against: str = "engine"
    """logp_old of the PPO ratio: 'engine' (async GRPO), 'trainer_old' (trainer at the rollout's weights) or 'self'
    (r = 1)."""
    clip_on: str = "full"
    """'full': clip on log r = α + β; 'shadow': clip on α alone, logp_shadow(θ_t) − logp_shadow(θ_old), the policy's
    own change in the engine's precision (gradient still through logp)."""
    eps_low: float = 0.2
    eps_high: float = 0.2
    correction: str = "none"
    """rollout correction mode (loss.CORRECTIONS), weights from logp_old (or the current logp) vs logp_engine."""
    loss_scaling: bool = False
    """dynamic loss scaling (fp16 gradients underflow without it)."""
    routes: str = "own"
    """MoE models: 'own' (each forward's router chooses) or 'engine' (the trainer's forwards replay the experts the
    engine chose: rollout routing replay, R3; routing/routes.py)."""


@dataclass(frozen=True)
class Intervention:
    doc: str
    changes: Callable[[str | None], dict]
    """argument (the X of 'name=X', or None) -> Plan fields to set."""


def _epsilon(arg: str | None) -> dict:
    try:
        eps = float(arg or "")
    except ValueError:
        raise TrainConfigError(f"intervention epsilon=X needs a number, got {arg!r}") from None
    # ε_low and ε_high both: --epsilon's range (loss.KNOBS), so one rule for the flag and the intervention
    KNOBS["epsilon"].check("--intervention epsilon=X: X", eps, TrainConfigError)
    return {"eps_low": eps, "eps_high": eps}


def _correction(arg: str | None) -> dict:
    if arg not in CORRECTIONS:
        raise TrainConfigError(f"intervention correction=MODE: unknown mode {arg!r}; "
                               f"use one of {', '.join(CORRECTIONS)}")
    return {"correction": arg}


INTERVENTIONS: dict[str, Intervention] = {
    "none": Intervention("baseline: nothing changed", lambda a: {}),
    "match-bf16": Intervention("trainer in bf16, like the bf16 engine",
                               lambda a: {"trainer_recipe": "bf16", "engine_recipe": "bf16"}),
    "fp16": Intervention("trainer and engine in fp16 (Qi et al. 2025), with dynamic loss scaling",
                         lambda a: {"trainer_recipe": "fp16", "engine_recipe": "fp16", "loss_scaling": True}),
    "autocast": Intervention("trainer in bf16 autocast over fp32 master weights (TRL bf16=True)",
                             lambda a: {"trainer_recipe": "bf16-autocast"}),
    "fp32-head": Intervention("final norm and lm_head in fp32 on both sides, bf16 bodies (MiniMax-M1)",
                              lambda a: {"trainer_recipe": "fp32-head", "engine_recipe": "fp32-head"}),
    "shadow-ratio": Intervention("clip on α = logp_shadow(θ_t) − logp_shadow(θ_old) alone "
                                 "(no β_kernel, no β_precision); the gradient still flows through logp",
                                 lambda a: {"clip_on": "shadow"}),
    "recompute-old": Intervention("logp_old recomputed by the trainer at the rollout's weights "
                                  "(TRL's synchronous default)",
                                  lambda a: {"ratio_against": "trainer_old"}),
    "force-r1": Intervention("ratio forced to 1 (exp(logp − logp.detach())): plain policy gradient, no clip",
                             lambda a: {"ratio_against": "self"}),
    "no-clip": Intervention("ε = ∞: β stays in the ratio but never clips",
                            lambda a: {"eps_low": math.inf, "eps_high": math.inf}),
    "tis": Intervention("token-level truncated importance sampling, min(π/μ, C) (Yao et al. 2025)",
                        lambda a: {"correction": "token_truncate"}),
    "mis": Intervention("sequence-level masked importance sampling, TRL's default sequence_mask",
                        lambda a: {"correction": "sequence_mask"}),
    "icepop": Intervention("IcePop: mask tokens whose π/μ is outside [0.5, 2] (Ring-1T)",
                           lambda a: {"correction": "icepop"}),
    "r3": Intervention("MoE models: the trainer's forwards use the experts the engine chose (rollout routing replay, "
                       "R3; verl router_replay.mode=R3, slime --use-rollout-routing-replay)",
                       lambda a: {"routes": "engine"}),
    "epsilon": Intervention("epsilon=X: clip range ε_low = ε_high = X", _epsilon),
    "correction": Intervention("correction=MODE: any rollout correction of loss.CORRECTIONS", _correction),
}


class PlanInputs(Protocol):
    """The config fields a plan is built from (TrainConfig has them)."""

    trainer: str
    engine_dtype: str
    intervention: str
    epsilon: float
    epsilon_high: float | None
    engine_quant: str


def resolve_plan(cfg: PlanInputs) -> Plan:
    """The config's precision contract with its interventions applied, left to right; conflicts are refused."""
    eps_low, eps_high = clip_range(cfg.epsilon, cfg.epsilon_high)
    plan = Plan(trainer_recipe=cfg.trainer, engine_recipe=engine_recipe_name(cfg.engine_dtype), eps_low=eps_low,
                eps_high=eps_high)
    set_by: dict[str, str] = {}
    items = list(filter(None, (s.strip() for s in cfg.intervention.split(","))))
    if not items:  # ',' or ' ' (an unset shell variable in a list) would run the baseline unsaid
        raise TrainConfigError(f"--intervention {cfg.intervention!r} names no intervention: give one (none for the "
                               "baseline; see --list-interventions)")
    for item in items:
        name, _, arg = item.partition("=")
        if name not in INTERVENTIONS:
            raise TrainConfigError(f"unknown intervention {name!r}: use one of {', '.join(INTERVENTIONS)}")
        for key, value in INTERVENTIONS[name].changes(arg or None).items():
            if key in set_by and getattr(plan, key) != value:
                raise TrainConfigError(f"interventions {set_by[key]} and {item} conflict (both set {key})")
            set_by[key] = item
            plan = replace(plan, **{key: value})
    try:  # after the interventions: match-bf16, fp16 and fp32-head change the engine's dtype, not its FP8
        quant = engine_quants(getattr(cfg, "engine_quant", ""))
        if quant:
            plan = replace(plan, engine_recipe=with_quant(get_recipe(plan.engine_recipe), quant).name)
    except RecipeError as e:
        raise TrainConfigError(f"--engine-quant: {e}") from None
    if plan.clip_on == "shadow" and plan.ratio_against != "engine":
        raise TrainConfigError("shadow-ratio clips on α alone against the engine's rollout: it cannot be combined with "
                               "recompute-old or force-r1")
    return plan


def engine_recipe_name(dtype: str) -> str:
    """The recipe an engine of `dtype` computes in (bf16 -> 'bf16'); one line for an unknown dtype."""
    try:
        return engine_recipe(parse_dtype(dtype)).name
    except (ValueError, StopIteration):
        raise TrainConfigError(f"unknown --engine-dtype {dtype!r}: use bf16, fp16 or fp32") from None
