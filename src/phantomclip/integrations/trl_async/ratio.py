"""The async fix's ratio: what TRL's unchanged `compute_loss` is handed so that its PPO clip decides on the policy's
own move, not on the move plus the trainer/engine mismatch β (integrations.trl_async.with_async_shadow_ratio).

TRL 1.16 clips r = exp(logp − old_log_probs) per loss term, old_log_probs being the server's log-probs μ at the
sample's version v (async_grpo_trainer.py `compute_loss`). Each variant is one function in RATIOS that returns a
`Rewrite`: the old log-probs TRL clips against [M], and optionally the value of the current log-probs per packed
position [1, N] (their gradient stays the trainer's forward: value + (logp − logp.detach())) and the advantages
[M]. TRL's loss formula, normalisation and metrics are otherwise its own.

- "shadow": r = exp(α_engine), α_engine = shadow(θ_t) − shadow(θ_v), both copies in the engine's dtype (bf16),
  scored by TRL's packed forward. Two roundings that barely cancel: on the bundled model α_engine differs from the
  policy's move in the trainer's precision by about half its size (docs/results.md).
- "trainer": r = exp(logp − trainer(θ_v)): the old side is a copy of version v's weights in the trainer's dtype run
  through the trainer's own forward, so r = exp(α) with α the policy's move as the trainer computes it (the clip PPO
  means: synchronous GRPO's logp_old). Exactly 1 at staleness 0 (same weights, same code, same kernels).
- "decoupled": decoupled PPO (Hilton et al. 2021) as AReaL and verl write it: the clip on π_θ / π_prox with the
  proximal policy π_prox the trainer's recomputed log-probs at the weights before the update (AReaL
  areal/utils/functional/functional.py `ppo_actor_loss_fn`: ratio = exp(logprobs − proximal_logprobs), clipped;
  verl's decoupled mode: old_log_prob recomputed by the actor), and the behaviour weight π_prox / μ outside the clip,
  truncated at DECOUPLED_WEIGHT_CAP (verl verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_correction_weights`,
  token level: exp(log_ratio).clamp(max=threshold), threshold 2.0 by default; AReaL's `behav_imp_weight_cap` zeroes
  the weights above its cap instead). In TRL's async trainer every sample gets one optimizer step, so π_θ = π_prox
  on every micro-batch of the step and the clip never fires: the loss is −w·A·r with r ≡ 1 in value, staleness and β
  both carried by w. Implemented as old := π_prox (a no-grad forward of the live model, the values the loss's own
  forward then gives) and A := w·A.

A token whose version has no kept copy (attached after training started) is clipped against the server's own
log-prob μ, as without the fix: "shadow" then clips on shadow(θ_t) − μ(θ_v) = α + β_kernel, "trainer" on TRL's own
ratio. Counted in precision/no_shadow_total by the monitor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DECOUPLED_WEIGHT_CAP = 2.0
"""upper bound of the behaviour weight π_prox / μ in ratio="decoupled" (verl's rollout_is_threshold default)."""


@dataclass
class Tokens:
    """What a variant reads, per trained token [M] unless said; None where the variant does not need it."""

    logp_engine: torch.Tensor
    """the server's log-probs μ at the sample's version (TRL's old_log_probs)."""
    advantages: torch.Tensor
    shadow_now_row: torch.Tensor | None = None
    """[1, N] the engine-dtype copy of the current weights on the packed row."""
    shadow_old: torch.Tensor | None = None
    """the engine-dtype copy of the sample's version (NaN where none is kept)."""
    trainer_old: torch.Tensor | None = None
    """the trainer-dtype copy of the sample's version through the trainer's forward (NaN where none is kept)."""
    logp_prox: torch.Tensor | None = None
    """the live model's no-grad forward at the current weights: π_prox."""


@dataclass
class Rewrite:
    """What TRL's compute_loss is handed instead of its own inputs."""

    old: torch.Tensor
    """[M] the old log-probs TRL clips against."""
    value: torch.Tensor | None = None
    """[1, N] the value of the current log-probs per packed position (None: the trainer's forward as is)."""
    advantages: torch.Tensor | None = None
    """[M] the advantages (None: TRL's)."""


def _or_engine(old: torch.Tensor, logp_engine: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(old), logp_engine, old)  # [M] the server's log-prob where no copy is kept


def shadow_ratio(t: Tokens) -> Rewrite:
    return Rewrite(old=_or_engine(t.shadow_old, t.logp_engine), value=t.shadow_now_row)


def trainer_ratio(t: Tokens) -> Rewrite:
    return Rewrite(old=_or_engine(t.trainer_old, t.logp_engine))


def decoupled_ratio(t: Tokens) -> Rewrite:
    weight = torch.exp(t.logp_prox - t.logp_engine).clamp(max=DECOUPLED_WEIGHT_CAP)  # [M] π_prox / μ, truncated
    return Rewrite(old=t.logp_prox, advantages=t.advantages * weight)


@dataclass(frozen=True)
class Ratio:
    fn: Callable[[Tokens], Rewrite]
    needs: str
    """what the hooks compute for it: "engine" copies per version, "trainer" copies per version, or "prox" (a
    no-grad forward of the live model)."""
    bytes_per_param: str
    """memory per kept version, in words for the docs and errors."""


RATIOS: dict[str, Ratio] = {
    "shadow": Ratio(shadow_ratio, "engine", "the engine dtype's size (bf16: 2 bytes)"),
    "trainer": Ratio(trainer_ratio, "trainer", "the trainer's parameter dtype's size (fp32: 4 bytes)"),
    "decoupled": Ratio(decoupled_ratio, "prox", "none"),
}
"""the fix's variants (module doc); with_async_shadow_ratio(ratio=...) picks one."""
