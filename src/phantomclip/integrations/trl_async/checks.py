"""What TRL's async trainer must offer the async integration (integrations.trl_async), checked at attach in one
line each: where the installed TRL keeps the trainer, the internals the hooks read (methods, attributes, config
fields, sample fields, batch keys: a probe sample run through TRL's own reader, planner and collator), the fix's
ratio, and the memory the kept copies need."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import queue
from collections import defaultdict
from importlib.metadata import version

import numpy as np
import torch

from ...base.errors import IntegrationError, check_number
from ...base.numerics import parse_dtype
from ..trl import SUPPORTED_TRL, check_trl_version
from ..weights import sharded_root, sharding_of
from .forward import BATCH_KEYS
from .versions import VERSION_KEY, VersionedCollate, VersionReader, kept_versions, staleness_bound

ASYNC_MODULES = ("trl.trainer.async_grpo_trainer", "trl.experimental.async_grpo.async_grpo_trainer")
"""where a TRL defines AsyncGRPOTrainer: the stable module (trl >= 1.18, release notes of v1.18.0) first, then the
experimental one (trl 1.16-1.17, the layout this integration reads)."""
MODULE_NAMES = ("AsyncGRPOTrainer", "StepIntervalCallback", "RolloutQueueDataset", "FixedCountBatcher",
                "TokenBudgetBatcher", "DataCollatorForRollout")
"""what the trainer's module must define (the hooks wrap, probe or name each)."""
TRAINER_METHODS = ("_sync_weight", "compute_loss", "get_train_dataloader")
"""the trainer's methods the hooks wrap (trl 1.16 async_grpo_trainer.py)."""
TRAINER_ATTRIBUTES = ("epsilon_low", "epsilon_high", "temperature", "accelerator", "callback_handler", "state")
"""set before TRL's Trainer.__init__ ends (a callback's on_init_end sees them); checked at attach."""
TRAINER_STATE = ("_metrics", "model_version", "rollout_queue")
"""set at the end of AsyncGRPOTrainer.__init__: checked at attach after it, else when training starts."""
CONFIG_FIELDS = ("max_staleness", "weight_sync_steps", "token_budget", "gradient_accumulation_steps")
"""what the staleness bound and the hooks read of AsyncGRPOConfig."""
SAMPLE_FIELDS = ("input_ids", "completion_mask", "old_log_probs", "advantage", "model_version", "group_id")
"""the fields of the worker's RolloutSample the reader and the probe read (async_rollout_worker.py)."""


def async_trainer_module():
    """The installed TRL's module that defines AsyncGRPOTrainer (ASYNC_MODULES), or one line saying there is none."""
    for name in ASYNC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "AsyncGRPOTrainer"):
            return module
    raise IntegrationError(f"the installed trl has no AsyncGRPOTrainer (looked in {', '.join(ASYNC_MODULES)}): "
                           "pip install 'trl>=1.16,<1.17'")


