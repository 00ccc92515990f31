"""One GRPO step of phantomclip's trainer, on a batch the producer sampled: rewards and group advantages, the
trainer's forward and the shadow's, the exact split of the ratio (α, β_kernel, β_precision), the loss with the run's
interventions, the optimizer step, and the step's metrics row and per-token record. The run around it (setup, the
loop, logging, stopping) is training/trainer.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..base.devices import clock
from ..base.files import rounded
from ..engines.local import sync_weights
from ..maths.loss import CorrectionParams, group_advantages, grpo_loss, rollout_correction
from ..maths.metrics import alpha_beta_stats, ratio_split
from ..precision.recipes import Recipe, without_quant
from ..precision.scoring import TrainerForward, score_packed
from .config import TrainConfig
from .interventions import Plan
from .producer import Batch


@dataclass
class StepContext:
    """What every training step uses, fixed for the run."""

    cfg: TrainConfig
    plan: Plan
    tokenizer: object
    reward_fn: Callable
    policy: TrainerForward
    """the trainer's differentiable forward over the fp32 master."""
    shadow: nn.Module
    """the current weights in the engine's recipe (no grad), synced after every update."""
    shadow_recipe: Recipe
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    plain_shadow: nn.Module | None = None  # FP8 engines: the shadow without its quantisers, synced alike (β_quant)


@dataclass
class StepOut:
    row: dict
    """the step's metrics.jsonl row (keys in docs/metrics.md)."""
    tokens: dict
    """per-token α, β parts, advantage and clip flags for tokens.jsonl."""


def train_step(batch: Batch, ctx: StepContext) -> StepOut:
    """One GRPO step on a rollout batch: rewards, the three log-prob forwards, the loss, one optimizer step."""
    cfg, plan = ctx.cfg, ctx.plan
    timings = {"time/generate_s": batch.generate_s, "time/engine_sync_s": batch.sync_s,
               "time/shadow_old_s": batch.shadow_old_s}
    packed, P = batch.packed, batch.rollout.prompt_width
    rewards, advantages = _rewards(batch, ctx)  # [B] each
    mask = packed["completion_mask"][:, P:]  # [B, L]
    logp_engine = packed["logp_engine"][:, P:]  # [B, L]

    t0 = time.perf_counter()
    logp_shadow = score_packed(ctx.shadow, ctx.shadow_recipe, packed, P, cfg.group_size, cfg.temperature)  # [B, L]
    logp_plain = (score_packed(ctx.plain_shadow, without_quant(ctx.shadow_recipe), packed, P, cfg.group_size,
                               cfg.temperature) if ctx.plain_shadow is not None else None)  # [B, L], FP8 engines
    timings["time/shadow_s"] = clock(logp_shadow.device) - t0
    # θ_old = θ_t on-policy: the shadow at θ_old is the shadow itself (α ≡ 0 with no extra forward)
    logp_shadow_old = logp_shadow if batch.logp_shadow_old is None else batch.logp_shadow_old  # [B, L]

    t0 = time.perf_counter()
    logp = ctx.policy.logprobs(packed, P, cfg.group_size, temperature=cfg.temperature)  # [B, L], with grad
    logp_old = {"engine": logp_engine, "trainer_old": batch.logp_old, "self": logp.detach()}[plan.ratio_against]
    # Rollout corrections weigh by π_trainer(θ_old) / μ_engine: the recomputed old log-probs when there are
    # some, else the current trainer log-probs (asynchronous GRPO has no other trainer-side old policy).
    is_ref = batch.logp_old if batch.logp_old is not None else logp.detach()
    params = CorrectionParams(cap=cfg.correction_cap, icepop_low=cfg.icepop_low, icepop_high=cfg.icepop_high)
    is_weight, is_masked = rollout_correction(is_ref, logp_engine, mask, plan.correction, params)
    alpha = logp_shadow - logp_shadow_old  # [B, L] the policy's own change, engine recipe on both sides
    out = grpo_loss(
        logp, logp_old, advantages, mask, eps_low=plan.eps_low, eps_high=plan.eps_high, loss_type=cfg.loss_type,
        level=cfg.importance_level, max_len=cfg.max_tokens, is_weight=is_weight, is_masked=is_masked,
        clip_log_ratio=alpha if plan.clip_on == "shadow" else None,
    )
    grad_norm, stepped = _optimizer_step(out.loss, ctx)
    timings["time/train_s"] = clock(logp.device) - t0
    # the shadow follows the update; the share of its values that changed is what the engine's next sync sees
    t0 = time.perf_counter()
    changed_share = sync_weights(ctx.shadow, ctx.policy.master)
    ctx.plain_shadow is None or sync_weights(ctx.plain_shadow, ctx.policy.master, count_changes=False)  # FP8 only
    timings["time/sync_s"] = clock(logp.device) - t0

    split = ratio_split(logp, logp_shadow, logp_shadow_old, logp_engine, logp_plain)  # float64 [B, L] each
    zeroed = out.clipped_low | out.clipped_high  # [B, L]
    # a token whose log-prob overflowed on any side (NaN weights, fp16 overflow) is counted, not averaged in
    finite = torch.stack([split["log_ratio"], split["alpha"], split["beta"]]).isfinite().all(0)  # [B, L]
    scored = mask.bool() & finite  # [B, L]
    row = {
        **_rollout_row(batch, rewards),
        **alpha_beta_stats(split, scored, advantages, zeroed, out.masked, eps_low=plan.eps_low, eps_high=plan.eps_high),
        "mismatch/nonfinite": int((mask.bool() & ~finite).sum()),
        "train/loss": out.loss.item(),
        "train/skipped": not stepped,
        "train/grad_norm": grad_norm,
        "train/loss_scale": ctx.scaler.get_scale() if plan.loss_scaling else 1.0,
        "sync/changed_share": changed_share,
        "sync/weights_lag": batch.step - batch.weights_version,
        **timings,
    }
    return StepOut(row=row, tokens=_token_record(split, scored, advantages, zeroed, out.masked))


