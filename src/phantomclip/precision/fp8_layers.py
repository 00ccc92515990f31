"""FP8 engine recipes put into a model: which Linears an FP8 engine quantises and how each recipe quantises them
(`LinearQuant`, `LINEAR_QUANTS`), their forward on the emulated quantisers, the FP8 KV cache, and the checks that
refuse what vLLM would not run. The quantisers and products themselves, with the vLLM sources each rule is read
from, are precision/fp8.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from .fp8 import (
    BLOCK,
    HALVES,
    amax_of,
    block_product,
    dequant_kv,
    onednn_linear,
    pack_weight,
    product,
    quant_blocks,
    quant_groups,
    quant_rows,
    quant_tensor,
    scaled_product,
)


@dataclass(frozen=True)
class LinearQuant:
    """How an FP8 engine runs a Linear: the weight's scale granularity and the activations'."""

    name: str
    weight: str
    """'tensor' (one scale per merged layer), 'channel' (one per output row), 'block' (128 x 128) or 'none' (the
    weight as stored: `trace`'s what-if of FP8 activations alone)."""
    activation: str | None
    """'token' (dynamic, one scale per row), 'group' (dynamic, 1 x 128) or None (weight-only: bf16 activations)."""
    doc: str = ""


LINEAR_QUANTS: dict[str, LinearQuant] = {q.name: q for q in [
    LinearQuant("fp8-w8a8", "tensor", "token",
                "vLLM quantization='fp8' on an FP8 GPU: per-tensor weights, dynamic per-token activations"),
    LinearQuant("fp8-w8a8-channel", "channel", "token",
                "FP8-dynamic checkpoints (compressed-tensors): per-channel weights, per-token activations"),
    LinearQuant("fp8-block", "block", "group",
                "block-quantised FP8 checkpoints: 128x128 weight blocks, 1x128 activation groups"),
    LinearQuant("fp8-w8a16", "tensor", None,
                "weight-only FP8 (vLLM's Marlin path on GPUs without FP8 compute): bf16 activations"),
    LinearQuant("fp8-a8", "none", "token",
                "what-if, no engine runs it: per-token FP8 activations times the unquantised weights (trace)"),
]}


EMULATED = ("emulated on a CPU by phantomclip's local engine (vLLM's quantisers bit for bit, the products summed in "
            "fp32 in one order, not a GPU kernel's)")
"""what every FP8 figure of the local engine stands on, said where the figure is shown (the report's rows and
captions, diagnose's FP8 lines)."""


KV_QUANT = "fp8-kv"
"""the FP8 KV cache (vLLM kv_cache_dtype='fp8', E4M3, scale 1.0)."""


KVQ_QUANT = "fp8-kvq"
"""the FP8 KV cache with the query quantised too (scale 1.0): vLLM's attention backends that take an FP8 query
(FlashAttention 3, FlashInfer), where fp8-kv is the others' (the query stays in the model's dtype)."""


FP8_QUANTS = (*LINEAR_QUANTS, KV_QUANT, KVQ_QUANT)
"""every quantiser name an engine recipe can carry (at most one Linear quantiser, and fp8-kv or fp8-kvq)."""


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linears vLLM merges into one (QKVParallelLinear, MergedColumnParallelLinear): one per-tensor scale for all."""


ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
"""leaf names of MoE routers, which vLLM builds unquantised."""


class Fp8Error(ValueError):
    """An FP8 recipe a model cannot serve (names the recipe and the layer)."""


def check_quants(names: tuple[str, ...]) -> None:
    """Refuse unknown names and two Linear quantisers at once."""
    for n in names:
        if n not in FP8_QUANTS:
            raise Fp8Error(f"unknown FP8 quantiser {n!r}: use one of {', '.join(FP8_QUANTS)}")
    linear = [n for n in names if n in LINEAR_QUANTS]
    if len(linear) > 1:
        raise Fp8Error(f"{' and '.join(linear)}: an engine quantises its Linears one way; pick one (fp8-kv combines)")
    if KV_QUANT in names and KVQ_QUANT in names:
        raise Fp8Error(f"{KV_QUANT} and {KVQ_QUANT}: an engine's attention quantises the query or not; pick one")


def quantised_linears(model: nn.Module, skip: set[int]) -> dict[str, nn.Linear]:
    """name -> Linear for every Linear an FP8 engine quantises: all but the modules in `skip` (the LM head) and MoE
    routers."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and id(m) not in skip and name.rpartition(".")[2] not in ROUTER_NAMES}


def check_blocks(model: nn.Module, skip: set[int], recipe: str) -> None:
    """For block quantisation: every quantised Linear's K and N divisible by 128 (vLLM's group quantiser and its
    merged-layer check), else one Fp8Error naming the recipe and the first layer that breaks it."""
    for name, m in quantised_linears(model, skip).items():
        N, K = m.weight.shape
        if N % BLOCK or K % BLOCK:
            raise Fp8Error(f"recipe {recipe}: layer {name} has weight {N} x {K}, not divisible by the {BLOCK} x "
                           f"{BLOCK} block of fp8-block; use fp8-w8a8 or fp8-w8a16 for this model")


def check_no_experts(model: nn.Module, recipe: str) -> None:
    """An MoE model whose experts are 3-D tensors (transformers 5's fused experts, [experts, out, in]) gets one
    Fp8Error naming the recipe and the tensor: vLLM quantises them (Fp8MoEMethod), this module quantises Linears
    only, and an engine emulated with bf16 experts would be another engine than the one it stands for."""
    for name, p in model.named_parameters():
        if p.dim() == 3:
            raise Fp8Error(f"recipe {recipe}: {name} holds an MoE layer's experts as one {tuple(p.shape)} tensor, "
                           "which vLLM quantises to FP8 and phantomclip's emulation does not: FP8 Linear recipes are "
                           "refused on MoE models (fp8-kv alone runs)")


@torch.no_grad()
def quantise_weight(w: torch.Tensor, spec: LinearQuant, amax: torch.Tensor | None = None):
    """(q E4M3 [N, K], scale) of a Linear's stored weight under `spec`: scale [] for 'tensor' (from `amax` when the
    layer is one part of a merged one), [1, N] for 'channel', [N/128, K/128] for 'block'."""
    if spec.weight == "tensor":
        return quant_tensor(w, amax)
    if spec.weight == "channel":
        q, s = quant_rows(w)  # s [N, 1]
        return q, s.T
    if spec.weight == "none":  # the stored values (bf16 is exact in fp32), scale 1
        return w, torch.ones((), dtype=torch.float32, device=w.device)
    return quant_blocks(w)


def fp8_linear(x: torch.Tensor, spec: LinearQuant, wq: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, packed: torch.Tensor | str | None = None,
               tokens: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The FP8 engine's Linear on x [..., K] with the quantised weight (wq, sw): [..., N] in `out_dtype`. `packed`:
    wq laid out for oneDNN (`pack_weight`), for the per-tensor, per-channel and weight-only products. `tokens`:
    `token_quant(x)` where the caller has it already (a merged sibling on the same input)."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if spec.activation == "token":
        xq, sx = tokens if tokens is not None else token_quant(x)  # [M, K] fp32 E4M3 values, [M, 1]
        out = scaled_product(xq, sx, wq, sw, packed)  # [M, N] fp32
    elif spec.activation == "group":
        xq, sx = quant_groups(x2)  # [M, K], [M, K/128]
        out = block_product(xq, sx, wq, sw, reverse=packed == HALVES)
    else:  # weight-only: the activations as they are (bf16 values are exact in fp32)
        out = product(x2, wq, packed).mul_(sw)  # [M, N]
    if bias is not None:
        out = out.add_(bias.float())
    return out.to(out_dtype).reshape(*x.shape[:-1], wq.shape[0])


def token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantisation of x [..., K] as the GEMM reads it: (the E4M3 values in fp32 [M, K], scale [M, 1])."""
    xq, sx = quant_rows(x.reshape(-1, x.shape[-1]))
    return xq.float(), sx


def _shared_tokens(self: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`token_quant(x)` shared by a merged group (q/k/v, gate/up) that reads one input: the first member to see x
    quantises it and leaves it for the others, each of which takes it once, for the same tensor at the same version
    (so an input changed in place, or another input, is quantised again). vLLM quantises a merged layer's input once
    too. None where nothing is shared (a Linear alone, or an inference-mode tensor, which has no version)."""
    group = self._pc_fp8_group
    if len(group) < 2 or x.is_inference():
        return None
    shared = self._pc_fp8_amax
    held = shared.get("tokens")
    if held is not None and held[0] is x and held[1] == x._version and any(m is self for m in held[2]):
        held[2].remove(self)
        if not held[2]:
            del shared["tokens"]
        return held[3]
    tokens = token_quant(x)
    shared["tokens"] = (x, x._version, [m for m in group if m is not self], tokens)
    return tokens


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward of an FP8 engine (installed by `use_fp8`); the quantised weight is refreshed when a weight
    of its merged group changed (a weight sync bumps the version)."""
    group = self._pc_fp8_group  # the Linears sharing one per-tensor scale (just self where none)
    key = tuple((m.weight.data_ptr(), m.weight._version) for m in group)
    if getattr(self, "_pc_fp8_key", None) != key:
        spec = self._pc_fp8_spec
        amax = None
        if spec.weight == "tensor":  # the group's amax, once per weight version for all its members
            shared = self._pc_fp8_amax
            if shared.get("key") != key:
                shared["key"] = key
                shared["amax"] = torch.stack([amax_of(m.weight.detach()) for m in group]).amax()
            amax = shared["amax"]
        wq, sw = quantise_weight(self.weight.detach(), spec, amax)
        if spec.activation is None:  # Marlin keeps the scale in the model's dtype (marlin_utils_fp8.py)
            sw = sw.to(self.weight.dtype).float()
        self._pc_fp8_w = (wq, sw)
        # the image laid out once for oneDNN on a CPU (`use_fp8`; the engine and the scorer alike)
        packs = getattr(self, "_pc_fp8_pack", False) and spec.weight != "block" and self.weight.device.type == "cpu"
        self._pc_fp8_packed = pack_weight(self._pc_fp8_w[0]) if packs else None
        self._pc_fp8_key = key
    wq, sw = self._pc_fp8_w
    spec = self._pc_fp8_spec
    tokens = _shared_tokens(self, x) if spec.activation == "token" else None
    order = getattr(self, "_pc_fp8_order", "kernel")
    packed = {"kernel": self._pc_fp8_packed, "linear": None, "halves": HALVES}[order]
    return fp8_linear(x, spec, wq, sw, self.bias, self.weight.dtype, packed=packed, tokens=tokens)


def set_sum_order(model: nn.Module, order: str) -> None:
    """Sum every FP8 Linear's exact E4M3 products in `order` (SUM_ORDERS), in place: the same quantised values, only
    the fp32 additions in another order (a block recipe's blocks last to first for 'halves')."""
    for m in model.modules():
        if is_fp8(m):
            m._pc_fp8_order = order


def use_fp8(model: nn.Module, quant: str, skip: set[int], recipe: str) -> int:
    """Route the Linears an FP8 engine quantises through `_fp8_forward` under `quant` (in place); returns how many.
    Raises Fp8Error for a model the recipe cannot serve."""
    spec = LINEAR_QUANTS[quant]
    check_no_experts(model, recipe)
    if spec.weight == "block":
        check_blocks(model, skip, recipe)
    linears = quantised_linears(model, skip)
    by_parent: dict[str, dict[str, nn.Linear]] = {}
    for name, m in linears.items():
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = m
    import types

    amax_caches: dict[tuple, dict] = {}
    for name, m in linears.items():
        parent, _, leaf = name.rpartition(".")
        siblings = by_parent[parent]
        fused = next((f for f in FUSED if leaf in f and all(p in siblings for p in f)), (leaf,))
        m._pc_fp8_group = [siblings[p] for p in fused]
        m._pc_fp8_amax = amax_caches.setdefault((parent, fused), {})  # one per merged group: its amax and input
        m._pc_fp8_spec = spec
        m._pc_fp8_key = None
        m._pc_fp8_prev = m.__dict__.get("forward")  # the kernel the recipe chose, for `unquantise`
        m._pc_fp8_pack = onednn_linear()  # oneDNN on the laid-out image: 1.5x F.linear at 512 rows, 4-6x at 16
        m.forward = types.MethodType(_fp8_forward, m)
    return len(linears)


def unquantise(linear: nn.Linear) -> None:
    """Give an FP8 Linear back the forward its recipe chose before `use_fp8` (trace's what-if: this Linear kept in
    the engine's dtype). Its merged siblings keep the scale of the whole group, as they would in vLLM."""
    prev = linear.__dict__.pop("_pc_fp8_prev", None)
    linear.__dict__.pop("forward", None)
    if prev is not None:
        linear.forward = prev
    linear._pc_fp8_spec = None


def is_fp8(linear: nn.Module) -> bool:
    """True if `linear` runs an FP8 engine's forward (`use_fp8`): no other kernel may replace it."""
    return getattr(linear, "_pc_fp8_spec", None) is not None


@functools.cache
def fp8_kv_attention_name(query: bool = False) -> str:
    """Register (once) an attention function that passes keys and values (and with `query`, the query) through FP8
    before PyTorch's SDPA: what a prefill (scoring) computes when the engine stores its cache in FP8. The decode path
    (`decode.StaticDecoder`) quantises what it writes into its cache (and its query) instead."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fp8_kv_sdpa(module, q, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, dequant_kv(q) if query else q, dequant_kv(key), dequant_kv(value),
                                      attention_mask, **kwargs)

    name = "phantomclip_fp8_kvq_sdpa" if query else "phantomclip_fp8_kv_sdpa"
    AttentionInterface.register(name, fp8_kv_sdpa)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_fp8_kv(model: nn.Module, query: bool = False) -> None:
    """Store the model's keys and values in FP8 (in place), and with `query` quantise its queries as an FP8-query
    attention backend does: its attention goes through `fp8_kv_attention_name`, and `model._pc_fp8_kv` (and
    `_pc_fp8_q`) tell the static decoder to do the same."""
    model.set_attn_implementation(fp8_kv_attention_name(query))
    model._pc_fp8_kv = True
    model._pc_fp8_q = query
