"""α, β and the PPO clip's decisions inside verl, from the log-probs verl already holds (verl 0.9.1).

Two places see the figures, on two kinds of process:

- **The driver** (the process that runs `RayPPOTrainer.fit`) holds, in decoupled mode, the engine's log-probs
  (`rollout_log_probs`) and the actor's recompute at the same weights (`old_log_probs`) in one batch, which
  `compute_rollout_correction_and_add_to_batch` (verl/trainer/ppo/rollout_corr_helper.py) turns into IS weights,
  a rejection mask and `rollout_corr/*` metrics; ray_trainer.py imports it by name at each step (`from
  verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch`, inside `fit`), so the
  module attribute is the hook. `old_log_probs − rollout_log_probs` is β itself, exactly, for every token, at no
  extra forward: both are log-probs of the same weights, one from the trainer's forward and one from the engine's.
  `driver_figures` adds `phantomclip/*` beside verl's `rollout_corr/*`: β's figures, the share of β outside the PPO
  trust region (the tokens bypass mode would clip at α = 0), and what the user's IS/RS settings did with β (the
  tokens and sequences whose weight was truncated or zeroed, those rejection sampling removed, the weights' ESS).
- **Each actor worker** runs the policy loss verl's `ppo_loss` (verl/workers/utils/losses.py) looks up by
  `actor.policy_loss.loss_mode` in verl's registry (`get_policy_loss_fn`, verl/trainer/ppo/core_algos.py). This module
  registers `phantomclip_vanilla` and `phantomclip_bypass_mode`: each calls verl's own `vanilla` or `bypass_mode` with
  the same arguments and returns its loss object unchanged (so the loss and its gradient are verl's, bit for bit), and
  adds the clip's decisions on the ratio verl clips, as integer counts summed over the data-parallel group verl's engine
  hands `ppo_loss` (`clip_counts`; `install` wraps `ppo_loss` to keep the group, which verl does not pass on to a policy
  loss). In decoupled mode that ratio is π_θ / π_old, the trainer against its own recompute: α, and its clips are real
  ones (β reaches the loss only through the IS weights). In bypass mode `apply_bypass_mode` sets old_log_probs :=
  rollout_log_probs on the driver and the clip sees α + β: every clip is counted, but which of them are phantom needs α
  alone, i.e. the actor's recompute, which bypass mode exists to skip (docs/verl.md: what that costs, and decoupled mode
  with token TIS as the fix). `apply_bypass_mode` also writes loss_mode := "bypass_mode" into the driver's copy of the
  actor config, after the workers were built from it (ray_trainer.py `fit`, after `init_workers`): the workers keep the
  loss_mode they were given.

Load it in every verl process with verl's own plugin switch, `VERL_USE_EXTERNAL_MODULES=phantomclip.integrations.verl`
(verl/__init__.py imports each listed module whenever verl is imported, driver and workers alike), and set
`actor_rollout_ref.actor.policy_loss.loss_mode=phantomclip_vanilla`. docs/verl.md has the config lines, what runs
where and what each figure means. Every verl name used here was read from verl 0.9.1 (the PyPI wheel).
"""

from __future__ import annotations

import importlib.util
import math
import os
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from ..base.errors import IntegrationError
from ..maths.metrics import ess_share, trust_region_split
from .ranks import top_quantile

SUPPORTED_VERL = "0.9.1"
"""the verl release every hook here was read from and tested against (tests/test_integrations_verl_inside.py)."""
PREFIX = "phantomclip/"
"""every figure's key starts with it: verl logs it beside its own rollout_corr/* and actor/* keys."""
DELEGATES = ("vanilla", "bypass_mode")
"""the verl loss modes measured: the two whose clip is the token-level PPO clip on log_prob − old_log_prob (bypass
mode's default loss_type "ppo_clip" calls vanilla, core_algos.py compute_policy_loss_bypass_mode). The other modes
clip something else (gspo a sequence ratio, sapo a soft gate, cispo the weight): their decisions are not these."""
LOSS_NAMES = {mode: f"phantomclip_{mode}" for mode in DELEGATES}
"""the registered name for each delegate: set actor.policy_loss.loss_mode to it."""
SAFETY_BOUND = 20.0
"""verl clamps a log ratio to ±20 before exp, in the loss and in the IS weights (core_algos.py compute_policy_loss_
vanilla; rollout_corr_helper.py SAFETY_BOUND): the figures here take the same clamp where they decide as verl does."""
EPS_ENV = ("PHANTOMCLIP_VERL_CLIP_LOW", "PHANTOMCLIP_VERL_CLIP_HIGH")
"""the driver's trust region for `beta_outside_trust_region` (the driver's helper is not given the actor's config):
set them to actor.clip_ratio_low / clip_ratio_high; unset, both are verl's default clip_ratio, 0.2."""


