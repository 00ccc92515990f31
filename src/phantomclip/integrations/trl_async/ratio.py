"""The async fix's ratio: what TRL's unchanged `compute_loss` is handed so that its PPO clip decides on the policy's
own move and the trainer/engine mismatch β is corrected outside the clip
(integrations.trl_async.with_async_shadow_ratio).

TRL 1.16 clips r = exp(logp − old_log_probs) per loss term, old_log_probs being the server's log-probs μ at the
sample's version v (async_grpo_trainer.py `compute_loss`). Each variant is one function in RATIOS that returns a
`Rewrite`: the old log-probs TRL clips against [M], and optionally the value of the current log-probs per packed
position [1, N] (their gradient stays the trainer's forward: value + (logp − logp.detach())) and the advantages
[M] (TRL's times a capped importance weight). TRL's loss formula, normalisation and metrics are otherwise its own.

- "trust-region" (the default; "trainer" is the same ratio under its earlier name): the clip on
  r = exp(trainer(θ_t) − trainer(θ_v)), both sides the trainer's own forward of the live model in its own precision,
  the old side with version v's weights swapped in (trl_async.versions.TrainerVersions): PPO's trust region on the
  policy's move since the sample's version, exactly 1 at staleness 0 (where a token's version is the live weights,
  the current side and the old are one no-grad forward, π_prox; a micro-batch of stale tokens alone takes its
  current side from the loss's own forward; the gradient is always the loss's own forward). β is corrected outside
  the clip by the importance weight w = π_trainer(θ_v) / μ(θ_v) on the advantage, capped (ImportanceWeight:
  token-level truncation at 2 unless the user's TRL importance-sampling fields say otherwise).
- "shadow": r = exp(α_engine), α_engine = shadow(θ_t) − shadow(θ_v), both copies in the engine's dtype (bf16),
  scored by TRL's packed forward. Two roundings that barely cancel: on the bundled model α_engine differs from the
  policy's move in the trainer's precision by about half its size (docs/results.md). No weight: β is left out of
  the clip, uncorrected.
- "decoupled" (opt-in): decoupled PPO (Hilton et al. 2021) in the form AReaL and verl write it: the clip on
  π_θ / π_prox with the proximal policy π_prox the trainer's recomputed log-probs at the weights before the update
  (AReaL areal/utils/functional/functional.py `ppo_actor_loss_fn`: ratio = exp(logprobs − proximal_logprobs),
  clipped), and the behaviour weight π_prox / μ outside the clip, capped as above. In TRL's async trainer each sample
  gets one optimizer step, so π_θ = π_prox on every micro-batch and the clip never fires: there is no trust region
  against staleness. The loss is −w·A·r with r ≡ 1 in value: REINFORCE with a token weight w that carries staleness
  and β together, bounded by the cap alone (the step itself is bounded by the learning rate and max_grad_norm, as
  in any trainer). Implemented as old := π_prox (a no-grad forward of the live model) and A := w·A.

A token whose version has no kept copy (attached after training started; or, for "trust-region", fewer versions
kept than a token may have: with_async_shadow_ratio(versions_kept=...)): "trust-region" clips it against the oldest
kept version newer than its own, the move between joining β in the weight (counted in offpolicy/substitute_total),
or against μ with weight 1 where none is kept (offpolicy/no_copy_total); "shadow" clips it against the server's own
log-prob μ, as without the fix: on shadow(θ_t) − μ(θ_v) = α + β_kernel (offpolicy/no_copy_total, and
precision/no_shadow_total with the monitor).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...base.errors import IntegrationError

WEIGHT_CAP = 2.0
"""the importance weight's upper bound unless the user's TRL fields set one: verl's token-level truncation default
(verl/trainer/config/algorithm/rollout_correction.yaml `rollout_is_threshold: 2.0`). AReaL never capped at 2, read
from inclusionAI/AReaL's history of areal/utils/functional and areal/api/cli_args.py: its behaviour weight was
uncapped by default until March 2026 (`behav_imp_weight_cap=None`, e.g. commit b4407079a, 2026-01-04), zeroed above
5 from commit 03d71153a (2026-03-03: `behave_imp_weight_cap=5.0`, `behave_imp_weight_mode="token_mask"`), and not
applied at all by default from commit bc9f00988 (2026-04-20: `rejection_sampling=None`, still so at 4aef98d8d,
2026-05-21)."""
WEIGHT_MODE = "token_truncate"
"""the importance weight's level and action unless the user's TRL fields set them (TRL's names: trl 1.16
trainer/grpo_config.py `vllm_importance_sampling_mode`)."""
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's importance-sampling modes (grpo_trainer.py `_generate_and_score_completions`): per token or one ratio per
sequence (the sum of its token log-ratios), truncated to [min, max] or set to 0 outside it."""
TRL_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
              "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")
