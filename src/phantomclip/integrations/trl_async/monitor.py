"""The α/β monitor and the ratio fix inside TRL's AsyncGRPOTrainer (trl 1.16, trl/experimental/async_grpo).

    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor, with_async_shadow_ratio
    Trainer = with_async_shadow_ratio(AsyncGRPOTrainer)     # the clip on the policy's move; β in a capped weight
    trainer = Trainer(model=..., args=AsyncGRPOConfig(...),
                      callbacks=[AsyncPrecisionMonitor(engine_dtype="bfloat16", interval=1)])

In the async trainer the PPO ratio is log π_trainer(θ_t) − log μ_vLLM(θ_v): the server's own log-probs at the weights
of the sample's version v, up to `max_staleness` syncs old at dequeue (async_grpo_trainer.py `compute_loss`).
Written out:

    log r = α + β_precision + β_kernel
    α           = log π_shadow(θ_t) − log π_shadow(θ_v)      the policy's move since v, both sides one precision
    β_precision = log π_trainer(θ_t) − log π_shadow(θ_t)      the trainer's precision against the engine's
    β_kernel    = log π_shadow(θ_v) − log μ_vLLM(θ_v)         the engine's kernels against the shadow's, same weights

where a shadow is the policy's weights rounded to the engine's dtype, run through the trainer's own packed forward.
Hence one copy per version a trained token may have (trl_async.versions.staleness_bound + 1: TRL filters staleness
at dequeue, and accelerate prefetches), each taken when TRL syncs that version (`_sync_weight`), looked up by each
token's sample version. TRL's packed batch does not carry that version, so the integration reads it off the queue
(trl_async.versions.VersionReader) and adds `pc_sample_version` to the collated batch; a token's version is that of
its `segment_id`. What this reads of TRL is checked at attach (trl_async.checks).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ...base.errors import IntegrationError
from ...maths.loss import clip_range
from ..trl import check_engine_args, check_monitor_args, find_trainer, has_dropout
from ..weights import sharded_root
from .checks import (
    async_trainer_class,
    check_async_internals,
    check_shadow_memory,
    check_trainer_state,
    shadow_memory,
)
from .forward import packed_forward, score_as_trl, score_labelled
from .ratio import RATIOS, Tokens, importance_weight, resolve
from .stats import MEANS, async_figures, async_precision_stats, offpolicy_figures, offpolicy_stats
from .versions import (
    VERSION_KEY,
    TrainerVersions,
    VersionCopies,
    VersionedCollate,
    VersionReader,
    current_version,
    kept_versions,
    staleness_bound,
)

__all__ = ["DEFAULT_RATIO", "AsyncPrecisionMonitor", "IntegrationError", "async_figures", "async_precision_stats",
           "shadow_memory", "staleness_bound", "with_async_shadow_ratio"]

DEFAULT_RATIO = "trust-region"
"""the fix's ratio unless told (trl_async.ratio.RATIOS): PPO's clip on the policy's own move since the sample's
version in the trainer's precision (exactly 1 at staleness 0), β corrected outside it by a capped importance weight.
Chosen on principle (DESIGN.md §6: a fix takes β out of the clip and keeps the clip), not on a learning race:
"decoupled", the earlier default, has no trust region against staleness in TRL's async trainer (one optimizer step
per sample: its clip never fires), and its lead on the reward −length task was that task's collapse to empty
completions, which removing the clip reaches fastest. The comparison on tasks with an interior optimum
(bench/experiments/exp_async_ratio.py, docs/results.md) is what would show harm; what it shows so far is there."""


class _Record:
    """One micro-batch's per-token tensors [M] (for the monitor and for checks)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Hooks:
    """What the monitor and the fix install on one trainer, once: the version carried into the batch, the copies
    taken at each sync, and the copies' forwards at the loss. `stores`: "engine" (the engine's dtype, the monitor's
    and the shadow ratio's: whole copies, VersionCopies) and "trainer" (the trainable parameters' local tensors per
    version, swapped into the live model: TrainerVersions, ratio "trust-region"'s), made on request."""

    def __init__(self, trainer, engine_dtype: str, matmul: str):
        self.trainer, self.engine_dtype, self.matmul = trainer, engine_dtype, matmul
        self.fix: str | None = None
        self.weight = None
        """the fix's ImportanceWeight (trl_async.ratio.importance_weight)."""
        self.trainer_keep: int | None = None
        """versions ratio "trust-region" keeps (None: every version a token may have)."""
        self.offpolicy: dict | None = None
        """the fix's last off-policy figures (offpolicy_figures)."""
        self.monitor: AsyncPrecisionMonitor | None = None
        self.wanted: set[str] = set()
        self.stores: dict[str, VersionCopies] = {}
        self.latest = 0
        self.sample_versions: dict = {}
        self.last: _Record | None = None
        self.own_seconds = 0.0
        self.own_cpu_seconds = 0.0
        """the hooks' own work (copies at each sync, their forwards, the figures) in wall and this thread's CPU time
        (which other processes on a shared machine do not inflate)."""
        self.seconds = {"snapshot": 0.0, "forwards": 0.0, "figures": 0.0}
        self.cpu_by_part = {"snapshot": 0.0, "forwards": 0.0, "figures": 0.0}
        """the same clocks by part (bench/benchmarks/bench_trl_async_monitor.py: forwards and figures run inside TRL's
        training_step, the snapshots after its _sync_weight)."""
        self._install()

    def want(self, kind: str, built: bool = True) -> None:
        """Keep copies of kind `kind` from now on. Attached after a sync (a second train(), or after training began):
        the current weights become the latest version's copy when no optimizer step came since its sync; older
        versions have none (their tokens are counted and clipped by the stated fallback, never dropped)."""
        self.wanted.add(kind)
        if not built or kind in self.stores:
            return
        latest = current_version(self.trainer)
        if latest > 0:
            self.latest = latest
            args = self.trainer.args
            if self.trainer.state.global_step % args.weight_sync_steps == 0:
                self._store(kind).snapshot(latest)

    def _store(self, kind: str):
        if kind not in self.stores:
            if kind == "engine":
                self.stores[kind] = VersionCopies(self.trainer, self.engine_dtype, self.matmul, score_labelled)
            else:
                self.stores[kind] = TrainerVersions(self.trainer, self.trainer_keep)
        return self.stores[kind]

    def _install(self) -> None:
        trainer = self.trainer
        original_sync, original_loader, original_loss = (trainer._sync_weight, trainer.get_train_dataloader,
                                                         trainer.compute_loss)
        interval_callback = async_trainer_class().__module__

        def sync_weight():
            original_sync()
            self._after_sync()

        for cb in trainer.callback_handler.callbacks:  # attached after __init__: TRL's periodic sync holds the method
            if (type(cb).__name__ == "StepIntervalCallback" and type(cb).__module__ == interval_callback
                    and getattr(cb.fn, "__func__", None) is original_sync.__func__):
                cb.fn = sync_weight
        trainer._sync_weight = sync_weight

        def get_train_dataloader():
            check_trainer_state(trainer)
            check_no_dropout(trainer.model)  # set after attach?
            if trainer.accelerator.is_main_process and not isinstance(trainer.rollout_queue, VersionReader):
                trainer.rollout_queue = VersionReader(trainer.rollout_queue, self.sample_versions)
            loader = original_loader()
            if trainer.accelerator.is_main_process:  # accelerate's dispatcher iterates the loader it wraps
                inner = getattr(loader, "base_dataloader", loader)
                inner.collate_fn = VersionedCollate(inner.collate_fn, self.sample_versions,
                                                    kept_versions(trainer.args) + 2)
            return loader

        trainer.get_train_dataloader = get_train_dataloader

        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            return self._loss(original_loss, model, inputs, return_outputs, num_items_in_batch)

        trainer.compute_loss = compute_loss

    def _after_sync(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.latest = current_version(self.trainer)
        for kind in sorted(self.wanted):
            self._store(kind).snapshot(self.latest)
        self._clock(time.perf_counter() - t0, time.thread_time() - c0, "snapshot")

    def _clock(self, wall: float, cpu: float, part: str) -> None:
        self.own_seconds += wall
        self.own_cpu_seconds += cpu
        self.seconds[part] += wall
        self.cpu_by_part[part] += cpu

    def _measuring(self) -> bool:
        m = self.monitor
        return m is not None and self.trainer.state.global_step % m.interval == 0

    def _loss(self, original, model, inputs, return_outputs, num_items_in_batch):
        measure = self._measuring() and model.training
        if not (self.fix or measure):
            return original(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if VERSION_KEY not in inputs:
            raise IntegrationError("the batch carries no sample versions: attach the monitor (or build the trainer "
                                   "with with_async_shadow_ratio) before trainer.train()")
        t0, c0 = time.perf_counter(), time.thread_time()
        kwargs, token_index, selected = packed_forward(inputs)
        segment = inputs["segment_id"][selected]  # [M] each token's sequence in the row
        versions = inputs[VERSION_KEY][0][segment]  # [M] each token's sample version
        tokens = Tokens(logp_engine=inputs["old_log_probs"][selected].float(),  # [M] the server's, at θ_v
                        advantages=inputs["advantages"][selected].float(), index=token_index, segment=segment)
        scored = self._score(model, kwargs, token_index, versions, tokens, measure)
        self._clock(time.perf_counter() - t0, time.thread_time() - c0, "forwards")
        rewrite = RATIOS[self.fix].fn(tokens, self.weight) if self.fix else None
        call = _ModelCall(model, rewrite.value if rewrite else None)
        loss = original(call, _rewritten(inputs, selected, rewrite), return_outputs=return_outputs,
                        num_items_in_batch=num_items_in_batch)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.last = _Record(logp=call.log_probs.detach().flatten()[token_index].float(),  # [M] the loss's forward
                            logp_engine=tokens.logp_engine, logp_shadow=scored.get("engine_now"),
                            logp_shadow_old=tokens.shadow_old, logp_trainer_old=tokens.trainer_old,
                            logp_prox=tokens.logp_prox, advantages=tokens.advantages,
                            staleness=self.latest - versions, token_index=token_index, versions=versions, row=kwargs)
        if measure:
            self.monitor._record(self.last)
        if rewrite is not None:
            if rewrite.clip_log is None:  # the current side was the loss's own forward
                rewrite.clip_log = self.last.logp - rewrite.old
            self._log_offpolicy(rewrite, tokens, versions)
        self._clock(time.perf_counter() - t1, time.thread_time() - c1, "figures")
        return loss

    def _score(self, model, kwargs, token_index, versions, tokens: Tokens, measure: bool) -> dict:
        """The copies' forwards this call needs, into `tokens`; returns {"engine_now": [M]} when scored."""
        scored = {}
        need = RATIOS[self.fix].needs if self.fix else frozenset()
        if measure or "engine" in need:
            tokens.shadow_now_row, scored["engine_now"], tokens.shadow_old = self._store("engine").score_tokens(
                kwargs, token_index, versions, self.latest)
        if "prox" in need:
            _prox(model, kwargs, token_index, tokens)
        if "trainer" in self.wanted:
            tokens.trainer_old, tokens.trainer_own = self._trainer_old(model, kwargs, token_index, versions, tokens)
        return scored

    def _trainer_old(self, model, kwargs, token_index, versions, tokens: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """([M] the trainer's forward with each token's version's weights swapped in, [M] bool: that version's own
        weights were kept). π_prox itself where those weights are the live ones (so the ratio is exactly 1 there;
        scored only then: a micro-batch of stale tokens alone takes its current side from the loss's own forward).
        A version without its own copy takes the oldest kept one newer than it (TrainerVersions.substitute: fewer
        versions kept, or attached after training began), NaN where there is none. The versions scored are those
        any rank needs, in one order (under FSDP2 each forward is a collective)."""
        store = self._store("trainer")
        old = torch.full(token_index.shape, math.nan, device=token_index.device)  # [M]
        own = torch.zeros_like(versions, dtype=torch.bool)  # [M]
        by_copy: dict[int, torch.Tensor] = {}
        for v in _versions_any_rank(versions, self.latest, staleness_bound(self.trainer.args)):
            at = versions == v
            copy = v if v in store.versions else store.substitute(v)
            if v in store.versions:
                own |= at
            elif store.keep == kept_versions(self.trainer.args) and at.any():
                store._name_missing(v, int(at.sum()), self.latest)  # every version is kept: attached late
            if copy is not None:
                by_copy[copy] = by_copy.get(copy, torch.zeros_like(at)) | at
        for copy, at in sorted(by_copy.items()):
            if store.is_current(copy):  # the same on every rank (the versions are every rank's): a collective
                if tokens.logp_prox is None:
                    _prox(model, kwargs, token_index, tokens)
                old[at] = tokens.logp_prox[at]
            else:
                full = store.score(model, kwargs, copy, score_as_trl)  # [1, N]
                old[at] = full.flatten()[token_index][at]
        return old, own

    def _log_offpolicy(self, rewrite, tokens: Tokens, versions: torch.Tensor) -> None:
        """The fix's off-policy figures (stats.offpolicy_stats) into TRL's metrics, on every micro-batch."""
        substitute = None
        if self.fix == "trust-region":
            missing = torch.isnan(tokens.trainer_old)
            substitute = ~tokens.trainer_own & ~missing  # clipped against a newer kept version
        elif self.fix == "shadow":
            missing = torch.isnan(tokens.shadow_old)
        else:
            missing = torch.zeros_like(versions, dtype=torch.bool)
        stats = offpolicy_stats(self.latest - versions, rewrite.clip_log, tokens.advantages, rewrite.weight,
                                rewrite.capped, missing, substitute=substitute, eps_low=self.trainer.epsilon_low,
                                eps_high=self.trainer.epsilon_high, bound=staleness_bound(self.trainer.args))
        self.offpolicy = offpolicy_figures(stats)
        sink = self.trainer._metrics["train"]
        for key, pair in stats["pairs"].items():
            sink[f"offpolicy/{key}"].append(pair)
        for key, value in stats["max"].items():
            sink[f"offpolicy/{key}"].append(value)
        for key in ("weight_ess", "no_copy_total", "substitute_total"):
            sink[f"offpolicy/{key}"].append(stats[key])


def _prox(model, kwargs, token_index, tokens: Tokens) -> None:
    """π_prox into `tokens`: the live model's no-grad forward at θ_t (forward.score_as_trl), [1, N] and [M]."""
    tokens.prox_row = score_as_trl(model, kwargs)
    tokens.logp_prox = tokens.prox_row.flatten()[token_index]


def _versions_any_rank(versions: torch.Tensor, latest: int, bound: int) -> list[int]:
    """The versions latest − bound .. latest that a token of any rank has, in ascending order (one all-reduce)."""
    lowest = latest - bound
    present = torch.zeros(bound + 1, dtype=torch.float64, device=versions.device)
    inside = (versions >= lowest) & (versions <= latest)
    present[(versions[inside] - lowest).unique()] = 1.0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(present, op=dist.ReduceOp.MAX)
    return [lowest + k for k in range(bound + 1) if present[k] > 0]


def check_no_dropout(model: nn.Module) -> None:
    """One line if a training-mode forward of `model` drops anything (integrations.trl.has_dropout, the sync
    integration's test): the fix's no-grad forwards and the loss's own would drop different units, so the ratio is
    no longer 1 at staleness 0 (LoRA dropout 0.05 on the bundled model: ratio 1.6-23, 25-50% of tokens clipped), and
    the monitor's β would hold dropout noise. TRL's async trainer has no disable_dropout (trl 1.16)."""
    if has_dropout(sharded_root(model)):
        raise IntegrationError("the model has dropout (an nn.Dropout with p > 0, LoRA's lora_dropout among them, or a "
                               "config *_dropout > 0): set it to 0 before building the trainer (LoraConfig("
                               "lora_dropout=0.0), config.attention_dropout = 0.0); the async monitor and fix compare "
                               "forwards that dropout would make differ")


def _rewritten(inputs: dict, selected: torch.Tensor, rewrite) -> dict:
    """TRL's batch with the fix's old log-probs and advantages in place of its own (a copy; TRL's is left alone)."""
    if rewrite is None:
        return inputs
    inputs = dict(inputs)
    for key, value in (("old_log_probs", rewrite.old), ("advantages", rewrite.advantages)):
        if value is not None:
            replaced = inputs[key].clone()  # [1, M_pad]
            replaced[selected] = value.to(replaced.dtype)
            inputs[key] = replaced
    return inputs


class _ModelCall:
    """The model as TRL's compute_loss calls it: records the forward's log-probs, and with `value` given hands TRL
    value + (logp − logp.detach()): the value the fix chose, the trainer's gradient."""

    def __init__(self, model: nn.Module, value: torch.Tensor | None):
        self.model, self.value, self.log_probs = model, value, None

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        lp = out.log_probs  # [1, N]
        self.log_probs = lp
        if self.value is not None:
            out.log_probs = self.value.to(lp.dtype) + (lp - lp.detach())
        return out


try:  # a TrainerCallback when transformers is importable (it always is beside trl)
    from transformers import TrainerCallback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object


def _hooks_of(trainer, engine_dtype: str, matmul: str, kinds: set[str], built: bool = True,
              trainer_keep: int | None = None) -> _Hooks:
    """The trainer's hooks, installed on first use after TRL's internals are checked; the copies of `kinds` (with
    those already kept) are checked to fit first. Nothing is replaced when a check refuses."""
    hooks = trainer.__dict__.get("_pc_async")
    if hooks is None:
        check_async_internals(trainer, built)
        check_no_dropout(trainer.model)
    elif (hooks.engine_dtype, hooks.matmul) != (engine_dtype, matmul):
        raise IntegrationError(f"this trainer's shadows are {hooks.engine_dtype} (matmul {hooks.matmul}); the monitor "
                               f"and with_async_shadow_ratio must name the same engine dtype, not {engine_dtype}")
    check_shadow_memory(trainer, engine_dtype, (hooks.wanted if hooks else set()) | kinds, trainer_keep)
    if hooks is None:
        hooks = trainer._pc_async = _Hooks(trainer, engine_dtype, matmul)
    hooks.trainer_keep = trainer_keep if trainer_keep is not None else hooks.trainer_keep
    return hooks


class AsyncPrecisionMonitor(_Callback):
    """Logs `precision/*` through the async trainer's own metrics every `interval` optimizer steps, on the tokens
    TRL's loss trains: α, β and its two parts against the shadow of each sample's version, TRL's clip rate, the clip
    rate on α alone, the phantom-clip rate, and the staleness of those tokens (over max_staleness: the prefetch's).
    Figures are over every rank's tokens (the same on each rank), appended as (sum, count) pairs so TRL's log reduces
    a window token-weighted. It never changes a gradient. With `interval` > 1 its forwards run on measured steps
    only; the fix (with_async_shadow_ratio) scores its copies on every step whatever the interval. Pass it in
    `callbacks=[...]` (it attaches while the trainer is built) or call `attach` before `train()`."""

    def __init__(self, engine_dtype: str = "bfloat16", epsilon: float | None = None, epsilon_high: float | None = None,
                 interval: int = 1, matmul: str = "auto"):
        check_monitor_args("AsyncPrecisionMonitor", engine_dtype, matmul, interval, epsilon, epsilon_high)
        async_trainer_class()  # the installed trl has an async trainer this integration reads (one line if not)
        self.engine_dtype, self.matmul, self.interval = engine_dtype, matmul, interval
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.trainer = None
        self.last: dict | None = None

    def attach(self, trainer, _built: bool = True) -> None:
        cls = async_trainer_class()
        if not isinstance(trainer, cls):
            raise IntegrationError(f"AsyncPrecisionMonitor works with {cls.__module__}.AsyncGRPOTrainer and its "
                                   f"subclasses, not {type(trainer).__name__} (GRPOTrainer: PrecisionMonitor)")
        if self.trainer is not None:
            raise IntegrationError("this AsyncPrecisionMonitor is already attached to a trainer: make one per trainer")
        hooks = _hooks_of(trainer, self.engine_dtype, self.matmul, {"engine"}, _built)
        if hooks.monitor is not None:
            raise IntegrationError("this trainer already has an AsyncPrecisionMonitor: attach one only")
        hooks.monitor, self.trainer, self.hooks = self, trainer, hooks
        hooks.want("engine", _built)
        if self.epsilon is None:  # TRL's own trust region, or our ε_high over it
            self._eps = (trainer.epsilon_low, trainer.epsilon_high if self.epsilon_high is None else self.epsilon_high)
        else:
            self._eps = clip_range(self.epsilon, self.epsilon_high)

    def on_init_end(self, args, state, control, **kwargs):
        trainer = find_trainer()  # the Trainer whose __init__ calls this (callbacks are not handed it)
        if trainer is None:
            return
        if self.trainer is None:
            self.attach(trainer, _built=False)
        elif self.trainer is not trainer:
            raise IntegrationError("this AsyncPrecisionMonitor already measures another trainer: make a new "
                                   "AsyncPrecisionMonitor for each trainer")

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise IntegrationError("AsyncPrecisionMonitor is not attached: pass it in the trainer's callbacks, or call "
                                   "monitor.attach(trainer) before trainer.train()")
        if kwargs.get("model") is not None and kwargs["model"] is not self.trainer.model:
            raise IntegrationError("this AsyncPrecisionMonitor measures another trainer than the one training: make "
                                   "a new AsyncPrecisionMonitor for each trainer")
        state.log_history.append({"precision/engine_dtype": self.engine_dtype,
                                  "precision/max_staleness": self.trainer.args.max_staleness,
                                  "precision/staleness_bound": staleness_bound(self.trainer.args),
                                  "precision/shadow_bytes": shadow_memory(self.trainer, self.engine_dtype)[1],
                                  "step": state.global_step})

    def _record(self, rec: _Record) -> None:
        stats = async_precision_stats(rec.logp, rec.logp_engine, rec.logp_shadow, rec.logp_shadow_old, rec.advantages,
                                      rec.staleness, eps_low=self._eps[0], eps_high=self._eps[1],
                                      max_staleness=self.trainer.args.max_staleness)
        self.last = async_figures(stats)
        sink, s = self.trainer._metrics["train"], stats["sums"]
        for key, name in MEANS.items():  # (sum, count): TRL's log() reduces a window as Σ sums / Σ counts
            sink[f"precision/{key}"].append((s[name], s["tokens"]))
        for name, value in s.items():
            if name.startswith("staleness_"):  # over every trained token, with or without its shadow
                sink[f"precision/{name.replace('staleness_', 'staleness_share_')}"].append((value, s["trained"]))
        sink["precision/beta_abs_p99"].append(stats["beta_abs_p99"])
        sink["precision/nonfinite_total"].append(s["nonfinite"])
        sink["precision/no_shadow_total"].append(s["no_shadow"])


def with_async_shadow_ratio(trainer_cls: type, engine_dtype: str = "bfloat16", matmul: str = "auto",
                            ratio: str = DEFAULT_RATIO, vllm_importance_sampling_mode: str | None = None,
                            vllm_importance_sampling_clip_max: float | None = None,
                            versions_kept: int | None = None) -> type:
    """A subclass of `trainer_cls` (AsyncGRPOTrainer or a subclass) whose PPO clip decides on the policy's own move.

    TRL's compute_loss runs unchanged on rewritten inputs (trl_async.ratio):
    - `ratio="trust-region"` (default, see DEFAULT_RATIO; "trainer" is accepted for it): the clip on
      trainer(θ_t) − trainer(θ_v), the policy's move since the sample's version in the trainer's own forward
      (exactly 1 at staleness 0), and β corrected outside the clip by the weight π_trainer(θ_v) / μ on the
      advantage, capped. Keeps the trainable parameters' local tensors of each version a token may have, sharded as
      the parameters are (trl_async.versions.TrainerVersions); one more no-grad forward per micro-batch, one more
      per stale version in it. `versions_kept` (1 .. staleness bound + 1, default all): keep the newest only, the
      cheaper form that keeps a trust region: a token of an older version is clipped on the move since the oldest
      kept one, the move before it joining β in the capped weight.
    - `ratio="shadow"`: the clip on shadow(θ_t) − shadow(θ_v) from two engine-dtype copies; β uncorrected.
    - `ratio="decoupled"` (opt-in): decoupled PPO as AReaL and verl write it. With one optimizer step per sample (TRL's
      async trainer) its clip on π_θ/π_prox never fires: no trust region against staleness; staleness and β both
      go into the capped weight π_prox/μ on the advantage. No copies, one more forward.
    The weight is token-level, truncated at 2 (ratio.WEIGHT_MODE, WEIGHT_CAP) unless TRL's fields say otherwise: the
    two arguments here, or the trainer config's `vllm_importance_sampling_*` where it has them (trl 1.16's
    AsyncGRPOConfig has none; GRPOConfig's names and meanings, grpo_config.py). TRL's loss, normalisation and
    metrics are otherwise its own; its `ratio`, `kl` and `clip_ratio/*` then describe the ratio it clips, and the
    fix logs `offpolicy/*` on every step (docs/metrics.md). A model with dropout is refused (check_no_dropout)."""
    cls = async_trainer_class()
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, cls)):
        name = getattr(trainer_cls, "__name__", trainer_cls)
        raise IntegrationError(f"with_async_shadow_ratio wraps AsyncGRPOTrainer or a subclass of it, not {name!r}")
    check_engine_args(engine_dtype, matmul, "with_async_shadow_ratio")
    ratio = resolve(ratio)

    class AsyncShadowRatio(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            weight = importance_weight(self.args, vllm_importance_sampling_mode, vllm_importance_sampling_clip_max)
            kinds = RATIOS[ratio].needs & {"engine", "trainer"}
            hooks = _hooks_of(self, engine_dtype, matmul, kinds, trainer_keep=versions_kept)
            for kind in kinds:
                hooks.want(kind)
            hooks.fix, hooks.weight = ratio, weight

    AsyncShadowRatio.__name__ = AsyncShadowRatio.__qualname__ = f"AsyncShadowRatio{trainer_cls.__name__}"
    return AsyncShadowRatio