def check_verl_version() -> str:
    """The installed verl's version, or one line saying which one these hooks need."""
    try:
        installed = version("verl")
    except PackageNotFoundError:
        raise IntegrationError(f"phantomclip.integrations.verl needs verl: pip install 'phantomclip[verl]' "
                               f"(verl=={SUPPORTED_VERL})") from None
    if installed != SUPPORTED_VERL:
        raise IntegrationError(f"phantomclip.integrations.verl was read from verl {SUPPORTED_VERL} (installed: "
                               f"{installed}): it wraps rollout_corr_helper and the loss registry, which change "
                               f"between releases; install verl=={SUPPORTED_VERL}")
    return installed


def driver_eps() -> tuple[float, float]:
    """(ε_low, ε_high) for the driver's trust-region share, from EPS_ENV (default 0.2 each), checked in one line."""
    out = []
    for name in EPS_ENV:
        raw = os.environ.get(name, "0.2")
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not 0 < value < 10:
            raise IntegrationError(f"{name}={raw!r}: give the actor's clip ratio as a number in (0, 10), e.g. 0.2")
        out.append(value)
    return out[0], out[1]


class _LossGroup:
    """The data-parallel group of the loss call in progress: verl's engines hand it to `ppo_loss` (`dp_group=
    self.get_data_parallel_group()`: FSDP's Ulysses "dp" mesh dimension or the whole world, Megatron's data-parallel
    group; workers/engine/fsdp/ and megatron/transformer_impl.py), which does not pass it on to the policy loss, so
    the wrapper of `ppo_loss` that `install` sets keeps it here for the call. Reducing over it counts each token once
    where sequence or tensor parallel ranks hold the same tokens, and under pipeline parallelism joins only the last
    stage's ranks, the only ones that call the loss (a reduce over every rank would wait forever)."""

    group = None


def _world_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the loss call's data-parallel group (_LossGroup), else every rank (itself without a group)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(_LossGroup.group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=_LossGroup.group)
    return x


def _with_loss_group(original):
    """verl's `ppo_loss` (workers/utils/losses.py), keeping its `dp_group` in _LossGroup while it runs."""

    def ppo_loss(config, model_output, data, dp_group=None):
        previous, _LossGroup.group = _LossGroup.group, dp_group
        try:
            return original(config, model_output, data, dp_group)
        finally:
            _LossGroup.group = previous

    ppo_loss._phantomclip, ppo_loss.__wrapped__ = True, original
    return ppo_loss


# ---------------------------------------------------------------------------------------------------------------
# The worker: the clip's decisions on the ratio verl clips


CLIP_KEYS = ("tokens", "clip_high_tokens", "clip_low_tokens", "dual_clip_tokens", "log_ratio_abs_sum")
"""the sums behind `clip_counts`' figures, in this order; its one all-reduce per call carries them with the third
replaced by every clipped token (the low ones are those less the high ones)."""