"""TRL's importance-sampling fields (GRPOConfig in trl 1.16; `vllm_importance_sampling_cap` the deprecated name of
clip_max). AsyncGRPOConfig in trl 1.16 has none of them: a config that carries them (a subclass, a later TRL) is
followed."""
ALIASES = {"trainer": "trust-region"}
"""earlier names of a ratio, accepted and resolved to its one name."""


@dataclass(frozen=True)
class ImportanceWeight:
    """The capped importance weight on the advantage: exp(log_ratio) per token, or per sequence the exp of the sum of
    its token log-ratios, truncated to [floor, cap] or set to 0 outside it; `enabled` False: 1 everywhere."""

    mode: str = WEIGHT_MODE
    cap: float | None = WEIGHT_CAP
    floor: float | None = None
    enabled: bool = True

    def apply(self, log_ratio: torch.Tensor, segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight [M], capped [M] bool: outside [floor, cap]) for per-token log-ratios [M] and each token's
        sequence id [M] (the packed row's segment_id)."""
        if not self.enabled:
            return torch.ones_like(log_ratio), torch.zeros_like(log_ratio, dtype=torch.bool)
        lr = log_ratio.double()
        if self.mode.startswith("sequence"):
            _, inverse = segment.unique(return_inverse=True)  # [M] each token's sequence, 0 .. S−1
            per_seq = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=lr.dtype,
                                  device=lr.device).index_add_(0, inverse, lr)  # [S] Σ token log-ratios
            lr = per_seq[inverse]  # [M] the sequence's log-ratio on each of its tokens
        raw = torch.exp(lr)
        hi = math.inf if self.cap is None else self.cap
        lo = -math.inf if self.floor is None else self.floor
        capped = (raw > hi) | (raw < lo)
        weight = raw.clamp(min=self.floor, max=self.cap) if self.mode.endswith("truncate") else raw.masked_fill(
            capped, 0.0)
        return weight.float(), capped


def importance_weight(args, mode: str | None = None, cap: float | None = None) -> ImportanceWeight:
    """The weight the user's settings give: TRL's fields on `args` where it has them, the arguments of
    with_async_shadow_ratio where given (one line if both are and differ), else WEIGHT_MODE at WEIGHT_CAP."""
    fields = {name: getattr(args, name) for name in TRL_FIELDS if hasattr(args, name)}
    if fields.get("vllm_importance_sampling_cap") is not None and "vllm_importance_sampling_clip_max" not in fields:
        fields["vllm_importance_sampling_clip_max"] = fields["vllm_importance_sampling_cap"]
    for given, name in ((mode, "vllm_importance_sampling_mode"), (cap, "vllm_importance_sampling_clip_max")):
        if given is not None and name in fields and fields[name] != given:
            raise IntegrationError(f"with_async_shadow_ratio({name}={given!r}) differs from the trainer config's "
                                   f"{name}={fields[name]!r}: set it in one place")
    mode = mode if mode is not None else fields.get("vllm_importance_sampling_mode", WEIGHT_MODE)
    if mode not in MODES:
        raise IntegrationError(f"vllm_importance_sampling_mode must be one of {', '.join(MODES)}, got {mode!r}")
    cap = cap if cap is not None else fields.get("vllm_importance_sampling_clip_max", WEIGHT_CAP)
    floor = fields.get("vllm_importance_sampling_clip_min")
    if cap is not None and (not isinstance(cap, (int, float)) or not cap >= 1):
        raise IntegrationError(f"the importance weight's cap (vllm_importance_sampling_clip_max) must be a number >= 1 "
                               f"or None, got {cap!r}")
    return ImportanceWeight(mode, None if cap is None else float(cap), floor,
                            bool(fields.get("vllm_importance_sampling_correction", True)))