def layout_difference(module) -> str | None:
    """The first thing the hooks read that `module` (and its package) lacks, in words, or None."""
    for name in MODULE_NAMES:
        if not hasattr(module, name):
            return f"{module.__name__} has no {name!r}"
    trainer = module.AsyncGRPOTrainer
    for name in TRAINER_METHODS:
        if not callable(getattr(trainer, name, None)):
            return f"AsyncGRPOTrainer has no method {name!r}"
    found = {}
    for sub, name in (("packing", "TreeRow"), ("async_rollout_worker", "RolloutSample")):
        try:
            found[name] = getattr(importlib.import_module(f"{module.__package__}.{sub}"), name)
        except ImportError:
            return f"{module.__package__} has no module {sub!r}"
        except AttributeError:
            return f"{module.__package__}.{sub} has no {name!r}"
    missing = [f for f in SAMPLE_FIELDS if f not in {f.name for f in dataclasses.fields(found["RolloutSample"])}]
    if missing:
        return f"RolloutSample has no field {missing[0]!r}"
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    for owner, name in ((utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"), (utils, "add_fused_lm_head"),
                        (chunked_logprob, "ChunkedLogProbFunction")):
        if not hasattr(owner, name):  # the copies' forwards (trl_async.forward)
            return f"{owner.__name__} has no {name!r}"
    return None


def async_trainer_class() -> type:
    """AsyncGRPOTrainer from wherever the installed TRL keeps it, refused in one line naming the first difference
    from trl 1.16's layout; a TRL of the same layout but another version is refused too (the staleness bound is
    derived from trl 1.16's dequeue, prefetch and planners: trl_async.versions)."""
    module = async_trainer_module()
    differs = layout_difference(module)
    if differs:
        raise IntegrationError(f"the installed trl {version('trl')} keeps AsyncGRPOTrainer in {module.__name__}, "
                               f"whose layout differs from trl {'.'.join(map(str, SUPPORTED_TRL))}'s ({differs}): "
                               "phantomclip.integrations.trl_async reads trl >=1.16,<1.17")
    check_trl_version()
    return module.AsyncGRPOTrainer


def _missing(owner: str, name: str) -> IntegrationError:
    return IntegrationError(f"{owner} has no attribute {name!r}: this TRL's async trainer differs from trl 1.16's, "
                            "which phantomclip.integrations.trl_async reads")


def check_trainer_state(trainer) -> None:
    for name in TRAINER_STATE:
        if not hasattr(trainer, name):
            raise _missing(type(trainer).__name__, name)


def check_async_internals(trainer, built: bool = True) -> None:
    """One IntegrationError line naming the first thing of TRL's async trainer the hooks read and do not find, before
    anything is replaced. `built`: AsyncGRPOTrainer.__init__ has returned (else its last attributes are checked when
    training starts)."""
    module = importlib.import_module(async_trainer_class().__module__)
    for name in TRAINER_METHODS:
        if not callable(getattr(type(trainer), name, None)):
            raise _missing(type(trainer).__name__, name)
    for name in TRAINER_ATTRIBUTES:
        if not hasattr(trainer, name):
            raise _missing(type(trainer).__name__, name)
    if built:
        check_trainer_state(trainer)
    for name in CONFIG_FIELDS:
        if not hasattr(trainer.args, name):
            raise _missing(type(trainer.args).__name__, name)
    for name, low in (("max_staleness", 0), ("weight_sync_steps", 1)):
        # −1 would keep no weight version and count every sample as over the staleness bound, logging nothing true
        check_number(f"{type(trainer.args).__name__}.{name}", getattr(trainer.args, name), low, integer=True,
                     error=IntegrationError)
    check_pipeline(module.__name__)


@functools.cache
def check_pipeline(module_name: str) -> None:
    """One probe sample through TRL's own queue reader, fixed-count planner and collator, with the integration's
    version carrying on (VersionReader, VersionedCollate): every sample field, yielded key and batch key the hooks
    read is there, or one line names the first that is not. Once per process (TRL's reader starts a daemon thread)."""
    module = importlib.import_module(module_name)
    worker = importlib.import_module(f"{module.__package__}.async_rollout_worker")
    values = {"input_ids": np.array([5, 6, 7]), "completion_mask": np.array([0, 1, 1]), "advantage": 1.0,
              "old_log_probs": np.array([0.0, -1.0, -2.0], dtype=np.float32), "model_version": 7, "group_id": 0,
              "metrics": {}, "prompt": "", "completion": ""}
    sample = worker.RolloutSample(**{f.name: values.get(f.name) for f in dataclasses.fields(worker.RolloutSample)})
    probe = queue.Queue()
    probe.put(sample)
    versions: dict = {}
    try:
        reader = module.RolloutQueueDataset(VersionReader(probe, versions), lambda: 7, lambda s: None, 60.0,
                                            defaultdict(list), max_staleness=0)
        rows = next(iter(module.FixedCountBatcher(reader, 1, 1)))
        collate = VersionedCollate(module.DataCollatorForRollout(0, 1), versions, 1)
        batch = collate([rows])
    except (TypeError, KeyError, AttributeError, IntegrationError) as e:
        raise IntegrationError(f"a probe sample does not pass TRL's reader, planner and collator as in trl 1.16 "
                               f"({type(e).__name__}: {e}): phantomclip.integrations.trl_async reads trl >=1.16,<1.17"
                               ) from None
    missing = [key for key in (*BATCH_KEYS, VERSION_KEY) if key not in batch]
    if missing or batch[VERSION_KEY].tolist() != [[7]]:
        raise IntegrationError(f"TRL's collated batch has no {(missing or [VERSION_KEY])[0]!r} as trl 1.16's has: "
                               "phantomclip.integrations.trl_async reads trl >=1.16,<1.17")


def copy_bytes(trainer, dtype: torch.dtype) -> int:
    """Bytes of one whole copy of the policy's parameters in `dtype`."""
    model = sharded_root(trainer.model)
    seen, count = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            count += getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 placeholders hold their full size apart
    return count * dtype.itemsize


def shadow_memory(trainer, engine_dtype: str) -> tuple[int, int]:
    """(copies kept, bytes per copy) of the engine-dtype shadows: one per version a trained token may have
    (staleness_bound + 1), plus one for the current weights when they move between syncs (weight_sync_steps > 1)."""
    kept = kept_versions(trainer.args) + (1 if trainer.args.weight_sync_steps > 1 else 0)
    return kept, copy_bytes(trainer, parse_dtype(engine_dtype))


def available_memory(device: torch.device) -> int:
    """Bytes free on `device`: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def trainer_version_bytes(trainer, keep: int | None = None) -> tuple[int, int]:
    """(copies, bytes per copy on this rank) of ratio "trust-region"'s kept weights (versions.TrainerVersions): the
    trainable parameters' local tensors (FSDP2: this rank's shard) in their own dtype, one per version a trained
    token may have (or `keep`), plus under FSDP2 one stash of the current shards while a version is swapped in."""
    seen, count = set(), 0
    for p in sharded_root(trainer.model).parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p
            count += local.numel() * local.element_size()
    stash = 1 if sharding_of(sharded_root(trainer.model)) == "fsdp2" else 0
    return (kept_versions(trainer.args) if keep is None else keep) + stash, count


def check_shadow_memory(trainer, engine_dtype: str, kinds: set[str], trainer_keep: int | None = None) -> None:
    """The copies of every kind in `kinds` fit in the device's free memory, else one line with the need and what is
    available: "engine" (the engine's dtype, whole on each rank: one per version a trained token may have, plus the
    current weights when they move between syncs) and "trainer" (the trainable parameters' local shards in their
    dtype, one per version plus a stash: trainer_version_bytes)."""
    args = trainer.args
    need = {}
    if "engine" in kinds:
        need["engine"] = (shadow_memory(trainer, engine_dtype)[0], copy_bytes(trainer, parse_dtype(engine_dtype)),
                          engine_dtype)
    if "trainer" in kinds:
        need["trainer"] = (*trainer_version_bytes(trainer, trainer_keep),
                           "the trainable parameters' dtype, this rank's shard")
    total = sum(n * b for n, b, _ in need.values())
    free = available_memory(trainer.accelerator.device)
    if total > free:
        parts = ", ".join(f"{n} copies of {b / 2**30:.2f} GiB in {what}" for n, b, what in need.values())
        raise IntegrationError(
            f"the async copies need {total / 2**30:.2f} GiB ({parts}: staleness bound {staleness_bound(args)} = "
            f"max_staleness {args.max_staleness} + prefetch, plus one) but {free / 2**30:.2f} GiB is available on "
            f"{trainer.accelerator.device}: lower max_staleness, or use ratio='decoupled' (no copies, no trust "
            "region against staleness)")
