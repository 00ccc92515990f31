"""The policy's full weights on every rank, as the engine samples with them: for the shadow of the TRL integration.

A trainer's parameters may be whole (one process, DDP), sharded (FSDP1 flat parameters, FSDP2 DTensors, DeepSpeed
ZeRO-3 placeholders) and wrapped in LoRA adapters (PEFT). vLLM samples with neither: TRL hands it each full
parameter, LoRA merged in (W + s·BA), under the base model's names (trl 1.16 generation/vllm_generation.py,
`VLLMGeneration._iter_named_params`). `full_weights` yields the same (name, tensor) pairs, one parameter (or one
LoRA layer) at a time so that at most one of them is gathered at once, and it never writes to the trainer's
parameters: TRL's merge_adapter/unmerge_adapter round trip does, and it is not exact (W + Δ − Δ ≠ W in floating
point; TRL #6688 for bf16). Gathering is a collective, so every rank must iterate, in the same order.

The shadow is built from the model's config on the meta device (never a deepcopy: FSDP2 refuses to be copied and
FSDP1's flat parameters do not pickle) and filled from `full_weights`: a whole copy of the model in the engine's
dtype on every rank (2 bytes a parameter in bf16: 0.27 GB for SmolLM2-135M, 15 GB for an 8B model), beside the
rank's shard. Sharding kinds are told from the parameters themselves, so this works whether accelerate or the user
did the wrapping.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from ..base.errors import IntegrationError
from ..base.numerics import parse_dtype
from ..precision.recipes import apply_recipe, engine_recipe

SHARDINGS = ("none", "fsdp1", "fsdp2", "zero3")
"""How a model's parameters are held: whole on each rank (one process or DDP), or sharded by one of three systems."""


def sharding_of(model: nn.Module) -> str:
    """The sharding kind of `model` (unwrapped from DDP): one of SHARDINGS, read from its modules and parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return "fsdp1"
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # DeepSpeed ZeRO-3 tags every partitioned parameter
        return "zero3"
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in params):
        return "fsdp2"
    return "none"


def sharded_root(model: nn.Module) -> nn.Module:
    """`model` without DDP's wrapper, FSDP1's kept: an FSDP1 root holds the root-level parameters (embeddings, final
    norm) in its own flat parameter, which the module it wraps no longer has. Pass this to `full_weights`."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def _inner(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    while isinstance(model, FullyShardedDataParallel):
        model = model.module
    return model


def base_of(model: nn.Module) -> nn.Module:
    """The transformers model under FSDP1's root and PEFT's wrapper (`model` itself without either)."""
    model = _inner(sharded_root(model))
    return model.get_base_model() if _is_peft(model) else model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _check_no_tensor_parallel(model: nn.Module) -> None:
    """DeepSpeed's AutoTP (`tensor_parallel.autotp_size` > 1) replaces Linear layers and embeddings by layers that
    hold a slice of each weight (deepspeed 0.19.8 module_inject/layers.py, TensorParallel_Layer): no ZeRO tag, no
    DTensor, so the shadow would take a rank's slice for the whole weight. Refused (one line); read from the loaded
    module only (an AutoTP layer exists only if DeepSpeed was imported)."""
    import sys

    layers = sys.modules.get("deepspeed.module_inject.layers")
    if layers is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, layers.TensorParallel_Layer):
            raise IntegrationError(f"the shadow cannot mirror DeepSpeed tensor parallelism ({type(module).__name__} "
                                   f"at {name} holds a slice of its weight): train without tensor_parallel.autotp_size"
                                   " (ZeRO-3 is supported) or drop PrecisionMonitor / with_shadow_ratio")