def clip_counts(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, clip_low: float, clip_high: float, clip_c: float = 3.0) -> dict:
    """The token clip's decisions of verl's `vanilla` loss, summed over every rank. All tensors [B, T].

    Decided with verl's own comparisons, in the inputs' dtype (core_algos.py compute_policy_loss_vanilla), so that
    ties round as verl's do: ℓ = clamp(log_prob − old_log_prob, ±20), r = exp(ℓ); a token is clipped when the clipped
    branch wins, −A·clip(r, 1 − ε_low, 1 + ε_high) > −A·r (`pg_losses2 > pg_losses1`: its gradient is zero, and
    verl's pg_clipfrac counts it), high when A > 0 (r > 1 + ε_high), low when A < 0 (r < 1 − ε_low); dual-clipped
    when A < 0 and max(−A·r, −A·clip(r)) > −A·c (verl's pg_clipfrac_lower).
    Counts are exact integers held in float64 (exact below 2^53 tokens); one all-reduce of the five sums over the
    loss call's data-parallel group (_LossGroup) runs on every rank of it at every call, whatever it holds. verl gives
    every data-parallel rank the same number of micro-batches (workers/engine/fsdp/transformer_impl.py,
    `same_micro_num_in_dp=True`), so every rank of the group calls this equally often.
    """
    with torch.no_grad():
        m = response_mask.bool()  # [B, T]
        lr = (log_prob.detach() - old_log_prob.detach()).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
        r = torch.exp(lr)  # [B, T]
        plain, clipped = -advantages * r, -advantages * r.clamp(1 - clip_low, 1 + clip_high)  # [B, T] each
        wins = m & (clipped > plain)  # [B, T] (never where A = 0: both sides are 0 there)
        pos = advantages > 0  # [B, T]
        dual = m & ~pos & (torch.maximum(plain, clipped) > -advantages * clip_c)  # [B, T]
        counts = torch.stack([m.sum(), (wins & pos).sum(), wins.sum(), dual.sum()]).double()  # [4] int64 -> float64
        abs_sum = (lr.abs() * m).sum(dtype=torch.float64).reshape(1)  # [1] each fp32 |ℓ| summed in float64
        sums = _world_sum(torch.cat([counts, abs_sum]).to(log_prob.device))  # [5]
    tokens, high, wins_n, dual_n, abs_total = sums.tolist()
    sums_by_key = (tokens, high, wins_n - high, dual_n, abs_total)  # low = clipped with A < 0 = all clipped − high
    total = dict(zip(CLIP_KEYS, sums_by_key))
    n = total["tokens"]
    rate = (lambda x: x / n) if n else (lambda x: math.nan)
    return {"tokens": int(n), "clip_high_tokens": int(total["clip_high_tokens"]),
            "clip_low_tokens": int(total["clip_low_tokens"]), "dual_clip_tokens": int(total["dual_clip_tokens"]),
            "clip_rate": rate(total["clip_high_tokens"] + total["clip_low_tokens"]),
            "log_ratio_abs_mean": rate(total["log_ratio_abs_sum"])}


def _clip_config(config) -> tuple[float, float, float]:
    """(ε_low, ε_high, c) as verl's vanilla loss reads them from the actor config (core_algos.py)."""
    eps = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    return low, high, config.get("clip_ratio_c", 3.0)


def worker_figures(mode: str, old_log_prob, log_prob, advantages, response_mask, config) -> dict[str, float]:
    """The `phantomclip/actor/*` figures a registered loss adds to verl's: the clip's decisions (`clip_counts`) on
    the ratio verl clips, log_prob − old_log_prob. What that ratio holds is the batch's, not the loss's to know: α in
    decoupled mode (old_log_prob is the actor's recompute), α + β in bypass mode (old_log_prob is the engine's:
    ray_trainer.py sets it so on the driver, whichever loss_mode the workers were built with)."""
    counts = clip_counts(old_log_prob, log_prob, advantages, response_mask, *_clip_config(config))
    return {f"{PREFIX}actor/{k}": counts[k] for k in ("tokens", "log_ratio_abs_mean", "clip_rate",
                                                       "clip_high_tokens", "clip_low_tokens", "dual_clip_tokens")}


