"""Asynchronous GRPO with the α/β decomposition: every step says how much of the PPO ratio is real policy change.

The loop, top to bottom (`train`):
  1. A producer thread samples batch k with the engine holding the weights of `staleness` steps ago
     (θ_{k−s}, cast to the engine's dtype at weight sync) and queues the rollout (with recompute-old or
     --split-kernel-gap it also scores it: the old log-probs / the engine's weights on the prefill path).
  2. The trainer computes rewards and group advantages, its own log-probs `logp` (grad, trainer recipe),
     and the shadow log-probs `logp_shadow` (current weights in the engine's recipe, no grad).
  3. log r = logp − logp_old is clipped as PPO does; by default logp_old = logp_engine (asynchronous GRPO,
     as TRL's AsyncGRPOTrainer), so log r = α + β with α = logp_shadow − logp_engine, β = logp − logp_shadow.
  4. One optimizer step on the fp32 master weights; the new weights are published to the producer.

How this departs from GRPO as published (Shao et al. 2024): one gradient step per batch (no PPO epochs),
token-mean loss ("dapo") by default, no KL term, and the old log-probs come from the engine, not the trainer,
unless `recompute-old` asks for TRL's synchronous default.

Interventions (`INTERVENTIONS`) are small dicts of changes to a `Plan`, composable with ',' and checked for
conflicts; the loss itself is `loss.grpo_loss`, a pure function.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .engine import LocalEngine, SamplingParams, sync_weights
from .interventions import INTERVENTIONS, Plan, TrainConfigError, resolve_plan
from .loss import (
    AGGREGATIONS,
    CorrectionParams,
    group_advantages,
    grpo_loss,
    rollout_correction,
)
from .metrics import alpha_beta_stats
from .producer import Batch, RolloutProducer, snapshot
from .recipes import RECIPES, Recipe, apply_recipe, get_recipe
from .runs import GracefulStop, RunDir

EXPERIMENT_LR = 3e-5
RESUME_MAY_CHANGE = ("steps", "versions", "schema", "checkpoint_every", "samples_per_step", "token_log_steps")
"""config keys a resumed run may change: none of them changes the numbers of the steps already taken."""


@dataclass
class TrainConfig:
    """One GRPO run. Every field is a `phantomclip train` flag (underscores become dashes)."""

    model: str = "smollm2-135m"
    """bundled 'smollm2-135m', 'tiny-random[:seed[:init_std]]', a model directory or a hub id."""
    task: str = "neglen"
    """reward task: neglen (reward = −length), target-length or add; ignored when --reward is given."""
    reward: str | None = None
    """a user reward 'module:function' taking (prompts, completions, completion_ids) -> list of floats."""
    trainer: str = "fp32"
    """trainer precision recipe (fp32, bf16, fp16, bf16-autocast, fp32-head) before interventions."""
    engine_dtype: str = "bf16"
    """engine dtype (bf16, fp16, fp32) before interventions."""
    intervention: str = "none"
    """comma-separated interventions (see `phantomclip train --list-interventions`), e.g. shadow-ratio or epsilon=0.3."""
    epsilon: float = 0.2
    """PPO clip ε_low."""
    epsilon_high: float | None = None
    """PPO clip ε_high (default: epsilon)."""
    steps: int = 40
    """optimizer steps (one batch each)."""
    prompts_per_step: int = 1
    """distinct prompts per batch."""
    group_size: int = 8
    """completions per prompt (GRPO group, at least 2)."""
    max_tokens: int = 32
    """max completion tokens."""
    temperature: float = 1.0
    """sampling temperature."""
    lr: float = EXPERIMENT_LR
    """AdamW learning rate. TRL's default 1e-6 barely moves the bundled model in a CPU budget of a few dozen
    steps; 3e-5 shows learning within them (README: 'Why these defaults')."""
    max_grad_norm: float = 1.0
    """gradient norm clip."""
    loss_type: str = "dapo"
    """loss aggregation: grpo, dapo (token mean) or dr_grpo."""
    importance_level: str = "token"
    """PPO ratio per token, or per sequence (GSPO geometric mean)."""
    scale_rewards: bool = True
    """divide advantages by the group std (off = Dr. GRPO)."""
    staleness: int = 1
    """the engine samples with weights this many steps old (0 = on-policy)."""
    correction_cap: float = 3.0
    """cap C of the truncate / mask rollout corrections."""
    seed: int = 0
    """seeds prompt choice and sampling: a run is deterministic for a seed."""
    stop_after_converged: int = 0
    """stop once the task has counted as converged for this many consecutive steps (0: always run --steps)."""
    checkpoint_every: int = 10
    """write a checkpoint every this many steps (and at the end, and on Ctrl-C)."""
    split_kernel_gap: bool = False
    """also score each rollout with the engine's own weights on the prefill path (one more no-grad forward, in the
    producer thread), splitting α into the policy's change and the engine's decode-vs-prefill kernel gap."""
    samples_per_step: int = 2
    """completions per step written to samples.jsonl."""
    token_log_steps: int = 5
    """per-token α, β, advantage and clip flags are written to tokens.jsonl for this many first steps."""
    prompts: str | None = None
    """prompts file (one per line or JSONL 'prompt'); default: the task's or the 64 bundled prompts."""
    matmul: str = "auto"
    """low-precision matmul kernels: auto, native or emulated (see README)."""

    def validate(self) -> None:
        checks = [
            (self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.group_size >= 2, f"--group-size must be >= 2 (GRPO compares completions of one prompt), got {self.group_size}"),
            (self.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {self.prompts_per_step}"),
            (self.staleness >= 0, f"--staleness must be >= 0 (0 = on-policy), got {self.staleness}"),
            (self.max_tokens >= 1, f"--max-tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature > 0, f"--temperature must be > 0, got {self.temperature}"),
            (self.lr > 0, f"--lr must be > 0, got {self.lr}"),
            (self.checkpoint_every >= 1, f"--checkpoint-every must be >= 1, got {self.checkpoint_every}"),
            (self.stop_after_converged >= 0, f"--stop-after-converged must be >= 0, got {self.stop_after_converged}"),
            (self.epsilon > 0, f"--epsilon must be > 0, got {self.epsilon}"),
            (self.epsilon_high is None or self.epsilon_high > 0, f"--epsilon-high must be > 0, got {self.epsilon_high}"),
            (self.loss_type in AGGREGATIONS, f"unknown --loss-type {self.loss_type!r}: use one of {', '.join(AGGREGATIONS)}"),
            (self.importance_level in ("token", "sequence"), f"unknown --importance-level {self.importance_level!r}: use token or sequence"),
            (self.trainer in RECIPES, f"unknown --trainer {self.trainer!r}: use one of {', '.join(RECIPES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainConfigError(message)
        resolve_plan(self)


# ------------------------------------------------------------------------------------------ components


class TrainerForward:
    """The trainer's differentiable forward: fp32 master weights cast into the recipe's layout on every call.

    The optimizer owns the fp32 master (as in mixed-precision training); the cast is part of the graph, so
    gradients reach the master in fp32 whatever the recipe computes in.
    """

    def __init__(self, master: nn.Module, recipe: Recipe, matmul: str):
        self.master, self.recipe = master, recipe
        plain_fp32 = recipe.weight_dtype == torch.float32 and not recipe.autocast_dtype and not recipe.fp32_modules
        self.layout = master if plain_fp32 else apply_recipe(master, recipe, matmul=matmul)
        by_name = master.state_dict(keep_vars=True)  # tied weights appear under both names
        self.sources = {name: by_name[name] for name, _ in self.layout.named_parameters()}
        self.dtypes = {name: p.dtype for name, p in self.layout.named_parameters()}

    def logprobs(self, packed: dict[str, torch.Tensor], prompt_width: int, group_size: int, grad: bool = True,
                 temperature: float = 1.0) -> torch.Tensor:
        """[B, L] log-probs of the packed batch's completion tokens (0 at padding), at `temperature`."""
        from torch.func import functional_call

        scorer = _Scorer(self.layout, self.recipe, prompt_width, group_size, grad, temperature)
        args = (packed["input_ids"], packed["attention_mask"], packed["completion_mask"])
        if self.layout is self.master:
            return scorer(*args)
        with torch.set_grad_enabled(grad):
            params = {f"model.{name}": src.to(self.dtypes[name]) for name, src in self.sources.items()}
        return functional_call(scorer, params, args)


class _Scorer(nn.Module):
    """`score_completions` as a module, so torch.func.functional_call can run it with substituted parameters."""

    def __init__(self, model: nn.Module, recipe: Recipe, prompt_width: int, group_size: int, grad: bool, temperature: float):
        super().__init__()
        self.model, self.recipe, self.prompt_width, self.group_size, self.grad = model, recipe, prompt_width, group_size, grad
        self.temperature = temperature

    def forward(self, input_ids, attention_mask, completion_mask):
        from .scoring import score_completions

        return score_completions(self.model, self.recipe, input_ids, attention_mask, completion_mask, self.prompt_width,
                                 self.group_size, grad=self.grad, temperature=self.temperature)


# ------------------------------------------------------------------------------------------ the loop


@dataclass
class TrainResult:
    metrics: list[dict]
    run_dir: Path | None
    interrupted: bool = False


def run_config(cfg: TrainConfig) -> dict:
    """config.json: every field, the resolved plan, versions. Resume compares this (minus steps/versions)."""
    import transformers

    from . import SCHEMA_VERSION, __version__

    return {
        "schema": SCHEMA_VERSION, **asdict(cfg), "plan": asdict(resolve_plan(cfg)),
        "versions": {"phantomclip": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


def train(
    cfg: TrainConfig, out: str | Path | None = None, resume: bool = False, console=None,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Run GRPO as configured; log to `out` (a run directory) if given. Ctrl-C stops after the current step
    with a checkpoint (a second Ctrl-C aborts at once; the last periodic checkpoint stays valid)."""
    from .models import load_model, stop_token_ids
    from .prompts import bundled_prompts, encode_prompts, read_prompts
    from .tasks import get_task, load_reward

    cfg.validate()
    plan = resolve_plan(cfg)
    task = get_task(cfg.task)
    reward_fn = load_reward(cfg.reward) if cfg.reward else task.reward
    config = run_config(cfg)
    # Model and prompts before the run directory: a bad --model or --prompts must not leave a directory behind.
    lm = load_model(cfg.model)
    master = lm.model.float().eval()
    if cfg.prompts:
        pool = read_prompts(cfg.prompts)
    else:
        pool = task.prompts(64, cfg.seed) if task.prompts and not cfg.reward else bundled_prompts()
    pool_ids = encode_prompts(lm.tokenizer, pool)
    stops = stop_token_ids(lm)
    run, ckpt = None, None
    if out is not None:
        if resume:
            run, ckpt = RunDir.resume(out, config, ignore=RESUME_MAY_CHANGE)
        else:
            run = RunDir.create(out, config)

    # fused: one kernel over all parameters (0.05 s per step on the bundled model against 0.7 s for foreach)
    optimizer = torch.optim.AdamW(master.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=plan.loss_scaling)
    start, snapshots = 0, {}
    if ckpt is not None:
        master.load_state_dict(ckpt["master"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start, snapshots = ckpt["step"], ckpt["snapshots"]
    snapshots[start] = snapshot(master)

    trainer_recipe, shadow_recipe = get_recipe(plan.trainer_recipe), get_recipe(plan.engine_recipe)
    policy = TrainerForward(master, trainer_recipe, cfg.matmul)
    shadow = apply_recipe(master, shadow_recipe, matmul=cfg.matmul)  # current weights, engine precision
    engine = LocalEngine(master, recipe=shadow_recipe, matmul=cfg.matmul)
    old_policy = apply_recipe(master, trainer_recipe, matmul=cfg.matmul) if plan.ratio_against == "trainer_old" else None
    engine_version = [-1]

    def make_batch(k: int, version: int, weights: dict) -> Batch:
        """Producer thread: sync the engine to θ_version if needed, sample batch k."""
        t0 = time.perf_counter()
        if engine_version[0] != version:
            engine.load_weights(weights, count_changes=False)  # the trainer counts them on its shadow
            engine_version[0] = version
        rng = random.Random(cfg.seed * 1_000_003 + k)
        chosen = [rng.randrange(len(pool)) for _ in range(cfg.prompts_per_step)]
        prompt_ids = [pool_ids[i] for i in chosen for _ in range(cfg.group_size)]
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=cfg.seed * 7919 + k, stop_token_ids=stops)
        rollout = engine.generate(prompt_ids, params)
        logp_old = logp_shadow_old = None
        packed = rollout.pack(stops[0] if stops else 0)
        if old_policy is not None:
            sync_weights(old_policy, weights, count_changes=False)
            logp_old = _completion_logprobs(old_policy, trainer_recipe, packed, rollout.prompt_width, cfg)
        if cfg.split_kernel_gap:  # the engine's weights, scored the way the shadow is
            logp_shadow_old = _completion_logprobs(engine.model, shadow_recipe, packed, rollout.prompt_width, cfg)
        return Batch(k, [pool[i] for i in chosen for _ in range(cfg.group_size)], rollout, packed, version, logp_old,
                     time.perf_counter() - t0, logp_shadow_old)

    producer = RolloutProducer(make_batch, start, cfg.steps, cfg.staleness)
    for version in sorted(snapshots):
        producer.publish(version, snapshots[version])
    producer.start()

    stop_requested = GracefulStop()
    metrics: list[dict] = list(run.metrics()) if run else []
    done = start
    progress = _progress(console, cfg.steps, start)
    try:
        with stop_requested, progress:
            for k in range(start, cfg.steps):
                t0 = time.perf_counter()
                batch = producer.get()
                t_wait = time.perf_counter() - t0
                row, tokens = _train_step(batch, cfg, plan, lm.tokenizer, reward_fn, policy, shadow, shadow_recipe, optimizer, scaler)
                # Versions below k+1-s are done with: batches up to k (consumed) used them, later ones use newer
                # ones. So the oldest one's buffers can take the new snapshot.
                stale = [v for v in snapshots if v < k + 1 - cfg.staleness]
                free = snapshots.pop(stale[0]) if stale else None
                for v in stale[1:]:
                    del snapshots[v]
                snapshots[k + 1] = snapshot(master, reuse=free)
                producer.publish(k + 1, snapshots[k + 1])
                row.update({"task/converged": bool(task.converged(row)), "time/wait_s": t_wait, "time/step_s": time.perf_counter() - t0})
                metrics.append(row)
                done = k + 1
                solved = finished_early(metrics, cfg.stop_after_converged)
                if run:
                    run.log_metrics(row)
                    run.log_samples(_samples(batch, row, lm.tokenizer, cfg.samples_per_step))
                    if done <= cfg.token_log_steps:
                        run.log_tokens({"step": done, **tokens})
                    if done % cfg.checkpoint_every == 0 or done == cfg.steps or stop_requested.flag or solved:
                        _save(run, done, master, optimizer, scaler, snapshots, cfg.staleness)
                progress.advance(row)
                if on_step:
                    on_step(row)
                if stop_requested.flag:
                    return TrainResult(metrics, run.path if run else None, interrupted=True)
                if solved:
                    break
    finally:
        producer.close()
    return TrainResult(metrics, run.path if run else None)


def finished_early(metrics: list[dict], patience: int) -> bool:
    """True once the last `patience` steps all counted as converged (never when patience is 0)."""
    return patience > 0 and len(metrics) >= patience and all(r["task/converged"] for r in metrics[-patience:])


def _completion_logprobs(model: nn.Module, recipe: Recipe, packed: dict, P: int, cfg: TrainConfig) -> torch.Tensor:
    """[B, L] no-grad log-probs of the completion tokens (columns P.. of a packed batch), at the sampling temperature."""
    from .scoring import score_completions

    return score_completions(model, recipe, packed["input_ids"], packed["attention_mask"], packed["completion_mask"], P,
                             cfg.group_size, temperature=cfg.temperature)


def _train_step(batch, cfg, plan, tokenizer, reward_fn, policy, shadow, shadow_recipe, optimizer, scaler) -> tuple[dict, dict]:
    from .tasks import compute_rewards

    timings = {"time/generate_s": batch.generate_s}
    rollout = batch.rollout
    completions = [tokenizer.decode(c, skip_special_tokens=True) for c in rollout.completion_ids]
    rewards = torch.tensor(compute_rewards(reward_fn, batch.prompts, completions, rollout.completion_ids))  # [B]
    advantages = group_advantages(rewards, cfg.group_size, cfg.scale_rewards)  # [B]
    packed = batch.packed
    P = rollout.prompt_width
    mask = packed["completion_mask"][:, P:]  # [B, L]
    logp_engine = packed["logp_engine"][:, P:]  # [B, L]

    t0 = time.perf_counter()
    logp_shadow = _completion_logprobs(shadow, shadow_recipe, packed, P, cfg)  # [B, L]
    timings["time/shadow_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    logp = policy.logprobs(packed, P, cfg.group_size, temperature=cfg.temperature)  # [B, L], with grad
    logp_old = {"engine": logp_engine, "trainer_old": batch.logp_old, "self": logp.detach()}[plan.ratio_against]
    # Rollout corrections weigh by π_trainer(θ_old) / μ_engine: the recomputed old log-probs when there are
    # some, else the current trainer log-probs (asynchronous GRPO has no other trainer-side old policy).
    is_ref = batch.logp_old if batch.logp_old is not None else logp.detach()
    is_weight, is_masked = rollout_correction(is_ref, logp_engine, mask, plan.correction, CorrectionParams(cap=cfg.correction_cap))
    clip_log_ratio = (logp_shadow - logp_engine) if plan.clip_on == "shadow" else None  # α
    out = grpo_loss(
        logp, logp_old, advantages, mask, plan.eps_low, plan.eps_high, cfg.loss_type, cfg.importance_level,
        max_len=cfg.max_tokens, is_weight=is_weight, is_masked=is_masked, clip_log_ratio=clip_log_ratio,
    )
    scaler.scale(out.loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.master.parameters(), cfg.max_grad_norm)
    scaler.step(optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: reallocating them costs 0.6 s here
    timings["time/train_s"] = time.perf_counter() - t0
    # The shadow (current weights in the engine's precision) follows the update now. The share of its values
    # that changed is what the engine sees of this update at its next sync: bf16 hides steps below ~|w|/256.
    t0 = time.perf_counter()
    changed_share = sync_weights(shadow, policy.master)
    timings["time/sync_s"] = time.perf_counter() - t0

    lengths = torch.tensor([len(c) for c in rollout.completion_ids], dtype=torch.float64)
    m = mask.bool()
    zeroed = (out.clipped_low | out.clipped_high)[m]
    alpha = (logp_shadow.double() - logp_engine.double())[m]  # float64 differences, as alpha_beta_stats
    beta = (logp.detach().double() - logp_shadow.double())[m]
    tokens = {"alpha": _round6(alpha), "beta": _round6(beta), "advantage": _round6(advantages[:, None].expand_as(logp)[m]),
              "clipped": zeroed.tolist(), "masked": out.masked[m].tolist()}
    return {
        "step": batch.step + 1,
        "reward/mean": rewards.double().mean().item(),
        "reward/std": rewards.double().std().item(),
        "completion/length_mean": lengths.mean().item(),
        "completion/stopped_share": sum(rollout.finished) / len(rollout.finished),
        **alpha_beta_stats(logp, logp_shadow, logp_engine, mask, advantages, out.clipped_low | out.clipped_high,
                           out.masked, plan.eps_low, plan.eps_high),
        "train/loss": out.loss.item(),
        "train/grad_norm": grad_norm.item(),
        "train/loss_scale": scaler.get_scale() if plan.loss_scaling else 1.0,
        **_kernel_split(batch.logp_shadow_old, logp_shadow, logp_engine, mask),
        "sync/changed_share": changed_share,
        "sync/weights_lag": batch.step - batch.weights_version,
        **timings,
    }, tokens


def _kernel_split(logp_shadow_old, logp_shadow, logp_engine, mask) -> dict[str, float]:
    """α = [logp_shadow(θ_t) − logp_shadow(θ_old)] + [logp_shadow(θ_old) − logp_engine(θ_old)]: policy change + kernel gap."""
    if logp_shadow_old is None:
        return {}
    m = mask.bool()
    change = (logp_shadow.double() - logp_shadow_old.double())[m]
    kernel = (logp_shadow_old.double() - logp_engine.double())[m]
    return {"mismatch/policy_change_mean": change.mean().item(), "mismatch/policy_change_abs_mean": change.abs().mean().item(),
            "mismatch/kernel_gap_mean": kernel.mean().item(), "mismatch/kernel_gap_abs_mean": kernel.abs().mean().item()}


def _round6(x: torch.Tensor) -> list[float]:
    return [round(v, 6) for v in x.tolist()]


def _samples(batch: Batch, row: dict, tokenizer, n: int) -> dict:
    ids = batch.rollout.completion_ids[:n]
    return {"step": row["step"], "samples": [
        {"prompt": p, "completion": tokenizer.decode(c, skip_special_tokens=False), "length": len(c)}
        for p, c in zip(batch.prompts[:n], ids)
    ]}


def _save(run: RunDir, step: int, master, optimizer, scaler, snapshots: dict, staleness: int) -> None:
    """Everything the next steps depend on: weights, optimizer, loss scale, and the weight versions that
    batches step.. step+staleness−1 will be sampled with."""
    keep = {v: w for v, w in snapshots.items() if step - staleness <= v < step}
    run.save_checkpoint({"step": step, "master": master.state_dict(), "optimizer": optimizer.state_dict(),
                         "scaler": scaler.state_dict(), "snapshots": keep})


class _progress:
    """A rich progress bar with reward, length and phantom-clip rate; silent without a console."""

    def __init__(self, console, total: int, start: int):
        self.console, self.total, self.start = console, total, start
        self._bar = None

    def __enter__(self):
        if self.console is not None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.fields[info]}"), console=self.console)
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, info="")
        return self

    def advance(self, row: dict) -> None:
        if self._bar is not None:
            info = (f"reward {row['reward/mean']:.2f}  len {row['completion/length_mean']:.1f}  "
                    f"phantom {100 * row['clip/phantom_rate']:.1f}%  |β| {row['mismatch/beta_abs_mean']:.4f}")
            self._bar.update(self._task, advance=1, info=info)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False


__all__ = ["INTERVENTIONS", "Plan", "RolloutProducer", "TrainConfig", "TrainConfigError", "TrainerForward", "resolve_plan", "train"]
