"""The α/β monitor and the shadow-ratio fix inside TRL's AsyncGRPOTrainer (trl 1.16, trl/experimental/async_grpo).

    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor, with_async_shadow_ratio
    Trainer = with_async_shadow_ratio(AsyncGRPOTrainer, engine_dtype="bfloat16")   # the clip sees α, not α + β
    trainer = Trainer(model=..., args=AsyncGRPOConfig(...), callbacks=[AsyncPrecisionMonitor(engine_dtype="bfloat16")])

In the async trainer the PPO ratio is log π_trainer(θ_t) − log μ_vLLM(θ_v): the server's own log-probs at the weights
of the sample's version v, up to `max_staleness` syncs old (async_grpo_trainer.py `compute_loss`). Written out:

    log r = α + β_precision + β_kernel
    α           = log π_shadow(θ_t) − log π_shadow(θ_v)      the policy's move since v, both sides one precision
    β_precision = log π_trainer(θ_t) − log π_shadow(θ_t)      the trainer's precision against the engine's
    β_kernel    = log π_shadow(θ_v) − log μ_vLLM(θ_v)         the engine's kernels against the shadow's, same weights

where a shadow is the policy's weights rounded to the engine's dtype, run through the trainer's own packed forward.
Hence one shadow per live version, each taken when TRL syncs that version to the server (`_sync_weight`), kept while
a sample of it may still be trained (`max_staleness` + 1 of them), and looked up by each token's sample version.

TRL's packed batch does not carry a sample's version (the queue reader drops it), so the integration carries it: it
reads each group's version off the queue (all samples of a group share one: async_rollout_worker.py `_score_group`)
and adds `pc_sample_version` [rows, samples] to the collated batch; a token's version is then that of its
`segment_id`. Staleness is counted at the loss (current version − the sample's), not at dequeue as TRL's
`sample/staleness_*` are, one prefetched micro-batch earlier. What this reads of TRL is checked at attach.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import nn

from ..errors import IntegrationError
from ..loss import clip_range
from .trl import check_engine_args, check_monitor_args, check_trl_version
from .trl_async_checks import (
    check_async_internals,
    check_shadow_memory,
    check_trainer_state,
    shadow_memory,
)
from .trl_async_stats import MEANS, async_figures, async_precision_stats
from .weights import build_shadow, check_supported, full_weights, sharded_root

VERSION_KEY = "pc_sample_version"
"""the batch field the integration adds: each row's samples' versions, in `segment_id` order."""

__all__ = ["AsyncPrecisionMonitor", "IntegrationError", "async_precision_stats", "async_figures", "shadow_memory",
           "with_async_shadow_ratio"]

def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _Shadows:
    """Engine-dtype copies of the policy keyed by the weight version TRL sent the server (at most `keep`, the oldest
    recycled), and the current weights' copy when they have moved since the last sync."""

    def __init__(self, trainer, engine_dtype: str, matmul: str):
        from trl.trainer.utils import add_fused_lm_head

        self.trainer, self.engine_dtype, self.matmul = trainer, engine_dtype, matmul
        self.kind = check_supported(sharded_root(trainer.model))
        self.keep = trainer.args.max_staleness + 1
        self.versions: dict[int, nn.Module] = {}
        self.version_step: dict[int, int] = {}
        self.current: nn.Module | None = None
        self.current_step = -1
        self._add_head = lambda m: add_fused_lm_head(m, temperature=trainer.temperature)
        self.version = 0
        self.build_seconds = 0.0

    def _new(self) -> nn.Module:
        t0 = time.perf_counter()
        shadow = build_shadow(sharded_root(self.trainer.model), self.engine_dtype, self.trainer.accelerator.device,
                              self.matmul)
        self._add_head(shadow)
        self.build_seconds += time.perf_counter() - t0  # once per kept copy, then recycled
        return shadow.eval()

    def snapshot(self, version: int) -> None:
        """The weights just sent as `version` (every rank, in step: a sharded model's gather is a collective)."""
        reuse = self.versions.pop(min(self.versions)) if len(self.versions) >= self.keep else self._new()
        self._fill(reuse)
        self.versions[version] = reuse
        self.version_step[version] = self.trainer.state.global_step
        self.version = version

    @torch.no_grad()
    def _fill(self, shadow: nn.Module) -> None:
        """The trainer's full weights copied into `shadow`, each tensor rounded to nearest into the engine's dtype by
        copy_ (as vLLM's load does), every parameter known and filled (sync_shadow's checks), in place: no buffer
        allocated past the copy's own. sync_shadow's count of changed values is left out: it was a second pass over
        every weight (`(p != new).sum()`), 18.2 of the 43.6 s that 5 syncs took in a 4-step cProfile run on the
        bundled model (2-core EPYC under load), and no figure reads it."""
        params = dict(shadow.named_parameters())
        filled = set()
        for name, value in full_weights(sharded_root(self.trainer.model), self.kind):
            p = params.get(name)
            if p is None:
                raise IntegrationError(f"the shadow has no parameter {name!r} (a module the engine's model lacks): "
                                       "the async monitor supports models whose trained parameters are the base "
                                       "model's")
            p.copy_(value)
            filled.add(name)
        if len(filled) != len(params):
            missing = sorted(set(params) - filled)
            raise IntegrationError(f"the trainer's model has no parameter for {missing[0]!r} of the shadow "
                                   f"({len(missing)} missing): its weights cannot be mirrored")

    def now(self) -> nn.Module:
        """The current weights in the engine's dtype: the latest version's copy if no optimizer step came since."""
        step = self.trainer.state.global_step
        if self.versions and self.version_step[self.version] == step:
            return self.versions[self.version]
        if self.current is None:
            self.current = self._new()
        if self.current_step != step:
            self._fill(self.current)
            self.current_step = step
        return self.current


