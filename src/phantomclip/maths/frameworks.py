"""Every RL framework's own mismatch figures, each computed by that framework's definition, and its published bars.

The frameworks all log some trainer/engine mismatch figure, each under its own name and by its own formula (a
mean |Δlog p|, a mean |Δp|, a k1 or k3 KL, a mean exp|Δlog p|, per token or per sequence). Here each is one pure
function of (logp, logp_engine, mask), read from the framework's source at the commit cited above it, so one
`diagnose` can say what verl, TRL, NeMo-RL, slime, SkyRL, prime-rl and OpenRLHF would log for the same tokens, and
hold it against the bounds those projects publish (THRESHOLDS). docs/metrics.md, section "Every framework's
mismatch figures", has the table of figures with formula and source.

Notation as in maths/metrics.py: per scored token t, ℓ_t = logp_t − logp_engine_t (trainer minus engine), r_t =
exp(ℓ_t); per sequence s (a row with at least one scored token), S_s = Σ_t ℓ_t over its n_s tokens, G_s = S_s / n_s.

Conventions shared by every figure (where a framework's code differs, its function's docstring says so):
- arithmetic in float64 (the frameworks compute in their tensors' dtype, mostly fp32: logged values agree with these
  to fp32 rounding);
- a token whose logp or logp_engine is NaN or ±inf is left out of every figure (as in `metrics.mismatch_stats`,
  which counts them in `nonfinite`);
- a row without a scored token is not a sequence (the frameworks count such a padding row as a sequence with
  S = 0; none of them produces one in normal use);
- a figure with no token (or no sequence, or too few for a std) is NaN, never an exception, where most frameworks
  log 0 or raise;
- the +1e-8 that verl's and NeMo-RL's `masked_mean` add to the token count (a relative 1e-8 / N) is left out.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..base.errors import ConfigError
from .metrics import mean_or_nan, pearson

FrameworkFigures = dict[str, float]
FrameworkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], FrameworkFigures]


@dataclass(frozen=True)
class _Tokens:
    """The scored tokens of a batch, in float64: per token (flat, [N]) and per sequence ([S])."""

    logp: torch.Tensor  # [N] trainer log-probs
    logp_engine: torch.Tensor  # [N] engine log-probs
    lr: torch.Tensor  # [N] ℓ = logp − logp_engine
    seq_sum: torch.Tensor  # [S] S_s = Σ ℓ over the sequence's tokens
    seq_len: torch.Tensor  # [S] n_s, float64
    seq_abs_mean: torch.Tensor  # [S] mean |ℓ| over the sequence's tokens
    seq_logp_mean: torch.Tensor  # [S] mean logp over the sequence's tokens
    seq_logp_engine_mean: torch.Tensor  # [S] mean logp_engine over the sequence's tokens


def _tokens(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> _Tokens:
    """Scored tokens (mask True, both log-probs finite) of [B, T] inputs, flattened and per sequence, in float64."""
    lp, le = logp.detach().double(), logp_engine.detach().double()  # [B, T]; fp32 − fp32 is exact in float64
    ok = mask.bool() & torch.isfinite(lp) & torch.isfinite(le)  # [B, T]
    zero = torch.zeros_like(lp)
    lp0, le0 = torch.where(ok, lp, zero), torch.where(ok, le, zero)  # [B, T], 0 off the scored tokens
    lr0 = lp0 - le0  # [B, T]
    n = ok.sum(-1).double()  # [B]
    has = n > 0  # [B] rows that are sequences
    n_s = n[has]  # [S]
    return _Tokens(
        logp=lp[ok], logp_engine=le[ok], lr=lr0[ok],
        seq_sum=lr0.sum(-1)[has],
        seq_len=n_s,
        seq_abs_mean=lr0.abs().sum(-1)[has] / n_s,
        seq_logp_mean=lp0.sum(-1)[has] / n_s,
        seq_logp_engine_mean=le0.sum(-1)[has] / n_s,
    )


def _max(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else float("nan")


def _min(x: torch.Tensor) -> float:
    return x.min().item() if x.numel() else float("nan")


def _std(x: torch.Tensor) -> float:
    """Unbiased std (torch.std's default, n − 1), as every framework here logs it; NaN below 2 values."""
    return x.std().item() if x.numel() >= 2 else float("nan")


def _lower_median(x: torch.Tensor) -> float:
    """torch.median: the lower of the two middle values for an even count (no interpolation); NaN when empty."""
    return x.median().item() if x.numel() else float("nan")


def _k3(lr: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 per token, r − 1 − ℓ ≥ 0: with samples from the engine an estimate of KL(engine ‖ trainer)."""
    return torch.exp(lr) - 1 - lr


# TRL, huggingface/trl tag v1.16.0 (the wheel this project pins), trl/trainer/grpo_trainer.py,
# GRPOTrainer._generate_and_score_completions: the IS ratio (the block under "Compute the importance sampling ratio
# when using vLLM") and its logged figures (the block after `if self.use_vllm and
# self.vllm_importance_sampling_correction:` that fills `sampling/...`); defaults in trl/trainer/grpo_config.py:
# vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
# vllm_importance_sampling_clip_max=3.0, vllm_importance_sampling_clip_min=None.
TRL_IS_CAP = 3.0
"""TRL's default `vllm_importance_sampling_clip_max` (C_max); its default C_min is None (no lower bound)."""


def trl(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """TRL GRPOTrainer's vLLM figures, default correction (sequence_mask, C_max = 3, no C_min).

    sampling/sampling_logp_difference/mean, /max   mean and max of |ℓ| over tokens
    sampling/importance_sampling_ratio/min|mean|max over sequences of ρ_s = exp(S_s), set to 0 where ρ_s > C_max
                                                   (the sequence is masked out of the loss)
    sampling/importance_sampling_ratio_raw/...     the same of exp(S_s) before the mask: not logged by TRL, the ratio
                                                   its correction starts from (phantomclip's name)

    TRL logs 0.0 for an empty batch; NaN here.
    """
    tok = _tokens(logp, logp_engine, mask)
    abs_lr = tok.lr.abs()  # [N]
    raw = torch.exp(tok.seq_sum)  # [S] product ratio Π r_t (inf past float64's range, then masked)
    kept = torch.where(raw > TRL_IS_CAP, torch.zeros_like(raw), raw)  # [S] sequence_mask: outside [-inf, C_max] -> 0
    return {
        "sampling/sampling_logp_difference/mean": mean_or_nan(abs_lr),
        "sampling/sampling_logp_difference/max": _max(abs_lr),
        "sampling/importance_sampling_ratio/min": _min(kept),
        "sampling/importance_sampling_ratio/mean": mean_or_nan(kept),
        "sampling/importance_sampling_ratio/max": _max(kept),
        "sampling/importance_sampling_ratio_raw/min": _min(raw),
        "sampling/importance_sampling_ratio_raw/mean": mean_or_nan(raw),
        "sampling/importance_sampling_ratio_raw/max": _max(raw),
    }


# verl, volcengine/verl commit b178a3cd56f58b2d502255daba591e92833930a7 (v0.7.0+125, 2026-01-29):
# - training/*: verl/utils/debug/metrics.py, calculate_debug_metrics (with rollout.calculate_log_probs=True);
# - rollout_corr/*: verl/trainer/ppo/rollout_corr_helper.py, compute_offpolicy_metrics (kl, k3_kl, log_ppl_abs_diff,
#   chi2_token, chi2_seq) and compute_is_metrics (rollout_is_eff_sample_size), SAFETY_BOUND = 20.0; the IS level and
#   threshold defaults from RolloutCorrectionConfig in verl/trainer/config/algorithm.py (rollout_is="sequence",
#   rollout_is_threshold=2.0).
VERL_SAFETY_BOUND = 20.0
"""verl's clamp on a log ratio before exp in chi² and the IS weights (rollout_corr_helper.SAFETY_BOUND)."""
VERL_IS_THRESHOLD = 2.0
"""verl's default rollout_is_threshold: IS weights are clamped to [1/2, 2] for the ESS."""


def verl(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """verl's debug metrics and its rollout-correction diagnostics.

    training/rollout_probs_diff_mean|max|std  of |exp(logp) − exp(logp_engine)| over tokens (probability space;
                                              std unbiased)
    training/rollout_actor_probs_pearson_corr Pearson correlation of exp(logp) and exp(logp_engine) over tokens
    rollout_corr/kl          mean of (logp_engine − logp) = mean −ℓ over tokens: k1 estimate of KL(engine ‖ trainer)
    rollout_corr/k3_kl       mean of r − ℓ − 1 over tokens: k3 estimate of the same KL
    rollout_corr/log_ppl_abs_diff  mean over sequences of |mean_t logp_engine − mean_t logp| = mean |G_s|
    rollout_corr/chi2_token  mean over tokens of exp(2 clamp(ℓ, ±20)) − 1 (E[ρ²] − 1)
    rollout_corr/chi2_seq    mean over sequences of exp(2 clamp(S_s, ±20)) − 1
    rollout_corr/rollout_is_eff_sample_size  at RolloutCorrectionConfig's defaults (sequence level, threshold 2):
                             w_s = clamp(exp(clamp(S_s, ±20)), 1/2, 2), broadcast to the sequence's tokens, so each
                             sequence weighs by its n_s: with m = Σ n_s w_s / N, ESS = 1 / (Σ n_s (w_s/m)² / N)
                             = m² N / Σ n_s w_s², in (0, 1]. (verl logs it only with rollout_is set: its trainer
                             YAML default is null; the dataclass default and the Seq-TIS preset are "sequence".)
    """
    tok = _tokens(logp, logp_engine, mask)
    p, q = torch.exp(tok.logp), torch.exp(tok.logp_engine)  # [N] trainer and engine probabilities
    diff = (p - q).abs()  # [N]
    lr = tok.lr  # [N]
    lr_safe = lr.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)  # [N]
    seq_safe = tok.seq_sum.clamp(-VERL_SAFETY_BOUND, VERL_SAFETY_BOUND)  # [S]
    w = torch.exp(seq_safe).clamp(1 / VERL_IS_THRESHOLD, VERL_IS_THRESHOLD)  # [S] truncated sequence IS weight
    n = tok.seq_len  # [S]
    if n.numel():
        m = (n * w).sum() / n.sum()  # token-weighted mean weight
        ess = (m.square() * n.sum() / (n * w.square()).sum()).item()
    else:
        ess = float("nan")
    return {
        "training/rollout_probs_diff_mean": mean_or_nan(diff),
        "training/rollout_probs_diff_max": _max(diff),
        "training/rollout_probs_diff_std": _std(diff),
        "training/rollout_actor_probs_pearson_corr": pearson(p, q),
        "rollout_corr/kl": mean_or_nan(-lr),
        "rollout_corr/k3_kl": mean_or_nan(_k3(lr)),
        "rollout_corr/log_ppl_abs_diff": mean_or_nan((tok.seq_logp_engine_mean - tok.seq_logp_mean).abs()),
        "rollout_corr/chi2_token": mean_or_nan(torch.exp(2 * lr_safe)) - 1,
        "rollout_corr/chi2_seq": mean_or_nan(torch.exp(2 * seq_safe)) - 1,
        "rollout_corr/rollout_is_eff_sample_size": ess,
    }


# NeMo-RL, NVIDIA-NeMo/RL commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (v0.1.0+1338), nemo_rl/algorithms/loss/
# loss_functions.py, ClippedPGLossFn.__call__ (`mult_prob_error`, `gen_kl_error`), nemo_rl/algorithms/utils.py
# calculate_kl (k3 with reference_policy_kl_type's default "k3", no clamps as called there); the definitions are
# also written out in docs/guides/grpo.md ("Multiplicative Token Probability Error", "KL Divergence Error").


def nemo_rl(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """NeMo-RL's ClippedPGLossFn figures, token means over the batch (logged as train/<name>).

    token_mult_prob_error  mean over tokens of exp(|ℓ|) (≥ 1; 1 means no mismatch)
    gen_kl_error           mean over tokens of k3 = r − 1 − ℓ with log r = logp − logp_engine: KL(P_gen ‖ P_policy)
    """
    lr = _tokens(logp, logp_engine, mask).lr  # [N]
    return {"token_mult_prob_error": mean_or_nan(torch.exp(lr.abs())), "gen_kl_error": mean_or_nan(_k3(lr))}


# slime, THUDM/slime commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (v0.3.1+38), slime/backends/megatron_utils/
# loss.py, policy_loss_function (`train_rollout_logprob_abs_diff = sum_of_sample_mean(|log_probs −
# rollout_log_probs|)`) with sum_of_sample_mean from slime/backends/megatron_utils/cp_utils.py get_sum_of_sample_mean,
# divided by the step's sample count in slime/observability/train_metric_utils.py reduce_train_step_metrics.


def slime(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """slime's train/train_rollout_logprob_abs_diff, at its default per-sample reduction.

    train_rollout_logprob_abs_diff  mean over sequences of (mean |ℓ| over the sequence's tokens): every sequence
                                    weighs the same, whatever its length. (With --calculate-per-token-loss slime
                                    takes the token mean instead; with several samples per rollout the mean is per
                                    rollout. Neither is modelled here.)
    """
    return {"train_rollout_logprob_abs_diff": mean_or_nan(_tokens(logp, logp_engine, mask).seq_abs_mean)}


# SkyRL, NovaSky-AI/SkyRL commit a9564572eb8e91076be43c1bd5e4615e3de17265 (skyrl_train-v0.4.0+516), skyrl/train/
# trainer.py, the `policy/rollout_train_logprobs_abs_diff_*` block after the policy forward pass.


def skyrl(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """SkyRL's policy/rollout_train_logprobs_abs_diff_{mean,std,max,min}: of |ℓ| over tokens (std unbiased).

    SkyRL skips the figures for a batch without tokens; NaN here.
    """
    d = _tokens(logp, logp_engine, mask).lr.abs()  # [N]
    return {
        "policy/rollout_train_logprobs_abs_diff_mean": mean_or_nan(d),
        "policy/rollout_train_logprobs_abs_diff_std": _std(d),
        "policy/rollout_train_logprobs_abs_diff_max": _max(d),
        "policy/rollout_train_logprobs_abs_diff_min": _min(d),
    }


# prime-rl, PrimeIntellect-ai/prime-rl commit 559b44772e471d1538537b8805cc77f3824a5e64 (v0.8.1.dev67), src/prime_rl/
# trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl (per token), gathered over the step's trainable tokens
# in src/prime_rl/trainer/rl/train.py (`mismatch_kl/all`) and summarised by src/prime_rl/trainer/utils.py
# compute_stats (mean, median, std, min, max).


def prime_rl(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """prime-rl's mismatch_kl/all/{mean,median,std,min,max}: of the per-token k3 = r − ℓ − 1 over tokens.

    median is torch.median's (the lower middle value for an even count), std unbiased.
    """
    k3 = _k3(_tokens(logp, logp_engine, mask).lr)  # [N]
    return {
        "mismatch_kl/all/mean": mean_or_nan(k3),
        "mismatch_kl/all/median": _lower_median(k3),
        "mismatch_kl/all/std": _std(k3),
        "mismatch_kl/all/min": _min(k3),
        "mismatch_kl/all/max": _max(k3),
    }


# OpenRLHF, OpenRLHF/OpenRLHF tag v0.11.0 (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7), openrlhf/models/loss.py,
# PolicyLoss.forward (`vllm_kl = masked_mean(rollout_log_probs − old_log_probs, action_mask, dim=None)`), logged from
# openrlhf/trainer/ray/ppo_actor.py as experience.info["vllm_kl"]; computed only with the vLLM IS correction on and
# policy_loss_type="ppo".


def openrlhf(logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor) -> FrameworkFigures:
    """OpenRLHF's vllm_kl: mean of (logp_engine − logp) = mean −ℓ over tokens, a k1 estimate of KL(engine ‖ trainer)."""
    return {"vllm_kl": mean_or_nan(-_tokens(logp, logp_engine, mask).lr)}


FRAMEWORKS: dict[str, FrameworkFn] = {
    "trl": trl,
    "verl": verl,
    "nemo-rl": nemo_rl,
    "slime": slime,
    "skyrl": skyrl,
    "prime-rl": prime_rl,
    "openrlhf": openrlhf,
}
"""framework name (`diagnose --framework NAME`) -> its figures."""

THRESHOLDS: dict[tuple[str, str], tuple[str, float, str]] = {
    ("verl", "training/rollout_probs_diff_mean"): (
        "<=", 0.01,
        "verl docs/faq/faq.rst @b178a3c: normally below 0.005, above 0.01 'indicates a precision issue' (0.01 taken "
        "as the bound)"),
    ("nemo-rl", "token_mult_prob_error"): (
        "<=", 1.05,
        "NeMo-RL docs/guides/dtensor-tp-accuracy.md @7ea279a: above 1.05 'indicative of a potential framework issue'; "
        "nemo_rl/algorithms/grpo.py plots the batch when > 1.05"),
    ("nemo-rl", "gen_kl_error"): (
        "<=", 1e-3,
        "NeMo-RL docs/guides/grpo.md @7ea279a: KL metrics 'below 1e-3 considered acceptable'"),
    ("slime", "train_rollout_logprob_abs_diff"): (
        "<=", 0.1,
        "slime slime/utils/arguments.py @624b824: --ci-train-rollout-logprob-abs-diff-threshold default 0.1, "
        "asserted as value <= bound in slime/backends/megatron_utils/model.py"),
    ("prime-rl", "mismatch_kl/all/mean"): (
        "<", 0.015,
        "prime-rl docs/development.md @559b447: a new model's PR must show every mismatch_kl entry below 0.015 (each "
        "of 20 steps of the math environment, batch 64, not their mean); a review rule, not a CI assert"),
    ("skyrl", "policy/rollout_train_logprobs_abs_diff_mean"): (
        "<=", 0.0104,
        "SkyRL tests/train/gpu_e2e_test/gsm8k_colocate.sh @a956457: its CI bound for Qwen2.5-1.5B-Instruct on gsm8k "
        "with FSDP colocated (0.01764 Megatron, 0.0193 fully async); a regression bar for that setup"),
}
"""(framework, figure) -> (op, bound, source): the figure is "ok" when `value op bound` holds."""

OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
}


def check_frameworks(names: list[str]) -> None:
    """ConfigError, one line naming the unknown names and listing the known ones, unless every name is in
    FRAMEWORKS (and there is at least one)."""
    if not names:
        raise ConfigError(f"--framework is empty: give one or more of {', '.join(FRAMEWORKS)}")
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        raise ConfigError(f"--framework {', '.join(unknown)}: unknown; choose from {', '.join(FRAMEWORKS)}")


def framework_figures(
    logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor, names: list[str]
) -> dict[str, FrameworkFigures]:
    """{framework: {figure: value}} for each named framework, in the order given (diagnose's JSON layout)."""
    check_frameworks(names)
    return {name: FRAMEWORKS[name](logp, logp_engine, mask) for name in names}


def judge(framework: str, figure: str, value: float | None) -> tuple[str | None, str]:
    """(threshold, verdict) of one figure against its published bound: threshold as "<= 0.01" or None without one;
    verdict "ok" when the bound holds, "over" when it does not, "-" without a bound or for a NaN (or JSON null)
    value (nothing to judge)."""
    bound = THRESHOLDS.get((framework, figure))
    if bound is None:
        return None, "-"
    op, limit, _ = bound
    if value is None or math.isnan(value):
        return f"{op} {limit:g}", "-"
    return f"{op} {limit:g}", "ok" if OPS[op](value, limit) else "over"


def judged_figures(
    logp: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor, names: list[str]
) -> list[dict]:
    """One row per figure of each named framework, in FRAMEWORKS order within a framework:
    {framework, figure, value, threshold ("<= 0.01" or None), verdict} (`judge`)."""
    rows = []
    for name, figs in framework_figures(logp, logp_engine, mask, names).items():
        for figure, value in figs.items():
            threshold, verdict = judge(name, figure, value)
            rows.append({"framework": name, "figure": figure, "value": value, "threshold": threshold,
                         "verdict": verdict})
    return rows