def check_supported(model: nn.Module) -> str:
    """Raise IntegrationError (one line) for what `full_weights` cannot mirror exactly; returns the sharding kind."""
    kind = sharding_of(model)
    _check_no_tensor_parallel(model)
    if not _is_peft(_inner(model)):
        return kind
    if kind == "fsdp1":
        raise IntegrationError("the shadow cannot mirror a PEFT model under FSDP1 (LoRA merges need whole layers, and "
                               "TRL's own sync leaves this case untested): use FSDP2 (fsdp_version: 2) or DeepSpeed")
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in _inner(model).named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, LoraLinear):
            raise IntegrationError(f"the shadow mirrors LoRA on Linear layers only, not {type(module).__name__} at "
                                   f"{name}: target Linear modules (target_modules) or drop PrecisionMonitor")
        if len(module.active_adapters) != 1:
            raise IntegrationError(f"the shadow mirrors one active LoRA adapter, {name} has "
                                   f"{list(module.active_adapters)}")
        adapter = module.active_adapters[0]
        if module.lora_variant.get(adapter) is not None:
            variant = type(module.lora_variant[adapter]).__name__
            raise IntegrationError(f"the shadow mirrors plain LoRA, not the {variant} variant at {name} (use_dora and "
                                   "other variants merge differently)")
    return kind


@contextlib.contextmanager
def _gathered(kind: str, params: list[nn.Parameter]) -> Iterator[None]:
    """Materialise ZeRO-3 partitions of `params` for the duration (a no-op for the other kinds)."""
    if kind != "zero3":
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a parameter that may be an FSDP2 shard (DTensor.full_tensor is a collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _lora_merged(module: nn.Module) -> dict[str, torch.Tensor]:
    """The base layer's weight (and bias) with the active LoRA adapter merged, computed as PEFT's `merge` does
    (peft tuners/lora/layer.py, Linear.get_delta_weight: W + transpose(B @ A, fan_in_fan_out) · scaling, and
    bias + b_B · scaling with lora_bias) without writing to the layer."""
    adapter = module.active_adapters[0]
    base = module.get_base_layer()
    a, b = _full(module.lora_A[adapter].weight), _full(module.lora_B[adapter].weight)  # [r, in], [out, r]
    delta = b @ a  # [out, in]
    delta = (delta.T if module.fan_in_fan_out else delta) * module.scaling[adapter]
    out = {"weight": _full(base.weight) + delta}
    if getattr(base, "bias", None) is not None:
        bias = _full(base.bias)
        if module.lora_bias[adapter]:
            bias = bias + _full(module.lora_B[adapter].bias) * module.scaling[adapter]
        out["bias"] = bias
    return out


def engine_name(name: str) -> str:
    """A parameter's name as vLLM knows it: PEFT's and FSDP's wrapper prefixes removed (TRL's `_iter_named_params`
    and `_fix_param_name_to_vllm`)."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "modules_to_save.default."):
        name = name.replace(wrapper, "")
    return name


def full_weights(model: nn.Module, kind: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every parameter of `model` (`sharded_root`) as the engine receives it: whole, LoRA
    merged, under the base model's names; tied weights once. Call on every rank (gathers are collectives). The
    tensors are views of or computed from the trainer's parameters: copy them before the next optimizer step.
    `kind`: the model's `check_supported` result when the caller has it (a shadow checks once, not every sync)."""
    model = sharded_root(model)
    kind = check_supported(model) if kind is None else kind
    if kind == "fsdp1":
        yield from _fsdp1_weights(model)
        return
    seen: set[int] = set()
    for prefix, module, is_lora in _owners(model):
        if is_lora:
            with _gathered(kind, list(module.parameters())):
                for leaf, value in _lora_merged(module).items():
                    yield engine_name(f"{prefix}.{leaf}"), value
            continue
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) in seen or "original_module" in prefix:  # tied weights once; PEFT's frozen copy of a saved module
                continue
            seen.add(id(p))
            with _gathered(kind, [p]):
                yield engine_name(f"{prefix}.{leaf}" if prefix else leaf), _full(p)