def _packed_forward(inputs: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(forward kwargs, token_index [M], selected [1, M_pad]) of one rank's packed row, as TRL's compute_loss builds
    them (async_grpo_trainer.py lines 1498-1510: inter-rank padding stripped, tree attention's index tensors)."""
    mask_bool = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    kwargs = {key: inputs[key][mask_bool].unsqueeze(0) for key in ("input_ids", "position_ids", "shift_labels")}
    for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k"):
        kwargs[key] = inputs[key][inputs[key] >= 0]
    kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    return kwargs, inputs["token_index"][selected], selected


HEAD_ROWS_CPU = 64
"""labelled positions per call of TRL's log-prob head in a shadow forward on a CPU. Each call turns a [rows, 32768]
bf16 logit tile into fp32 temporaries of rows x 128 KiB; at 64 rows they stay under glibc's largest mmap threshold
(32 MiB) and are reused, at 256 rows every one is a fresh mapping faulted in page by page. The bundled model's head
over 256 rows in a fresh process, one thread's CPU time, 2-core EPYC (avx512_bf16) under load: 233 ms in one call
(49k page faults), 169 at 128 rows, 148 at 64 (none), 168 at 48, 179 at 32 (more calls re-read the 56 MB head); in
the bench's process after 3 training steps a row's head took 145 ms over all 270 positions (8.6k faults), 123 ms
over its 219 labelled ones (none), beside a 546 ms body (bench/RESULTS.md §9). The log-probs are bit for bit the
same at every size (each row's logits and log-softmax are its own: tests/test_trl_async.py)."""

HEAD_CLOSURE = ("backbone_attr", "temperature", "final_logit_softcapping", "logit_scale")
"""what `_score` reads off the fused head TRL's add_fused_lm_head installs (trl 1.16 trainer/utils.py
`_fused_forward`'s closure): the same backbone, temperature, softcap and logit scale as its own head call."""


def _fused_head(model: nn.Module) -> dict:
    """The arguments TRL's fused head on `model` passes its chunked log-prob function, from its closure."""
    fn = getattr(model.forward, "__func__", None)
    cells = dict(zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), getattr(fn, "__closure__", None) or ()))
    missing = [name for name in HEAD_CLOSURE if name not in cells]
    if missing:
        raise IntegrationError(f"the shadow's fused head has no {missing[0]!r}: this TRL's add_fused_lm_head differs "
                               "from trl 1.16's, which phantomclip.integrations.trl_async reads")
    return {name: cells[name].cell_contents for name in HEAD_CLOSURE}