@dataclass
class Tokens:
    """What a variant reads, per trained token [M] unless said; None where the variant does not need it."""

    logp_engine: torch.Tensor
    """the server's log-probs μ at the sample's version (TRL's old_log_probs)."""
    advantages: torch.Tensor
    index: torch.Tensor | None = None
    """each trained token's position in the packed row (token_index)."""
    segment: torch.Tensor | None = None
    """each token's sequence in the packed row (segment_id)."""
    shadow_now_row: torch.Tensor | None = None
    """[1, N] the engine-dtype copy of the current weights on the packed row."""
    shadow_old: torch.Tensor | None = None
    """the engine-dtype copy of the sample's version (NaN where none is kept)."""
    trainer_old: torch.Tensor | None = None
    """the trainer's forward with the sample's version's weights, or the oldest kept newer version's where its own
    are not kept (NaN where none is)."""
    trainer_own: torch.Tensor | None = None
    """bool: trainer_old is the sample's own version's."""
    prox_row: torch.Tensor | None = None
    """[1, N] the live model's no-grad forward at the current weights: π_prox (trainer(θ_t))."""
    logp_prox: torch.Tensor | None = None
    """prox_row on the trained tokens."""


@dataclass
class Rewrite:
    """What TRL's compute_loss is handed instead of its own inputs, and what the fix logs of it."""

    old: torch.Tensor
    """[M] the old log-probs TRL clips against."""
    value: torch.Tensor | None = None
    """[1, N] the value of the current log-probs per packed position (None: the trainer's forward as is)."""
    advantages: torch.Tensor | None = None
    """[M] the advantages (None: TRL's)."""
    weight: torch.Tensor | None = None
    """[M] the importance weight on the advantage (None: 1)."""
    capped: torch.Tensor | None = None
    """[M] bool: the weight's raw value was outside [floor, cap]."""
    clip_log: torch.Tensor | None = None
    """[M] log r the clip decides on, in value (None: the loss's own forward minus `old`, filled in after it)."""


def _or_engine(old: torch.Tensor, logp_engine: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(old), logp_engine, old)  # [M] the server's log-prob where no copy is kept


def shadow_ratio(t: Tokens, w: ImportanceWeight) -> Rewrite:
    old = _or_engine(t.shadow_old, t.logp_engine)
    return Rewrite(old=old, value=t.shadow_now_row, clip_log=t.shadow_now_row.flatten()[t.index] - old)


def trust_region_ratio(t: Tokens, w: ImportanceWeight) -> Rewrite:
    missing = torch.isnan(t.trainer_old)  # [M]
    weight, capped = w.apply(torch.where(missing, 0.0, t.trainer_old - t.logp_engine), t.segment)  # β at θ_v
    weight, capped = torch.where(missing, 1.0, weight), capped & ~missing
    old = _or_engine(t.trainer_old, t.logp_engine)
    return Rewrite(old=old, value=t.prox_row, advantages=t.advantages * weight, weight=weight, capped=capped,
                   clip_log=None if t.logp_prox is None else t.logp_prox - old)


def decoupled_ratio(t: Tokens, w: ImportanceWeight) -> Rewrite:
    weight, capped = w.apply(t.logp_prox - t.logp_engine, t.segment)  # [M] π_prox / μ: staleness and β together
    return Rewrite(old=t.logp_prox, advantages=t.advantages * weight, weight=weight, capped=capped,
                   clip_log=torch.zeros_like(t.logp_prox))


@dataclass(frozen=True)
class Ratio:
    fn: Callable[[Tokens, ImportanceWeight], Rewrite]
    needs: frozenset
    """what the hooks compute for it: "engine" copies per version, "trainer" versions (the live model with a
    version's weights swapped in; π_prox too, where a token's version is the live weights), "prox" (a no-grad
    forward of the live model on every micro-batch)."""
    bytes_per_param: str
    """memory per kept version, in words for the docs and errors."""


RATIOS: dict[str, Ratio] = {
    "trust-region": Ratio(trust_region_ratio, frozenset({"trainer"}),
                          "the trainable parameters' dtype size (fp32: 4 bytes), sharded as the parameters are"),
    "shadow": Ratio(shadow_ratio, frozenset({"engine"}), "the engine dtype's size (bf16: 2 bytes), whole"),
    "decoupled": Ratio(decoupled_ratio, frozenset({"prox"}), "none"),
}
"""the fix's variants (module doc); with_async_shadow_ratio(ratio=...) picks one."""


def resolve(ratio) -> str:
    """The ratio's one name (ALIASES resolved), or one line naming the choices."""
    name = ALIASES.get(ratio, ratio) if isinstance(ratio, str) else ratio
    if not isinstance(name, str) or name not in RATIOS:  # a list is unhashable: a string first
        raise IntegrationError(f"with_async_shadow_ratio ratio must be one of {', '.join(RATIOS)} (or 'trainer', the "
                               f"earlier name of 'trust-region'), got {ratio!r}")
    return name
