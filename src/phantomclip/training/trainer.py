"""Asynchronous GRPO with the exact split of the PPO ratio: every step says how much of log r is the policy's
own change and how much is the trainer/engine mismatch.

The loop, top to bottom (`train`):
  1. A producer thread samples batch k with the engine holding the weights of `staleness` steps ago
     (θ_old = θ_{k−s}, cast to the engine's dtype at weight sync) and scores the rollout with those weights on the
     prefill path (`logp_shadow_old`; with recompute-old also the trainer's `logp_old`), then queues it.
  2. The trainer computes rewards and group advantages, its own log-probs `logp` (grad, trainer recipe),
     and the shadow log-probs `logp_shadow` (current weights in the engine's recipe, no grad).
  3. log r = logp − logp_old is clipped as PPO does; by default logp_old = logp_engine (asynchronous GRPO, as
     TRL's AsyncGRPOTrainer), and log r = α + β_kernel + β_precision (metrics.ratio_split):
     α = logp_shadow − logp_shadow_old, β_kernel = logp_shadow_old − logp_engine, β_precision = logp − logp_shadow.
     A clipped token is phantom-clipped when the clip on α alone would not have fired.
  4. One optimizer step on the fp32 master weights; the new weights are published to the producer.

How this departs from GRPO as published (Shao et al. 2024): one gradient step per batch (no PPO epochs),
token-mean loss ("dapo") by default, no KL term, and the old log-probs come from the engine, not the trainer,
unless `recompute-old` asks for TRL's synchronous default.

Interventions (`INTERVENTIONS`) are small dicts of changes to a `Plan`, composable with ',' and checked for
conflicts; the loss itself is `loss.grpo_loss`, a pure function.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..base.console import GracefulStop, progress_bar
from ..base.devices import clock, describe_device, resolve_device
from ..base.errors import PhantomclipError
from ..base.files import check_output_dir
from ..engines import start_engine
from ..engines.local import Engine
from ..engines.vllm_memory import BesideVllm
from ..precision.recipes import apply_recipe, get_recipe, without_quant
from ..precision.scoring import TrainerForward
from ..routing.train import engine_routes_note, routed_step
from ..runs.read import RunError
from ..runs.rundir import RunDir, input_record
from .config import ADDED_SINCE_SCHEMA_1, RESUME_MAY_CHANGE, TrainConfig, check_model_fits
from .interventions import INTERVENTIONS, Plan, TrainConfigError, resolve_plan
from .producer import (
    Batch,
    RolloutMaker,
    RolloutProducer,
    Sampling,
    drawn_prompts,
    publish_weights,
    snapshot,
    start_producer,
)
from .step import StepContext, StepOut, train_step

# ------------------------------------------------------------------------------------------ the loop

ADAM_BETAS = (0.9, 0.99)
"""AdamW (β1, β2). β2 = 0.99 (PyTorch and TRL default to 0.999): the second-moment average then forgets within
~100 steps, on the scale of these runs of a few dozen steps."""


@dataclass
class TrainResult:
    metrics: list[dict]
    run_dir: Path | None
    interrupted: bool = False


def run_config(cfg: TrainConfig) -> dict:
    """config.json: every field, the resolved plan, versions, the content hash of every input file. Resume compares
    this (minus RESUME_MAY_CHANGE). Call after cfg.validate() and load_reward (the reward's module must import)."""
    import transformers

    from .. import SCHEMA_VERSION, __version__

    return {
        "schema": SCHEMA_VERSION, **asdict(cfg), "plan": asdict(resolve_plan(cfg)),
        "versions": {"phantomclip": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "device": describe_device(resolve_device(cfg.device))},
        "inputs": input_record(_input_files(cfg)),
    }


@dataclass
class RunSetup:
    """What a run is made of before its first step: the model, the prompts, the task and where it logs."""

    cfg: TrainConfig
    plan: Plan
    task: object
    """tasks.Task: its reward, prompts and convergence criterion."""
    reward_fn: Callable
    tokenizer: object
    master: nn.Module
    """fp32 master weights: the optimizer's, and the source every other copy is cast from."""
    pool: list[str]
    """the prompts steps draw from."""
    pool_ids: dict[int, list[int]]
    """pool index -> token ids, for the prompts the run's steps draw (producer.drawn_prompts): only those."""
    stops: tuple[int, ...]
    run: RunDir | None
    ckpt: dict | None
    """the checkpoint a resumed run continues from (None for a fresh run)."""
    engine: Engine
    """the sampling engine, started once per run; the producer syncs each weight version into it before sampling."""


def train(
    cfg: TrainConfig, out: str | Path | None = None, resume: bool = False, console=None,
    on_step: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Run GRPO as configured; log to `out` (a run directory) if given. Ctrl-C stops after the current step
    with a checkpoint (a second Ctrl-C aborts at once; the last periodic checkpoint stays valid)."""
    setup = _prepare(cfg, out, resume)
    producer, stop_requested = None, GracefulStop()
    try:  # from here on the run directory is locked: every way out releases it
        ctx, start, snapshots = _step_context(setup)
        producer = start_producer(_rollout_maker(setup, ctx), start, cfg.steps, cfg.staleness, snapshots)
        metrics = list(setup.run.metrics()) if setup.run else []
        with stop_requested, progress_bar(console, transient=False, info=True) as progress:
            bar = progress.add_task("train", total=cfg.steps, completed=start, info="")
            _keep_weights(setup, start, progress, missing_only=True)  # step 0, or the first one of a resume
            note = engine_routes_note(setup.engine, setup.master)  # an MoE sampled by vLLM: no route/* (one line)
            if note and hasattr(progress, "console"):
                progress.console.print(note, markup=False, soft_wrap=True)
            device = next(setup.master.parameters()).device
            for k in range(start, cfg.steps):
                t0 = time.perf_counter()
                batch = producer.get()
                t_wait = time.perf_counter() - t0
                step = routed_step(train_step, batch, ctx)  # MoE: the routing part of β; r3 replays the engine's
                publish_weights(producer, snapshots, setup.master, k + 1, cfg.staleness)
                step.row.update({"task/converged": bool(setup.task.converged(step.row)), "time/wait_s": t_wait,
                                 "time/step_s": clock(device) - t0})
                metrics.append(step.row)
                # Read the Ctrl-C flag once: a checkpoint is written exactly when the loop stops after this step (a
                # signal arriving later is seen after the next step, which then checkpoints and stops).
                stop = stop_requested.flag or finished_early(metrics, cfg.stop_after_converged)
                _log_step(setup, ctx, batch, step, snapshots, checkpoint=stop)
                _keep_weights(setup, k + 1, progress)
                progress.update(bar, advance=1, info=_step_info(step.row))
                if on_step:
                    on_step(step.row)
                if stop:
                    break
                check_finite(metrics, scaled=ctx.plan.loss_scaling)
    finally:
        _close(setup, producer)
    interrupted = stop_requested.flag and len(metrics) < cfg.steps
    return TrainResult(metrics=metrics, run_dir=setup.run.path if setup.run else None, interrupted=interrupted)


def _close(setup: RunSetup, producer) -> None:
    """Every way out of a run: the producer's thread, then the engine it may be sampling with, then the run's lock."""
    if producer is not None:
        producer.close()
    setup.engine.close()
    if setup.run is not None:
        setup.run.close()


def _prepare(cfg: TrainConfig, out: str | Path | None, resume: bool) -> RunSetup:
    """Validate, load the model and prompts and check them against the context, then open the run directory (in
    that order: bad input must not leave a directory behind)."""
    from ..models.load import load_model, stop_token_ids
    from ..models.prompts import bundled_prompts, encode_within, read_prompts
    from .tasks import get_task, load_reward

    cfg.validate()
    if cfg.keep_snapshots and out is None:
        raise TrainConfigError("--keep-snapshots writes into the run directory: give --out")
    if out is not None:
        check_output_dir(out)  # before the model loads
    task = get_task(cfg.task)
    reward_fn = load_reward(cfg.reward) if cfg.reward else task.reward
    pool = read_prompts(cfg.prompts) if cfg.prompts else None  # a bad prompts file is refused before the model loads
    lm = load_model(cfg.model)
    if pool is None:
        pool = task.prompts(64, cfg.seed) if task.prompts and not cfg.reward else bundled_prompts()
    # only the prompts the steps will draw are tokenized (and checked against the context): a 500,000-line file
    # costs its reading, not 500,000 encodings
    used = sorted({i for k in range(cfg.steps) for i in drawn_prompts(cfg.seed, k, cfg.prompts_per_step, len(pool))})
    pool_ids = dict(zip(used, encode_within(lm.tokenizer, [pool[i] for i in used], cfg.max_tokens, lm.context_length)))
    master, plan = lm.model.float().eval().to(resolve_device(cfg.device)), resolve_plan(cfg)
    check_model_fits(cfg, master, max(len(p) for p in pool_ids.values()), resolve_device(cfg.device))  # r3, memory
    # The engine starts before the run directory is touched: a model vLLM cannot load leaves nothing behind.
    engine = _start_engine(cfg, plan, lm, pool_ids)
    run, ckpt = None, None
    try:
        if out is not None:
            config = run_config(cfg)
            if resume:
                run, ckpt = RunDir.resume(out, config, ignore=RESUME_MAY_CHANGE, defaults=ADDED_SINCE_SCHEMA_1,
                                          required=CHECKPOINT_KEYS, max_step=cfg.steps)
            else:
                run = RunDir.create(out, config)
    except BaseException:
        engine.close()
        raise
    return RunSetup(cfg=cfg, plan=plan, task=task, reward_fn=reward_fn, tokenizer=lm.tokenizer, master=master,
                    pool=pool, pool_ids=pool_ids, stops=stop_token_ids(lm), run=run, ckpt=ckpt, engine=engine)


def _start_engine(cfg: TrainConfig, plan: Plan, lm, pool_ids: dict[int, list[int]]) -> Engine:
    """The run's sampling engine on the model's weights in the plan's engine recipe. Its weights are replaced before
    the first batch (θ_0 of a fresh run, the checkpoint's of a resumed one), through the same sync as every later
    step, so a resumed run's engine holds bit for bit what an uninterrupted run's did.

    vLLM: its raw log-probs are taken before temperature, the processed ones after (and without truncation they are
    the whole distribution's), so the mode follows the temperature; its context is the longest prompt plus the
    completion budget, which bounds the KV cache it reserves."""
    if cfg.engine == "vllm":
        from ..engines.vllm import require_vllm

        require_vllm()  # the install hint before the model is saved for vLLM
    recipe = get_recipe(plan.engine_recipe)
    longest = max(len(p) for p in pool_ids.values()) + cfg.max_tokens
    return start_engine(cfg.engine, lm, recipe.weight_dtype, matmul=cfg.matmul, recipe=recipe,
                        logprobs_mode="raw" if cfg.temperature == 1 else "processed",
                        max_model_len=longest, seed=cfg.seed, weight_sync=True,
                        beside=BesideVllm(batch_tokens=cfg.prompts_per_step * cfg.group_size * longest, training=True,
                                          share=cfg.vllm_memory_share))


def _input_files(cfg: TrainConfig) -> dict[str, Path]:
    """The files a run reads besides its flags, hashed into config.json so a resume notices one that changed: the
    prompts file, the reward function's module, a model loaded from a local directory."""
    import importlib.util

    files = {}
    if cfg.prompts and Path(cfg.prompts).is_file():  # read_prompts refuses anything else, in one line
        files["prompts"] = Path(cfg.prompts)
    try:
        spec = importlib.util.find_spec(cfg.reward.partition(":")[0]) if cfg.reward else None
    except (ImportError, ValueError):  # load_reward says what is wrong with it, in one line
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).is_file():
        files["reward"] = Path(spec.origin)
    if Path(cfg.model).expanduser().is_dir():  # not the bundled model's cache (it is rebuilt from a pinned package)
        files["model"] = Path(cfg.model).expanduser()
    return files


def _step_context(setup: RunSetup) -> tuple[StepContext, int, dict[int, dict]]:
    """The trainer's forward, the shadow and the optimizer (restored from the checkpoint on resume); also the
    first step and the weight snapshots the producer samples with."""
    cfg, plan, master = setup.cfg, setup.plan, setup.master
    # fused: one kernel over all parameters (0.05 s per step on the bundled model against 0.7 s for foreach)
    optimizer = torch.optim.AdamW(master.parameters(), lr=cfg.lr, betas=ADAM_BETAS, weight_decay=0.0, fused=True)
    device = next(master.parameters()).device
    scaler = torch.amp.GradScaler(device.type, enabled=plan.loss_scaling)
    start, snapshots = 0, {}
    if setup.ckpt is not None:
        try:  # a checkpoint written before checkpoints carried their run's config may still be another model's
            master.load_state_dict(setup.ckpt["master"])
            optimizer.load_state_dict(setup.ckpt["optimizer"])
            scaler.load_state_dict(setup.ckpt["scaler"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise RunError(f"{setup.run.checkpoint_path} does not fit this run's model {cfg.model} ({why}): restore "
                           "this run's checkpoint, or remove it to restart the run from step 0") from None
        start, snapshots = setup.ckpt["step"], setup.ckpt["snapshots"]
    snapshots[start] = snapshot(master)
    shadow_recipe = get_recipe(plan.engine_recipe)
    policy = TrainerForward(master, get_recipe(plan.trainer_recipe), cfg.matmul)
    shadow = apply_recipe(master, shadow_recipe, matmul=cfg.matmul)  # current weights, engine precision
    bare = apply_recipe(master, without_quant(shadow_recipe), matmul=cfg.matmul) if shadow_recipe.quant else None
    ctx = StepContext(cfg=cfg, plan=plan, tokenizer=setup.tokenizer, reward_fn=setup.reward_fn, policy=policy,
                      shadow=shadow, shadow_recipe=shadow_recipe, optimizer=optimizer, scaler=scaler, plain_shadow=bare)
    return ctx, start, snapshots


def _rollout_maker(setup: RunSetup, ctx: StepContext) -> RolloutMaker:
    cfg = setup.cfg
    sampling = Sampling(seed=cfg.seed, prompts_per_step=cfg.prompts_per_step, group_size=cfg.group_size,
                        max_tokens=cfg.max_tokens, temperature=cfg.temperature, staleness=cfg.staleness,
                        matmul=cfg.matmul, replay_routes=ctx.plan.routes == "engine")
    old_recipe = ctx.policy.recipe if ctx.plan.ratio_against == "trainer_old" else None
    return RolloutMaker(engine=setup.engine, master=setup.master, pool=setup.pool, pool_ids=setup.pool_ids,
                        stops=setup.stops, sampling=sampling, shadow_recipe=ctx.shadow_recipe, old_recipe=old_recipe)


def _keep_weights(setup: RunSetup, step: int, progress, missing_only: bool = False) -> None:
    """With --keep-snapshots N: the fp32 weights after `step` steps, every N steps (RunDir.keep_snapshot)."""
    if setup.run is None:
        return
    size = setup.run.keep_snapshot(setup.master, step, setup.cfg.keep_snapshots, missing_only)
    if size is not None and hasattr(progress, "console"):
        progress.console.print(f"snapshot of the weights at step {step}: {size / 2**20:.0f} MiB")


def _log_step(setup: RunSetup, ctx: StepContext, batch: Batch, step: StepOut, snapshots: dict,
              checkpoint: bool) -> None:
    """Append the step to the run directory (with --keep-snapshots, the tokens of a snapshot's first batch);
    checkpoint every `checkpoint_every` steps, at the end, on Ctrl-C and when the run stops early."""
    run, cfg, done = setup.run, setup.cfg, step.row["step"]
    if run is None:
        return
    run.keep_snapshot_tokens(batch.weights_version, cfg.keep_snapshots, {
        "batch": batch.step, "prompt_ids": batch.rollout.prompt_ids, "completion_ids": batch.rollout.completion_ids})
    run.log_step(step.row, _samples(batch, step.row, ctx.tokenizer, cfg.samples_per_step), step.tokens,
                 cfg.token_log_steps)
    if checkpoint or done % cfg.checkpoint_every == 0 or done == cfg.steps:
        run.save_training_state(done, setup.master, ctx.optimizer, ctx.scaler, snapshots, cfg.staleness)


CHECKPOINT_KEYS = ("master", "optimizer", "scaler", "snapshots")
"""what a checkpoint must hold to continue a run (`RunDir.save_training_state` writes them)."""
NONFINITE_STOP = 3
"""a run stops after this many consecutive steps with a non-finite loss: the weights or the recipe overflow, and
skipping more updates only burns the budget."""


class TrainError(PhantomclipError):
    """A run that cannot go on (its loss stays non-finite); the message says what happened and what to try."""


def check_finite(metrics: list[dict], patience: int = NONFINITE_STOP, scaled: bool = False) -> None:
    """Stop the run with one line once the last `patience` steps all skipped their update for a non-finite loss, or
    (without loss scaling, where an overflowed gradient is not the scaler's routine) for a non-finite gradient."""
    last = metrics[-patience:]
    bad = lambda r: not math.isfinite(r["train/loss"]) or (r.get("train/skipped", False) and not scaled)  # noqa: E731
    if len(last) == patience and all(bad(r) for r in last):
        lost = sum(r.get("mismatch/nonfinite", 0) for r in last)
        total = lost + sum(r["mismatch/tokens"] for r in last)
        raise TrainError(
            f"steps {last[0]['step']}-{last[-1]['step']} skipped their update: the loss or the gradient was not finite "
            f"({lost} of {total} completion tokens had a non-finite log-prob). The weights or the precision recipe "
            "overflow: check the model's weights, or start a new --out with a wider dtype (e.g. bf16 instead of fp16)")


def finished_early(metrics: list[dict], patience: int) -> bool:
    """True once the last `patience` steps all counted as converged (never when patience is 0)."""
    return patience > 0 and len(metrics) >= patience and all(r["task/converged"] for r in metrics[-patience:])


def run_finished(metrics: list[dict], steps: int, patience: int) -> bool:
    """A run with these metric rows has nothing left to do: its whole budget ran, or it stopped early once converged."""
    return len(metrics) >= steps or finished_early(metrics, patience)


def _samples(batch: Batch, row: dict, tokenizer, n: int) -> dict:
    ids = batch.rollout.completion_ids[:n]
    return {"step": row["step"], "samples": [
        {"prompt": p, "completion": tokenizer.decode(c, skip_special_tokens=False), "length": len(c)}
        for p, c in zip(batch.prompts[:n], ids)
    ]}


def _step_info(row: dict) -> str:
    """The progress bar's line for a step."""
    return (f"reward {row['reward/mean']:.2f}  len {row['completion/length_mean']:.1f}  "
            f"phantom {100 * row['clip/phantom_rate']:.1f}%  |β| {row['mismatch/beta_abs_mean']:.4f}")


__all__ = ["INTERVENTIONS", "Plan", "RolloutProducer", "TrainConfig", "TrainConfigError", "resolve_plan", "train"]