@torch.inference_mode()
def _score(model: nn.Module, kwargs: dict) -> torch.Tensor:
    """[1, N] log-probs of the row's labels from `model`'s fused head (0 where a position has no label), scoring only
    the labelled positions: what TRL's own head does on a Triton device (trainer/utils.py `_fused_forward`, `compact`:
    hidden_states[mask]); on a CPU TRL's head scores all N positions, prompt and completion ends included (21% of a
    bf16 shadow forward of the bundled model in the bench's process, HEAD_ROWS_CPU). The body runs on the whole row
    as in TRL's forward; its labelled rows then go through TRL's own chunked log-prob function with TRL's arguments
    (`_fused_head`), in blocks of HEAD_ROWS_CPU rows on a CPU. The same log-probs bit for bit as TRL's fused forward
    of the row (tests/test_trl_async.py: the tiny model, and the bundled model's widths with its 49152-token head in
    two vocabulary chunks): a row's bf16 logits do not depend on the other rows of its product (oneDNN's brgemm, its
    AVX2 fallback and ATen's gemm measured so at 1-301 rows), and the fold into a log-softmax is per row. Under
    inference_mode, not no_grad: the same kernels, without autograd's version counters and view tracking; the result
    is only ever read."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    head = _fused_head(model)
    body = {key: value for key, value in kwargs.items() if key != "shift_labels"}
    hidden = getattr(model, head["backbone_attr"])(**body, use_cache=False).last_hidden_state  # [1, N, H]
    labels = kwargs["shift_labels"]  # [1, N]
    rows = (labels[0] != -100).nonzero().squeeze(1)  # [L] the labelled positions, in order
    out = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)  # [1, N]
    lm_head = model.get_output_embeddings()
    picked = hidden[0, rows]  # [L, H]
    step = HEAD_ROWS_CPU if picked.device.type == "cpu" else max(rows.numel(), 1)
    for i in range(0, rows.numel(), step):
        logp = ChunkedLogProbFunction.apply(
            picked[i:i + step], lm_head.weight, lm_head.bias, labels[0, rows[i:i + step]], head["temperature"],
            _CHUNKED_LOGPROB_CHUNK_SIZE, head["final_logit_softcapping"], head["logit_scale"], ("log_probs",))[0]
        out[0, rows[i:i + step]] = logp.float()  # [≤ step]
    return out


class _Record:
    """One micro-batch's per-token tensors [M] (for the monitor and for checks)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Hooks:
    """What both the monitor and the fix install on one trainer, once: the version carried into the batch, the
    shadows taken at each sync, and the shadow forwards at the loss."""

    def __init__(self, trainer, engine_dtype: str, matmul: str):
        self.trainer, self.engine_dtype, self.matmul = trainer, engine_dtype, matmul
        self.fix = False
        self.monitor: AsyncPrecisionMonitor | None = None
        self.shadows: _Shadows | None = None
        self.group_version: dict = {}
        self.last: _Record | None = None
        self.monitor_seconds = 0.0
        self.monitor_cpu_seconds = 0.0
        """the same span in this thread's CPU time (what other processes on a shared machine do not inflate)."""
        self.seconds = {"snapshot": 0.0, "forwards": 0.0, "figures": 0.0}
        """the monitor's clock by part (bench/bench_trl_async_monitor.py); `shadows.build_seconds` is in snapshot."""
        self._install()

    def _install(self) -> None:
        trainer = self.trainer
        original_sync, original_loader, original_loss = (trainer._sync_weight, trainer.get_train_dataloader,
                                                         trainer.compute_loss)
        from trl.experimental.async_grpo.async_grpo_trainer import StepIntervalCallback

        def sync_weight():
            original_sync()
            self._after_sync()

        for cb in trainer.callback_handler.callbacks:  # attached after __init__: TRL's periodic sync holds the method
            if isinstance(cb, StepIntervalCallback) and getattr(cb.fn, "__func__", None) is original_sync.__func__:
                cb.fn = sync_weight
        trainer._sync_weight = sync_weight

        def get_train_dataloader():
            check_trainer_state(trainer)
            if trainer.accelerator.is_main_process and not isinstance(trainer.rollout_queue, _VersionReader):
                trainer.rollout_queue = _VersionReader(trainer.rollout_queue, self.group_version)
            loader = original_loader()
            if trainer.accelerator.is_main_process:  # accelerate's dispatcher iterates the loader it wraps
                inner = getattr(loader, "base_dataloader", loader)
                inner.collate_fn = _VersionedCollate(inner.collate_fn, self.group_version)
            return loader

        trainer.get_train_dataloader = get_train_dataloader

        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            return self._loss(original_loss, model, inputs, return_outputs, num_items_in_batch)

        trainer.compute_loss = compute_loss

    def _after_sync(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self._snapshot()
        if self.monitor is not None:  # the shadows' own cost: a copy of the weights sent, rounded, per sync
            self.monitor_seconds += time.perf_counter() - t0
            self.monitor_cpu_seconds += time.thread_time() - c0
            self.seconds["snapshot"] += time.perf_counter() - t0

    def _snapshot(self) -> None:
        trainer = self.trainer
        version = torch.tensor([trainer.model_version if trainer.accelerator.is_main_process else 0])
        if _world() > 1:  # TRL bumps model_version on the main process only
            version = version.to(trainer.accelerator.device)
            dist.broadcast(version, src=0)
        if self.shadows is None:
            self.shadows = _Shadows(trainer, self.engine_dtype, self.matmul)
        self.shadows.snapshot(int(version.item()))

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
        shadows = self.shadows
        kwargs, token_index, selected = _packed_forward(inputs)
        versions = inputs[VERSION_KEY][0][inputs["segment_id"][selected]]  # [M] each token's sample version
        now = shadows.now()
        full_now = _score(now, kwargs)  # [1, N]
        logp_shadow = full_now.flatten()[token_index]  # [M] current weights, engine dtype
        logp_shadow_old = torch.full_like(logp_shadow, math.nan)  # [M] the sample's version, engine dtype
        for v in versions.unique().tolist():
            at = versions == v
            model_v = shadows.versions.get(v)
            if model_v is None:
                if self.fix:
                    raise IntegrationError(f"a sample of version {v} has no shadow (kept: {sorted(shadows.versions)}):"
                                           " attach before training, and keep TRL's max_staleness filter on")
                continue
            full = full_now if model_v is now else _score(model_v, kwargs)
            logp_shadow_old[at] = full.flatten()[token_index][at]
        shadow_seconds, shadow_cpu = time.perf_counter() - t0, time.thread_time() - c0
        logp_engine = inputs["old_log_probs"][selected].float()  # [M] the server's log-probs at θ_v
        call = _ModelCall(model, full_now if self.fix else None)
        if self.fix:  # the clip sees α: old log-probs from the version's shadow, current ones from today's shadow
            inputs = dict(inputs)
            old = inputs["old_log_probs"].clone()  # [1, M_pad]
            old[selected] = logp_shadow_old.to(old.dtype)
            inputs["old_log_probs"] = old
        loss = original(call, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        t1, c1 = time.perf_counter(), time.thread_time()
        logp = call.log_probs.detach().flatten()[token_index].float()  # [M] the loss's own forward
        self.last = _Record(logp=logp, logp_engine=logp_engine, logp_shadow=logp_shadow,
                            logp_shadow_old=logp_shadow_old, advantages=inputs["advantages"][selected].float(),
                            staleness=shadows.version - versions, token_index=token_index, versions=versions,
                            row=kwargs)
        if measure:
            self.monitor._record(self.last)
        if self.monitor is not None:
            self.monitor_seconds += shadow_seconds + (time.perf_counter() - t1)
            self.monitor_cpu_seconds += shadow_cpu + (time.thread_time() - c1)
            self.seconds["forwards"] += shadow_seconds
            self.seconds["figures"] += time.perf_counter() - t1
        return loss


class _ModelCall:
    """The model as TRL's compute_loss calls it: records the forward's log-probs, and with `value` given (the fix)
    hands TRL value + (logp − logp.detach()): the shadow's value, the trainer's gradient."""

    def __init__(self, model: nn.Module, value: torch.Tensor | None):
        self.model, self.value, self.log_probs = model, value, None

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        lp = out.log_probs  # [1, N]
        self.log_probs = lp
        if self.value is not None:
            out.log_probs = self.value.to(lp.dtype) + (lp - lp.detach())
        return out


class _VersionReader:
    """The rollout queue as TRL's reader sees it; notes each sample's group version on the way (main process)."""

    def __init__(self, inner, group_version: dict):
        self._inner, self._group_version = inner, group_version

    def get(self, *args, **kwargs):
        sample = self._inner.get(*args, **kwargs)
        self._group_version[sample.group_id] = int(sample.model_version)
        return sample

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _VersionedCollate:
    """TRL's collator, plus `pc_sample_version` [rows, samples]: the version of each sample of each row, in the
    order `TreeRow.pack` numbers them (`segment_id`), −1 padded."""

    def __init__(self, inner, group_version: dict):
        self._inner, self._group_version = inner, group_version

    def __call__(self, examples):
        (rows,) = examples
        batch = self._inner(examples)
        versions = [[self._group_version[s["group_id"]] for s in row.samples] for row in rows]
        width = max(len(v) for v in versions)
        batch[VERSION_KEY] = torch.tensor([v + [-1] * (width - len(v)) for v in versions], dtype=torch.long)
        return batch


try:  # a TrainerCallback when transformers is importable (it always is beside trl)
    from transformers import TrainerCallback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object


def _trainer_being_built():
    """The AsyncGRPOTrainer whose __init__ is calling the callbacks' on_init_end (callbacks get no trainer)."""
    import inspect

    from trl.experimental.async_grpo import AsyncGRPOTrainer

    for frame in inspect.stack()[1:]:
        obj = frame.frame.f_locals.get("self")
        if isinstance(obj, AsyncGRPOTrainer):
            return obj
    return None


def _hooks_of(trainer, engine_dtype: str, matmul: str, built: bool = True) -> _Hooks:
    hooks = trainer.__dict__.get("_pc_async")
    if hooks is None:
        check_async_internals(trainer, built)
        check_shadow_memory(trainer, engine_dtype)
        hooks = trainer._pc_async = _Hooks(trainer, engine_dtype, matmul)
    elif (hooks.engine_dtype, hooks.matmul) != (engine_dtype, matmul):
        raise IntegrationError(f"this trainer's shadows are {hooks.engine_dtype} (matmul {hooks.matmul}); the monitor "
                               f"and with_async_shadow_ratio must name the same engine dtype, not {engine_dtype}")
    return hooks


class AsyncPrecisionMonitor(_Callback):
    """Logs `precision/*` through the async trainer's own metrics every `interval` optimizer steps, on the tokens
    TRL's loss trains: α, β and its two parts against the shadow of each sample's version, TRL's clip rate, the clip
    rate on α alone, the phantom-clip rate, and the staleness of those tokens. Figures are over every rank's tokens
    (the same on each rank), appended as (sum, count) pairs so TRL's log reduces a window token-weighted. It never
    changes a gradient. Pass it in `callbacks=[...]` (it attaches while the trainer is built) or call `attach`
    before `train()`."""

    def __init__(self, engine_dtype: str = "bfloat16", epsilon: float | None = None, epsilon_high: float | None = None,
                 interval: int = 1, matmul: str = "auto"):
        check_trl_version()
        check_monitor_args("AsyncPrecisionMonitor", engine_dtype, matmul, interval, epsilon, epsilon_high)
        self.engine_dtype, self.matmul, self.interval = engine_dtype, matmul, interval
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.trainer = None
        self.last: dict | None = None

    def attach(self, trainer, _built: bool = True) -> None:
        from trl.experimental.async_grpo import AsyncGRPOTrainer

        if not isinstance(trainer, AsyncGRPOTrainer):
            raise IntegrationError("AsyncPrecisionMonitor works with trl.experimental.async_grpo.AsyncGRPOTrainer and "
                                   f"its subclasses, not {type(trainer).__name__} (GRPOTrainer: PrecisionMonitor)")
        if self.trainer is not None:
            raise IntegrationError("this AsyncPrecisionMonitor is already attached to a trainer: make one per trainer")
        hooks = _hooks_of(trainer, self.engine_dtype, self.matmul, _built)
        if hooks.monitor is not None:
            raise IntegrationError("this trainer already has an AsyncPrecisionMonitor: attach one only")
        hooks.monitor, self.trainer, self.hooks = self, trainer, hooks
        if self.epsilon is None:  # TRL's own trust region, or our ε_high over it
            self._eps = (trainer.epsilon_low, trainer.epsilon_high if self.epsilon_high is None else self.epsilon_high)
        else:
            self._eps = clip_range(self.epsilon, self.epsilon_high)

    def on_init_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            trainer = _trainer_being_built()
            if trainer is not None:
                self.attach(trainer, _built=False)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise IntegrationError("AsyncPrecisionMonitor is not attached: pass it in the trainer's callbacks, or call "
                                   "monitor.attach(trainer) before trainer.train()")
        state.log_history.append({"precision/engine_dtype": self.engine_dtype,
                                  "precision/max_staleness": self.trainer.args.max_staleness,
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
            if name.startswith("staleness_"):
                sink[f"precision/{name.replace('staleness_', 'staleness_share_')}"].append((value, s["tokens"]))
        sink["precision/beta_abs_p99"].append(stats["beta_abs_p99"])
        sink["precision/nonfinite_total"].append(s["nonfinite"])


def with_async_shadow_ratio(trainer_cls: type, engine_dtype: str = "bfloat16", matmul: str = "auto") -> type:
    """A subclass of `trainer_cls` (AsyncGRPOTrainer or a subclass) whose PPO clip decides on α alone.

    TRL's compute_loss runs unchanged on two replaced inputs: the old log-probs become the shadow's of the sample's
    version (log π_shadow(θ_v), instead of the server's), and the log-probs of its forward become log π_shadow(θ_t) +
    (logp − logp.detach()): value of the current weights' shadow, gradient of the trainer's forward. The ratio TRL
    clips is then exp(α), and its gradient is TRL's with exp(α) in place of exp(α + β) per token. TRL's loss,
    normalisation (global token count per rank, gradient accumulation) and metrics are otherwise its own; its
    `ratio`, `kl` and `clip_ratio/*` then describe the ratio it clips, exp(α). Costs one shadow forward per
    micro-batch and one more per other version present in it (none at staleness 0 with weight_sync_steps = 1)."""
    check_trl_version()
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, AsyncGRPOTrainer)):
        name = getattr(trainer_cls, "__name__", trainer_cls)
        raise IntegrationError(f"with_async_shadow_ratio wraps AsyncGRPOTrainer or a subclass of it, not {name!r}")
    check_engine_args(engine_dtype, matmul, "with_async_shadow_ratio")

    class AsyncShadowRatio(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _hooks_of(self, engine_dtype, matmul).fix = True

    AsyncShadowRatio.__name__ = AsyncShadowRatio.__qualname__ = f"AsyncShadowRatio{trainer_cls.__name__}"
    return AsyncShadowRatio