def _owners(model: nn.Module) -> Iterator[tuple[str, nn.Module, bool]]:
    """(prefix, module, is_lora) for the modules that own parameters, in order; a LoRA layer (check_supported: a
    plain LoRA Linear) stands for its whole subtree, base layer and adapters."""
    lora_layer: type | tuple = ()
    if _is_peft(model):
        from peft.tuners.lora import LoraLayer as lora_layer
    skip: tuple[str, ...] = ()
    for prefix, module in model.named_modules():
        if skip and prefix.startswith(skip):
            continue
        if isinstance(module, lora_layer):
            skip = (*skip, prefix + ".")
            yield prefix, module, True
        elif any(True for _ in module.parameters(recurse=False)):
            yield prefix, module, False


def _fsdp1_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """FSDP1: each FSDP unit's own parameters, summoned whole one unit at a time (children first, as TRL does)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    seen: set[str] = set()
    units = [(prefix, m) for prefix, m in model.named_modules() if isinstance(m, FSDP)]
    for prefix, unit in reversed(units):  # post-order: a unit's full parameters never include a child's
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            for leaf, p in unit.named_parameters():
                name = engine_name(f"{prefix}.{leaf}" if prefix else leaf)
                if "_flat_param" not in name and name not in seen:  # a child unit's shard: yielded whole before
                    seen.add(name)
                    yield name, p.detach()


@torch.no_grad()
def build_shadow(model: nn.Module, engine_dtype: str, device: torch.device | str, matmul: str = "auto") -> nn.Module:
    """An empty copy of the base model in the engine's layout (`recipes.engine_recipe`) on `device`, built from its
    config on the meta device (no weights allocated twice, nothing copied from the trainer's module but its
    buffers); fill it with `sync_shadow`."""
    base = base_of(model)
    # The model's class built from a copy of its config, not `_from_config`: under DeepSpeed ZeRO-3 (a
    # HfDeepSpeedConfig alive in the process) `_from_config` builds inside `deepspeed.zero.Init` and then runs
    # `initialize_weights_zero3` (transformers 5.24.0 modeling_utils.py, `PreTrainedModel._from_config`:
    # `needs_zero3_init = is_deepspeed_zero3_enabled() and ...`), which partitions the skeleton and fails on its meta
    # RoPE buffer ('Cannot copy out of meta tensor'). The constructor has no ZeRO-3 branch, skips weight init on the
    # meta device (`init_weights`), and does not write the trainer's config (`_from_config` sets its dtype).
    with torch.device("meta"):
        skeleton = type(base)(copy.deepcopy(base.config)).float()
    shadow = apply_recipe(skeleton, engine_recipe(parse_dtype(engine_dtype)), matmul=matmul, device=device)
    shadow.to_empty(device=device)
    buffers = {engine_name(name): b for name, b in base.named_buffers()}  # RoPE tables: never sharded, kept in fp32
    for name, buf in shadow.named_buffers():
        owner, _, leaf = name.rpartition(".")
        (shadow.get_submodule(owner) if owner else shadow)._buffers[leaf] = buffers[name].clone()
    shadow.tie_weights()
    return shadow


@torch.no_grad()
def sync_shadow(shadow: nn.Module, model: nn.Module, kind: str | None = None) -> float:
    """Copy `full_weights(model)` into `shadow`, each cast to the shadow's dtype (round to nearest, as vLLM's load);
    returns the share of values that changed. Every parameter of the shadow must be filled (else IntegrationError:
    a name the mirror does not know)."""
    params = dict(shadow.named_parameters())
    changed, total, filled = 0, 0, set()
    for name, value in full_weights(model, kind):
        p = params.get(name)
        if p is None:
            raise IntegrationError(f"the shadow has no parameter {name!r} (a module the engine's model lacks): "
                                   "PrecisionMonitor supports models whose trained parameters are the base model's")
        new = value.to(p.dtype)
        changed += (p != new).sum().item()
        total += p.numel()
        p.copy_(new)
        filled.add(name)
    missing = set(params) - filled
    if missing:
        raise IntegrationError(f"the trainer's model has no parameter for {sorted(missing)[0]!r} of the shadow "
                               f"({len(missing)} missing): its weights cannot be mirrored")
    return changed / max(total, 1)