def _rewards(batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rewards and group advantages [B], in the dtype the loss uses, checked there: a reward of 1e308 is
    finite in Python and inf in float32."""
    from .tasks import check_rewards_fit, compute_rewards

    ids = batch.rollout.completion_ids
    completions = [ctx.tokenizer.decode(c, skip_special_tokens=True) for c in ids]
    rewards = torch.tensor(compute_rewards(ctx.reward_fn, batch.prompts, completions, ids),
                           device=batch.packed["input_ids"].device)  # [B]
    advantages = group_advantages(rewards, ctx.cfg.group_size, ctx.cfg.scale_rewards)  # [B]
    check_rewards_fit(ctx.reward_fn, rewards, advantages)
    return rewards, advantages


def _rollout_row(batch: Batch, rewards: torch.Tensor) -> dict:
    """The step's number and what its rollout looked like: rewards and completion lengths."""
    lengths = torch.tensor([len(c) for c in batch.rollout.completion_ids], dtype=torch.float64)
    return {
        "step": batch.step + 1,
        "reward/mean": rewards.double().mean().item(),
        "reward/std": rewards.double().std().item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/stopped_share": sum(batch.rollout.finished) / len(batch.rollout.finished),
    }


def _optimizer_step(loss: torch.Tensor, ctx: StepContext) -> tuple[float, bool]:
    """Backward through the (scaled) loss, clip the gradient norm, one AdamW step; returns the norm before clipping
    and whether the weights moved. A non-finite loss, or a non-finite gradient without loss scaling, skips the update:
    one NaN would otherwise poison every weight. (With loss scaling the scaler skips overflowed steps itself and
    lowers the scale, as it is meant to.)"""
    if not torch.isfinite(loss):
        return float("nan"), False
    ctx.scaler.scale(loss).backward()
    ctx.scaler.unscale_(ctx.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(ctx.policy.master.parameters(), ctx.cfg.max_grad_norm)
    finite = bool(torch.isfinite(grad_norm))
    if finite or ctx.scaler.is_enabled():
        ctx.scaler.step(ctx.optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
        ctx.scaler.update()
    ctx.optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: reallocating them costs 0.6 s here
    return grad_norm.item(), finite


def _token_record(split: dict[str, torch.Tensor], mask: torch.Tensor, advantages: torch.Tensor, zeroed: torch.Tensor,
                  masked: torch.Tensor) -> dict[str, list]:
    """tokens.jsonl's per-token lists over the completion tokens (row-major): α, β and its parts, A, clip flags."""
    m = mask.bool()  # [B, L]
    parts = {n: rounded(split[n][m]) for n in ("alpha", "beta", "beta_kernel", "beta_precision", "beta_quant")
             if n in split}  # beta_quant: FP8 engines only
    return {**parts, "advantage": rounded(advantages[:, None].expand_as(m)[m]), "clipped": zeroed[m].tolist(),
            "masked": masked[m].tolist()}
