"""The GRPO objective and rollout corrections as pure functions: tensors in, (loss, stats) out.

Nothing here reads trainer state. Each loss aggregation and each rollout correction is one small function in a
registry (`AGGREGATIONS`, `CORRECTIONS`), so adding a variant is adding one function. The per-token masks that
a function used (clipped low / high, masked) are returned with the loss, so metrics never recompute them in a
slightly different way.

Names: `logp` is the current policy (with grad), `logp_old` the log-probs the ratio is taken against (the engine's
in asynchronous GRPO, the trainer's own at rollout time in TRL's synchronous default), `logp_engine` what the
engine reported when sampling. Shapes: B sequences, T completion positions, mask [B, T].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.errors import ConfigError, PhantomclipError, check_number


def clip_range(epsilon: float, epsilon_high: float | None = None) -> tuple[float, float]:
    """(ε_low, ε_high) of PPO's trust region [1 − ε_low, 1 + ε_high]: ε_high defaults to ε_low (the symmetric clip of
    Schulman et al. 2017; DAPO's clip-higher, Yu et al. 2025, sets it apart). The one place this default lives."""
    return epsilon, epsilon if epsilon_high is None else epsilon_high


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_rewards: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std when `scale_rewards`.

    rewards: [N] with N = groups * group_size, groups contiguous. Returns [N]. (Shao et al. 2024, DeepSeekMath;
    Dr. GRPO, Liu et al. 2025, drops the std division: scale_rewards=False.)
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).double()  # [G, g]
    adv = r - r.mean(-1, keepdim=True)
    if scale_rewards:
        std = r.std(-1, keepdim=True)  # unbiased, as TRL
        adv = torch.where(std > 0, adv / (std + eps), torch.zeros_like(adv))  # a constant group teaches nothing
    return adv.view(-1).to(rewards.dtype)


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask, 0 elsewhere; unlike x * mask, a NaN/inf at a padded position cannot leak in."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def log_importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """Per-token log ratio [B, T], or GSPO's sequence-level one: the masked mean over the sequence, broadcast [B, 1]."""
    if level == "token":
        return log_ratio
    if level == "sequence":  # Zheng et al. 2025 (GSPO): geometric mean of the token ratios
        return (_masked(log_ratio, mask).sum(-1) / mask.sum(-1).clamp_min(1)).unsqueeze(-1)
    raise ValueError(f"unknown importance sampling level {level!r}: use token or sequence")


@dataclass
class SurrogateOut:
    per_token_loss: torch.Tensor  # [B, T]
    clipped_low: torch.Tensor  # [B, T] bool: A < 0 and r < 1 - eps_low (gradient zero)
    clipped_high: torch.Tensor  # [B, T] bool: A > 0 and r > 1 + eps_high (gradient zero)