def _measured(mode: str):
    """A policy loss with verl's registry signature that returns verl's `mode` loss object itself, plus figures."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    delegate = POLICY_LOSS_REGISTRY[mode]

    def loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
        pg_loss, metrics = delegate(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                                    response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                                    rollout_is_weights=rollout_is_weights)
        corr = config.policy_loss.get("rollout_correction", None) if mode == "bypass_mode" else None  # as verl reads it
        if corr is not None and corr.get("loss_type", "ppo_clip") != "ppo_clip":
            return pg_loss, metrics  # bypass mode's REINFORCE: no clip to measure
        return pg_loss, {**metrics, **worker_figures(mode, old_log_prob, log_prob, advantages, response_mask,
                                                     config)}

    loss.__name__ = LOSS_NAMES[mode]
    loss._phantomclip_delegate = mode
    return loss


def register_losses() -> dict[str, str]:
    """Register `phantomclip_vanilla` and `phantomclip_bypass_mode` in verl's policy-loss registry (idempotent);
    returns {delegate: registered name}."""
    check_verl_version()
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    for mode, name in LOSS_NAMES.items():
        if name not in POLICY_LOSS_REGISTRY:
            register_policy_loss(name)(_measured(mode))
    return dict(LOSS_NAMES)


# ---------------------------------------------------------------------------------------------------------------
# The driver: β from the batch verl's rollout correction reads


def _is_rule(config) -> tuple[str | None, float, float | None]:
    """(level, upper, lower) of the user's IS setting, parsed as verl parses rollout_is_threshold (rollout_corr_
    helper.py _parse_rollout_is_threshold: a number is TIS's upper bound, "lo_hi" is IcePop's band)."""
    level, spec = config.get("rollout_is", None), config.get("rollout_is_threshold", 2.0)
    if level is None or spec is None:
        return None, math.inf, None
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        return level, float(hi), float(lo)
    return level, float(spec), None


def driver_figures(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask_before: torch.Tensor,
                   mask_after: torch.Tensor, weights: torch.Tensor | None, config, eps_low: float = 0.2,
                   eps_high: float = 0.2) -> dict[str, float]:
    """`phantomclip/*` figures of one step's batch on the driver (decoupled mode). All tensors [B, T].

    β = old_log_probs − rollout_log_probs on the tokens of mask_before (the response mask verl's correction read).
    beta_mean, beta_abs_mean, beta_abs_p99 (torch.quantile's linear rule), beta_abs_max, beta_outside_trust_region
    (share with β outside [log(1−ε_low), log(1+ε_high)]: the tokens bypass mode's clip would reach at α = 0, each a
    phantom clip when its advantage points out of the region); is_token_share / is_seq_share: tokens (sequences
    with at least one) whose IS weight the user's setting truncated (TIS: raw > upper) or zeroed (IcePop: raw
    outside [lower, upper]), raw = exp(clamp(β or the sequence's Σβ, ±20)) as verl computes it; rs_token_share /
    rs_seq_share: tokens (sequences with at least one) in mask_before and not in mask_after (rejection sampling);
    is_ess: (Σw)² / (N Σw²) of the applied weights over the N tokens of mask_after (1 when all are equal).
    """
    m0, m1 = mask_before.bool(), mask_after.bool()  # [B, T]
    beta = (old_log_probs.double() - rollout_log_probs.double())  # [B, T] fp32 − fp32: exact in float64
    ok = m0 & torch.isfinite(beta)  # [B, T]
    b = beta[ok]  # [N]
    n, seqs = b.numel(), (m0.sum(-1) > 0)  # seqs: [B] rows with a token
    nan = math.nan
    share = (lambda x: x.sum().item() / n) if n else (lambda x: nan)
    out = {"beta_tokens": n, "beta_nonfinite": int((m0 & ~torch.isfinite(beta)).sum()),
           "beta_mean": b.mean().item() if n else nan, "beta_abs_mean": b.abs().mean().item() if n else nan,
           "beta_abs_p99": top_quantile(b.abs(), n, 0.99), "beta_abs_max": b.abs().max().item() if n else nan,
           "beta_outside_trust_region": share(torch.logical_or(*trust_region_split(b, eps_low, eps_high)))}
    level, upper, lower = _is_rule(config)
    if level is not None:
        lr = torch.where(ok, beta, torch.zeros_like(beta))  # [B, T]
        per = lr if level == "token" else lr.sum(-1, keepdim=True).expand_as(lr)  # [B, T] the log weight's argument
        raw = torch.exp(per.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [B, T]
        touched = ok & ((raw > upper) | ((raw < lower) if lower is not None else torch.zeros_like(ok)))  # [B, T]
        out["is_token_share"] = share(touched[ok])
        out["is_seq_share"] = touched.any(-1)[seqs].double().mean().item() if seqs.any() else nan
    removed = m0 & ~m1  # [B, T]
    out["rs_token_share"] = removed.sum().item() / m0.sum().item() if m0.any() else nan
    out["rs_seq_share"] = removed.any(-1)[seqs].double().mean().item() if seqs.any() else nan
    if weights is not None:
        w = weights.double()[m1]  # [N1]
        out["is_ess"] = ess_share(w.log())  # zero weights (IcePop, RS) are log 0 = −inf: they count as 0
    return {f"{PREFIX}{k}": v for k, v in out.items()}


def install() -> None:
    """Register the losses, wrap verl's driver-side correction helper and its worker-side `ppo_loss` (for the loss
    call's data-parallel group), idempotent; run on import."""
    register_losses()
    from verl.trainer.ppo import rollout_corr_helper as helper

    if not getattr(helper.compute_rollout_correction_and_add_to_batch, "_phantomclip", False):
        helper.compute_rollout_correction_and_add_to_batch = _with_figures(
            helper.compute_rollout_correction_and_add_to_batch)
    from verl.workers.utils import losses

    if not getattr(losses.ppo_loss, "_phantomclip", False):  # before engine_workers binds it by name, as a plugin
        losses.ppo_loss = _with_loss_group(losses.ppo_loss)
    if recompute_every():
        install_bypass_recompute()


def _with_figures(original):
    """verl's compute_rollout_correction_and_add_to_batch, returning its batch and metrics plus `driver_figures`."""
    eps = driver_eps()

    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        before = batch.batch["response_mask"].clone()  # verl replaces it with the rejection-masked one
        batch, metrics = original(batch, rollout_corr_config)
        t = batch.batch
        weights = t["rollout_is_weights"] if "rollout_is_weights" in t.keys() else None
        metrics.update(driver_figures(t["old_log_probs"], t["rollout_log_probs"], before, t["response_mask"],
                                      weights=weights, config=rollout_corr_config, eps_low=eps[0], eps_high=eps[1]))
        return batch, metrics

    compute_rollout_correction_and_add_to_batch._phantomclip = True
    compute_rollout_correction_and_add_to_batch.__wrapped__ = original
    return compute_rollout_correction_and_add_to_batch




# ---------------------------------------------------------------------------------------------------------------
# Bypass mode: β needs the actor's recompute, which bypass mode skips; offered every k steps


RECOMPUTE_ENV = "PHANTOMCLIP_VERL_BYPASS_RECOMPUTE_EVERY"
"""k: in bypass mode, recompute the actor's log-probs at θ_old on every k-th step (0 or unset: never)."""


def recompute_every() -> int:
    """RECOMPUTE_ENV as an integer ≥ 0, checked in one line."""
    raw = os.environ.get(RECOMPUTE_ENV, "0")
    if not raw.isdigit():
        raise IntegrationError(f"{RECOMPUTE_ENV}={raw!r}: give a whole number of steps (k ≥ 1 measures every k-th "
                               "step; 0 never)")
    return int(raw)


class _BypassState:
    """The driver's bypass-mode measurement between the step's start and its metrics: the trainer (set when its fit
    starts), how many steps went by, and the recompute waiting for the step's advantages."""

    trainer = None
    steps = 0
    pending: dict | None = None


def bypass_figures(pending: dict, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                   advantages: torch.Tensor, eps_low: float, eps_high: float) -> dict[str, float]:
    """`phantomclip/*` of a bypass-mode step measured with the recompute: β's figures (`driver_figures`, the same
    definitions as decoupled mode), `phantom_clip_rate_at_alpha0` (the share of tokens whose gradient the clip zeroes
    on the first mini-batch, where θ = θ_old and α = 0: each is a phantom clip; later mini-batches clip on α + β
    with α ≠ 0), and `recompute_seconds`, the cost of the extra forward. A batch that no longer lines up with the
    recompute (reordered or resized since) gives `bypass_misaligned` = 1 and nothing else."""
    if pending["rollout"].shape != rollout_log_probs.shape or not torch.equal(pending["rollout"], rollout_log_probs):
        return {f"{PREFIX}bypass_misaligned": 1}
    old = pending["old"]  # [B, T] the actor's recompute at θ_old
    out = driver_figures(old, rollout_log_probs, response_mask, response_mask, weights=None, config={},
                         eps_low=eps_low, eps_high=eps_high)
    ok = response_mask.bool() & torch.isfinite(old) & torch.isfinite(rollout_log_probs)  # [B, T]
    beta = (old.double() - rollout_log_probs.double())[ok]  # [N]
    from ..maths.metrics import phantom_clip_mask

    phantom = phantom_clip_mask(beta, advantages[ok], eps_low, eps_high)  # [N]
    out[f"{PREFIX}phantom_clip_rate_at_alpha0"] = phantom.double().mean().item() if beta.numel() else math.nan
    out[f"{PREFIX}recompute_seconds"] = pending["seconds"]
    return out


def install_bypass_recompute() -> None:
    """Wrap three verl names so that bypass mode is measured every k steps (RECOMPUTE_ENV), idempotent:
    RayPPOTrainer.fit (to know the trainer), rollout_corr_helper.apply_bypass_mode (fit imports it by name at each
    step: run the actor's recompute, `RayPPOTrainer._compute_old_log_prob`, the forward decoupled mode runs, before
    verl's substitution) and ray_trainer.compute_data_metrics (a module global fit calls once the step's advantages
    exist: add `bypass_figures`). verl's own behaviour is unchanged: the recompute's log-probs go nowhere but here."""
    import time

    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo import rollout_corr_helper as helper

    every, eps = recompute_every(), driver_eps()
    if not getattr(ray_trainer.RayPPOTrainer.fit, "_phantomclip", False):
        fit = ray_trainer.RayPPOTrainer.fit

        def fit_remembered(self, *args, **kwargs):
            _BypassState.trainer = self
            return fit(self, *args, **kwargs)

        fit_remembered._phantomclip, fit_remembered.__wrapped__ = True, fit
        ray_trainer.RayPPOTrainer.fit = fit_remembered
    if not getattr(helper.apply_bypass_mode, "_phantomclip", False):
        bypass = helper.apply_bypass_mode

        def apply_bypass_mode(batch, rollout_corr_config=None, policy_loss_config=None):
            step, _BypassState.steps = _BypassState.steps, _BypassState.steps + 1
            if every and _BypassState.trainer is not None and step % every == 0 and "rollout_log_probs" in batch.batch:
                start = time.perf_counter()
                recomputed, _ = _BypassState.trainer._compute_old_log_prob(batch)
                _BypassState.pending = {"old": recomputed.batch["old_log_probs"],
                                        "rollout": batch.batch["rollout_log_probs"].clone(),
                                        "seconds": time.perf_counter() - start}
            bypass(batch=batch, rollout_corr_config=rollout_corr_config, policy_loss_config=policy_loss_config)

        apply_bypass_mode._phantomclip, apply_bypass_mode.__wrapped__ = True, bypass
        helper.apply_bypass_mode = apply_bypass_mode
    if not getattr(ray_trainer.compute_data_metrics, "_phantomclip", False):
        data_metrics = ray_trainer.compute_data_metrics

        def compute_data_metrics(batch, use_critic=True):
            metrics = data_metrics(batch=batch, use_critic=use_critic)
            pending, _BypassState.pending = _BypassState.pending, None
            if pending is not None:
                t = batch.batch
                metrics.update(bypass_figures(pending, t["rollout_log_probs"], t["response_mask"], t["advantages"],
                                              *eps))
            return metrics

        compute_data_metrics._phantomclip, compute_data_metrics.__wrapped__ = True, data_metrics
        ray_trainer.compute_data_metrics = compute_data_metrics


if importlib.util.find_spec("verl") is not None:  # imported as verl's plugin (or beside verl): hook in at once.
    install()  # Without verl the pure figures (clip_counts, driver_figures) still import; the rest says what is missing
