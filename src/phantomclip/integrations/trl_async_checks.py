"""What TRL's async trainer must offer the async integration (integrations.trl_async), checked at attach in one
line each: the trl 1.16 internals it reads, the engine dtype, and the memory its shadows need."""

from __future__ import annotations

import torch

from ..errors import IntegrationError, check_number
from ..numerics import parse_dtype
from .trl import check_trl_version
from .weights import sharded_root

TRAINER_METHODS = ("_sync_weight", "compute_loss", "get_train_dataloader")
"""the trainer's methods the hooks wrap (trl 1.16 async_grpo_trainer.py); checked at attach."""
TRAINER_ATTRIBUTES = ("epsilon_low", "epsilon_high", "temperature", "accelerator", "callback_handler")
"""set before TRL's Trainer.__init__ ends (a callback's on_init_end sees them); checked at attach."""
TRAINER_STATE = ("_metrics", "model_version", "rollout_queue")
"""set at the end of AsyncGRPOTrainer.__init__: checked at attach after it, else when training starts."""
MODULE_NAMES = ("StepIntervalCallback", "RolloutQueueDataset", "DataCollatorForRollout")


def _missing(trainer, name: str) -> IntegrationError:
    return IntegrationError(f"{type(trainer).__name__} has no attribute {name!r}: this TRL's async trainer differs "
                            "from trl 1.16's, which phantomclip.integrations.trl_async reads")


def check_trainer_state(trainer) -> None:
    for name in TRAINER_STATE:
        if not hasattr(trainer, name):
            raise _missing(trainer, name)


def check_async_internals(trainer, built: bool = True) -> None:
    """One IntegrationError line naming the first attribute of TRL's async trainer the hooks need and do not find
    (a newer TRL whose internals differ), before anything is replaced. `built`: AsyncGRPOTrainer.__init__ has
    returned (else its last attributes are checked when training starts)."""
    check_trl_version()
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    for name in TRAINER_METHODS:
        if not callable(getattr(type(trainer), name, None)):
            raise _missing(trainer, name)
    for name in TRAINER_ATTRIBUTES:
        if not hasattr(trainer, name):
            raise _missing(trainer, name)
    if built:
        check_trainer_state(trainer)
    for name in MODULE_NAMES:
        if not hasattr(async_grpo_trainer, name):
            raise IntegrationError(f"trl.experimental.async_grpo.async_grpo_trainer has no {name!r}: this TRL's async "
                                   "trainer differs from trl 1.16's")
    for name, low in (("max_staleness", 0), ("weight_sync_steps", 1)):
        if not hasattr(trainer.args, name):
            raise IntegrationError(f"{type(trainer.args).__name__} has no attribute {name!r}: this TRL's async "
                                   "trainer differs from trl 1.16's")
        # −1 would keep no weight version and count every sample as over the staleness bound, logging nothing true
        check_number(f"{type(trainer.args).__name__}.{name}", getattr(trainer.args, name), low, integer=True,
                     error=IntegrationError)
    if not hasattr(packing.TreeRow, "pack"):
        raise IntegrationError("trl.experimental.async_grpo.packing.TreeRow has no attribute 'pack'")
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    for module, name in ((utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"), (chunked_logprob, "ChunkedLogProbFunction")):
        if not hasattr(module, name):  # the shadow forwards' head (trl_async._score)
            raise IntegrationError(f"{module.__name__} has no {name!r}: this TRL's log-prob head differs from trl "
                                   "1.16's")


def shadow_memory(trainer, engine_dtype: str) -> tuple[int, int]:
    """(shadows kept, bytes per shadow): one whole copy of the policy's parameters in the engine's dtype per version
    a trained sample may have (max_staleness + 1), plus one for the current weights when they move between syncs
    (weight_sync_steps > 1)."""
    model = sharded_root(trainer.model)
    seen, count = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            count += getattr(p, "ds_numel", None) or p.numel()  # ZeRO-3 placeholders hold their full size apart
    per = count * parse_dtype(engine_dtype).itemsize
    kept = trainer.args.max_staleness + 1 + (1 if trainer.args.weight_sync_steps > 1 else 0)
    return kept, per


def available_memory(device: torch.device) -> int:
    """Bytes free on `device`: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_shadow_memory(trainer, engine_dtype: str) -> None:
    kept, per = shadow_memory(trainer, engine_dtype)
    free = available_memory(trainer.accelerator.device)
    if kept * per > free:
        raise IntegrationError(
            f"the async shadows need {kept * per / 2**30:.2f} GiB ({kept} copies of {per / 2**30:.2f} GiB in "
            f"{engine_dtype}: max_staleness {trainer.args.max_staleness} + 1) but {free / 2**30:.2f} GiB is available "
            f"on {trainer.accelerator.device}: lower max_staleness")