def clipped_surrogate(
    log_w: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> SurrogateOut:
    """PPO's −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A) per token (Schulman et al. 2017). ε = inf disables the clip.

    log_w: [B, T] or [B, 1]; advantages: [B]. The gradient is exactly zero where the clipped branch wins,
    which happens only for A > 0, r > 1+ε_high and for A < 0, r < 1−ε_low.
    """
    adv = advantages[:, None]  # [B, 1]
    r = torch.exp(log_w)  # [B, T]
    r_clip = torch.clamp(r, 1 - eps_low, 1 + eps_high)  # infinite ε: an infinite bound, no clip on that side
    per_token = -torch.min(r * adv, r_clip * adv)  # [B, T]
    with torch.no_grad():
        clipped_low = ((r < 1 - eps_low) & (adv < 0)).expand_as(per_token)
        clipped_high = ((r > 1 + eps_high) & (adv > 0)).expand_as(per_token)
    return SurrogateOut(per_token_loss=per_token, clipped_low=clipped_low, clipped_high=clipped_high)


# -------------------------------------------------------------------------------------------- aggregations


def _agg_grpo(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences (the original GRPO; length-biased)."""
    return (_masked(per_token, mask).sum(-1) / mask.sum(-1).clamp_min(1)).mean()


def _agg_dapo(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Mean over all tokens of the batch (DAPO, Yu et al. 2025)."""
    return _masked(per_token, mask).sum() / mask.sum().clamp_min(1)


def _agg_dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Sum over tokens divided by a constant, B x max completion length (Dr. GRPO, Liu et al. 2025)."""
    return _masked(per_token, mask).sum() / (per_token.shape[0] * max_len)


AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "grpo": _agg_grpo,
    "dapo": _agg_dapo,
    "dr_grpo": _agg_dr_grpo,
}


# -------------------------------------------------------------------------------------- rollout corrections


@dataclass(frozen=True)
class Knob:
    """A PPO-clip or rollout-correction setting, declared once: its default, its valid range and what it does. Every
    command that takes it (train, experiment, diagnose, and the TRL and verl config readers through diagnose's
    config) validates it with `check` and shows `help`, so a value means the same thing everywhere."""

    default: float | None
    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    help: str = ""

    def range_text(self) -> str:
        """'in (0, 1)', 'in [0, 1]', '> 0', '>= 1': the valid range as the help and errors write it."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def check(self, flag: str, value, error: type[PhantomclipError] = ConfigError) -> None:
        """Refuse `value` outside the range, in one line naming `flag` (errors.check_number)."""
        check_number(flag, value, self.low, self.high, low_open=self.low_open, high_open=self.high_open, error=error)


KNOBS: dict[str, Knob] = {
    # ε_low >= 1 would put the lower bound 1 − ε at or below 0: no ratio is ever clipped below
    "epsilon": Knob(0.2, 0, 1, low_open=True, high_open=True,
                    help="PPO clip ε_low: the ratio's lower bound is 1 − ε_low"),
    # ε_high has no upper limit: widening it until nothing clips is one of the analysis' fixes
    "epsilon_high": Knob(None, 0, low_open=True,
                         help="PPO clip ε_high (DAPO's clip-higher): the upper bound is 1 + ε_high; default: "
                              "the same as --epsilon (loss.clip_range)"),
    # Every correction compares strictly (r > C, r < low, r > high), so a bound of exactly 1 never cuts a ratio
    # of 1 (a token the policy did not move): 1 is allowed, beyond it is not.
    "cap": Knob(3.0, 1, help="cap C of the truncate / mask corrections (TIS, MIS, TRL's vllm_importance_sampling_"
                             "clip_max): ratios above C are truncated to C or masked"),
    "icepop_low": Knob(0.5, 0, 1, help="IcePop's lower bound: tokens whose ratio is below it are masked (Ring-1T's "
                                       "0.5)"),
    "icepop_high": Knob(2.0, 1, help="IcePop's upper bound: tokens whose ratio is above it are masked (Ring-1T's 2)"),
}


def check_knobs(config, fields: dict[str, str], error: type[PhantomclipError] = ConfigError) -> None:
    """Validate a command's config: `fields` maps its field names to KNOBS names (the flag is the field's name,
    --with-dashes); a None value (epsilon_high's default) is left to its fallback."""
    for field_name, knob in fields.items():
        value = getattr(config, field_name)
        if value is not None:
            KNOBS[knob].check("--" + field_name.replace("_", "-"), value, error)


@dataclass(frozen=True)
class CorrectionParams:
    """Settings of a rollout correction (TRL's vllm_importance_sampling_* names where they exist; KNOBS)."""

    cap: float = KNOBS["cap"].default
    """C: token/sequence ratios above C are truncated to C (`*_truncate`) or masked (`*_mask`)."""
    icepop_low: float = KNOBS["icepop_low"].default
    """IcePop: tokens whose ratio is below this are masked."""
    icepop_high: float = KNOBS["icepop_high"].default
    """IcePop: tokens whose ratio is above this are masked."""


def _token_log_is(logp_old: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(logp_old - logp_engine, mask)  # [B, T]


def _seq_log_is(logp_old, logp_engine, mask) -> torch.Tensor:
    return _token_log_is(logp_old, logp_engine, mask).sum(-1, keepdim=True)  # [B, 1]: log Π r_t (TRL's sequence modes)


def _corr_none(lo, le, m, p):
    return torch.ones_like(lo), torch.zeros_like(m, dtype=torch.bool)


def _corr_token_truncate(lo, le, m, p):
    """TIS (Yao et al. 2025): weight min(r, C) per token."""
    return torch.exp(_token_log_is(lo, le, m)).clamp(max=p.cap), torch.zeros_like(m, dtype=torch.bool)


def _corr_token_mask(lo, le, m, p):
    """MIS: weight r per token, zero where r > C."""
    r = torch.exp(_token_log_is(lo, le, m))
    masked = r > p.cap
    return r.masked_fill(masked, 0.0), masked & m.bool()


def _corr_sequence_truncate(lo, le, m, p):
    """Sequence-level TIS: one weight min(Π r_t, C) for every token of the sequence."""
    w = torch.exp(_seq_log_is(lo, le, m)).clamp(max=p.cap)
    return w.expand_as(lo), torch.zeros_like(m, dtype=torch.bool)


def _corr_sequence_mask(lo, le, m, p):
    """Sequence-level MIS (TRL's default): weight Π r_t, whole sequence masked where it exceeds C."""
    w = torch.exp(_seq_log_is(lo, le, m))  # [B, 1]
    masked = w > p.cap
    return w.masked_fill(masked, 0.0).expand_as(lo), masked.expand_as(lo) & m.bool()


def _corr_icepop(lo, le, m, p):
    """IcePop (Ring-1T): two-sided token masking, no reweighting: drop tokens with r outside [low, high]."""
    r = torch.exp(_token_log_is(lo, le, m))
    masked = (r < p.icepop_low) | (r > p.icepop_high)
    return (~masked).to(lo.dtype), masked & m.bool()


CORRECTIONS: dict[str, Callable] = {
    "none": _corr_none,
    "token_truncate": _corr_token_truncate,
    "token_mask": _corr_token_mask,
    "sequence_truncate": _corr_sequence_truncate,
    "sequence_mask": _corr_sequence_mask,
    "icepop": _corr_icepop,
}


def rollout_correction(
    logp_old: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor, mode: str = "none",
    params: CorrectionParams = CorrectionParams(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, T], masked [B, T] bool) correcting for sampling from the engine instead of the trainer.

    The ratio is taken between `logp_old` (the trainer's log-probs at rollout time, no grad) and `logp_engine`.
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}: use one of {', '.join(CORRECTIONS)}")
    with torch.no_grad():
        return CORRECTIONS[mode](logp_old.detach(), logp_engine, mask, params)


# ---------------------------------------------------------------------------------------------- the loss


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, with grad
    clipped_low: torch.Tensor  # [B, T] bool
    clipped_high: torch.Tensor  # [B, T] bool
    masked: torch.Tensor  # [B, T] bool, removed by the rollout correction
    is_weight: torch.Tensor  # [B, T] rollout-correction weight


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    loss_type: str = "dapo",
    level: str = "token",
    max_len: int | None = None,
    is_weight: torch.Tensor | None = None,
    is_masked: torch.Tensor | None = None,
    clip_log_ratio: torch.Tensor | None = None,
) -> LossOut:
    """The clipped GRPO objective.

    `clip_log_ratio` (optional, no grad) replaces the log ratio *in the clip decision only*: the loss becomes
    −min(r·A, clip(r·k, …)/k·A) with k = exp(clip_log_ratio − log r) detached, i.e. the token is clipped exactly
    where exp(clip_log_ratio) leaves the trust region, while the gradient still flows through `logp`
    (the shadow-ratio intervention: clip on α only). On clipped tokens the loss *value* is then clip(r')·A·r/r',
    not PPO's clip(r)·A; the gradient, zero there, is what matters. `is_weight`/`is_masked` come from
    `rollout_correction`. No KL term to a reference model (TRL's default beta = 0; the trainer's docstring says so).
    """
    if loss_type not in AGGREGATIONS:
        raise ValueError(f"unknown loss type {loss_type!r}: use one of {', '.join(AGGREGATIONS)}")
    mask_f = mask.to(logp.dtype)
    log_w = log_importance_weights(logp - logp_old, mask_f, level)  # [B, T] or [B, 1]
    if clip_log_ratio is not None:
        # Shift the ratio so its value equals exp(clip_log_ratio) but its gradient is d r: the clip then fires on
        # the shadow ratio. (r·k with k = exp(c − log r).detach() has value e^c and gradient k·dr.)
        c = log_importance_weights(clip_log_ratio, mask_f, level)
        shift = (c - log_w).detach()
        sur = clipped_surrogate(log_w + shift, advantages, eps_low, eps_high)
        per_token = sur.per_token_loss * torch.exp(-shift)  # undo k so the unclipped branch equals r·A
    else:
        sur = clipped_surrogate(log_w, advantages, eps_low, eps_high)
        per_token = sur.per_token_loss
    per_token = per_token.expand_as(logp)
    weight = torch.ones_like(logp) if is_weight is None else is_weight
    per_token = per_token * weight
    loss = AGGREGATIONS[loss_type](per_token, mask_f, max_len or logp.shape[1])
    m = mask.bool()
    masked = torch.zeros_like(m) if is_masked is None else is_masked.bool() & m
    return LossOut(loss=loss, clipped_low=sur.clipped_low & m, clipped_high=sur.clipped_high & m, masked=masked,
                   is_weight=weight)
