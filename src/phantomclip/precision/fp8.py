"""FP8 (E4M3) engines emulated on any CPU: vLLM's quantisers and scaled products as pure functions (their Linear and
KV-cache forwards in a model are precision/fp8_layers.py's).

What an FP8 engine does to a forward. vLLM stores a Linear's weight as E4M3 values times a scale, quantises the
Linear's input on the fly, multiplies the two in FP8 with fp32 accumulation and scales the fp32 result back
(`D = scale_a * (scale_b * acc)`), or, on GPUs without FP8 compute, multiplies bf16 inputs by the FP8 weight
(weight-only, Marlin). With `kv_cache_dtype="fp8"` it also stores every key and value as E4M3. Everything else (the
embeddings, the LM head, norms, attention itself, MoE routers) stays in the model's dtype.

How it is emulated here. Each quantiser is quantise -> dequantise around the unchanged computation: the E4M3 values
are computed exactly as vLLM's kernels compute them (the scale rule, the division or the reciprocal multiply, the
saturation at ±448, torch's round-to-nearest-even cast), then multiplied in fp32. A product of two E4M3 values has 8
significant bits, so every product is exact in fp32 and the emulated GEMM differs from the GPU's only by summation
order, as `precision/recipes.py`'s emulated bf16 kernel does. torch's own `_scaled_mm` runs on this CPU (torch 2.13) and
agrees with it (tests/test_fp8.py), but took 18x the time of an fp32 product at 16 rows and 1.6x at 1024 (1536 x 576,
2-core AMD EPYC with AVX512-BF16), so it is not used. On an x86 CPU each E4M3 image is laid out once for oneDNN's fp32
linear (`pack_weight`, what `decode.pack_linears` does for the engine's other Linears), in the engine and the scorer
alike, so both multiply in the same order and agree bit for bit.

Sources (vLLM, the file and the commit read):
- per-tensor dynamic scale (online `quantization="fp8"` weights: `Fp8LinearMethod.process_weights_after_loading`
  calls `ops.scaled_fp8_quant(weight, scale=None)`): scale = amax / 448, q = sat(x * (1 / scale)),
  csrc/quantization/w8a8/fp8/common.cu @096d3dc9 (`segmented_max_reduction_strided`,
  `scaled_fp8_quant_kernel_strided_dynamic`); one scale for a merged layer (q/k/v, gate/up are one Linear in vLLM):
  vllm/model_executor/layers/quantization/fp8.py @0071b24b.
- per-token dynamic activations (what that `Fp8LinearOp` uses where CUTLASS runs, `use_per_token_if_dynamic`):
  scale = max(amax_row / 448, 1 / (448 * 512)), q = sat(x / scale): common.cu @096d3dc9
  (`dynamic_per_token_scaled_fp8_quant_kernel_strided`), the floor also in input_quant_fp8.py @014af6b5
  (`_FP8_MIN_SCALING_FACTOR`), so an all-zero row gives zeros, not NaN.
- the GEMM epilogue: D = scale_a * (scale_b * acc), rounded once to the output dtype:
  csrc/cutlass_extensions/epilogue/scaled_mm_epilogues_c3x.hpp (`ScaledEpilogue`).
- block-quantised weights (DeepSeek-V3-style checkpoints, `weight_block_size=[128, 128]`): per 128 x 128 block,
  amax clamped to 1e-4, scale = amax / 448 and q = x * (1 / scale), as vLLM 0.32.0 writes it (vllm/utils/deep_gemm.py
  of the 0.32.0 release, `per_block_cast_to_fp8`: `sf = x_amax / fp8_max`, `(x_view * (1.0 / sf)).to(fp8_dtype)`;
  the older x * (448 / amax) of @779d1fc1 rounds some values one E4M3 step apart); activations in 1 x 128 groups:
  scale = max(amax, 1e-10) / 448, q = sat(x / scale):
  csrc/quantization/w8a8/fp8/per_token_group_quant.cu @0f5257e2; the product accumulates block by block,
  `acc += dot(a, b) * a_s * b_s`: vllm/model_executor/layers/quantization/utils/fp8_utils.py @364d0192 (the Triton
  `w8a8_block_fp8_matmul`). vLLM's group quantiser needs K % 128 == 0 and merged layers need every part's rows
  % 128 == 0 (vLLM's fp8.py `create_weights`): a model that breaks either is refused (`check_blocks`).
- weight-only FP8 (W8A16, GPUs below compute capability 8.9: `use_marlin` in vLLM's fp8.py @0071b24b): the same
  per-tensor weight, bf16 activations; Marlin keeps the scale in the model's dtype (`prepare_fp8_layer_for_marlin`:
  `layer.weight_scale.to(layer.orig_dtype)`, vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py
  @02d33ed1), so the scale is amax / 448 rounded to bf16 here; it is applied to the fp32 accumulator (Marlin's
  channel-wise path; where in the kernel is assumed, not read).
- the FP8 KV cache: every key (after RoPE) and value stored as sat(x / scale) in E4M3 and read back as e4m3 * scale,
  csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh @0492a439 (`scaled_vec_conversion`, `__NV_SATFINITE`); the scale
  is 1.0 unless the checkpoint carries k/v scales: vllm/model_executor/layers/quantization/kv_cache.py @0531c222
  (`process_weights_after_loading`). Queries stay in the model's dtype, unless the engine's attention backend takes an
  FP8 query (FlashAttention 3, FlashInfer: `supports_quant_query_input`): vLLM 0.32.0 then quantises the query
  statically with its q scale, 1.0 by default (vllm/model_executor/layers/attention/attention.py of the 0.32.0
  release, `Attention.forward`: `query, _ = self.query_quant(query, self._q_scale)`). `fp8-kvq` emulates that backend:
  the FP8 KV cache and the query quantised the same way.
- which layers are quantised: every `LinearBase` (vLLM's fp8.py `get_quant_method`); the LM head is a
  `VocabParallelEmbedding`, and MoE routers are built with `quant_config=None`, so both stay unquantised. vLLM also
  quantises an MoE model's experts (`Fp8MoEMethod`, one scale per expert, the fused kernels' activations quantised
  over the batch); transformers 5 keeps each MoE layer's experts as 3-D tensors, not Linears, which this module does
  not emulate: an FP8 Linear recipe on a model with them is refused (`check_no_experts`) rather than left with bf16
  experts without a word.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""the largest finite E4M3 value (torch.finfo(torch.float8_e4m3fn).max)."""
MIN_SCALING_FACTOR = 1.0 / (E4M3_MAX * 512.0)
"""vLLM's floor on a per-token scale: a row of zeros gets this scale and quantises to zeros."""
GROUP_EPS = 1e-10
"""vLLM's floor on a 1 x 128 group's amax (per_token_group_quant_fp8's eps)."""
BLOCK_AMAX_FLOOR = 1e-4
"""the floor on a 128 x 128 weight block's amax (per_block_cast_to_fp8)."""
BLOCK = 128
"""the block edge of block quantisation (weights 128 x 128, activations 1 x 128)."""


# -------------------------------------------------------------------------------------------- quantisers


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 x -> E4M3, saturating at ±448 (`__NV_SATFINITE`), rounding to nearest even (torch's cast). The clamp
    makes saturation independent of torch's version (older casts turned overflow into NaN); NaN stays NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _to_e4m3_(t: torch.Tensor) -> torch.Tensor:
    """`to_e4m3` saturating in place: for a temporary the quantiser just made (one fp32 buffer fewer per call, the
    same values)."""
    return t.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def amax_of(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32, over all of x or along `dim` (kept): taken in x's own dtype, where abs and max are exact, so
    a bf16 x is read once at 2 bytes a value instead of widened to an fp32 copy first."""
    a = x.abs()
    return (a.amax() if dim is None else a.amax(dim, keepdim=True)).float()


def quant_tensor(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor quantisation: (q E4M3 like x, scale [] fp32) with scale = amax / 448 and q = sat(x * (1 /
    scale)). `amax`: the amax to use (a merged layer's, over all its parts). An all-zero tensor has scale 0; vLLM's
    kernel then computes 0 * inf = NaN, which its clamp turns into 448, and 448 * 0 dequantises to 0: here q = 0
    directly, the same dequantised zeros."""
    amax = amax_of(x) if amax is None else amax.float()
    scale = amax / E4M3_MAX  # [] fp32
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    # inv as [1], not []: a 0-dim fp32 tensor would not promote a bf16 x (torch treats it like a Python scalar), so
    # the product would be rounded to bf16; as [1] x is widened to fp32 inside the multiply, the values of
    # x.float() * inv without the separate fp32 copy of x
    return _to_e4m3_(x * inv.reshape(1)), scale


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) quantisation of x [..., K]: (q, scale [..., 1]) with scale = max(amax_row / 448,
    1 / (448 * 512)) and q = sat(x / scale). Per channel, a weight [N, K] is quantised row by row the same way."""
    scale = (amax_of(x, -1) / E4M3_MAX).clamp_min(MIN_SCALING_FACTOR)  # [..., 1] fp32
    return _to_e4m3_(x / scale), scale  # a bf16 x is widened to fp32 inside the division (scale is [..., 1] fp32)


def quant_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic 1 x `group` quantisation of x [..., K] (K % group == 0): (q [..., K], scale [..., K / group]) with
    scale = max(amax_group, 1e-10) / 448 and q = sat(x / scale)."""
    x32 = x.float()
    g = x32.unflatten(-1, (-1, group))  # [..., K/group, group]
    scale = g.abs().amax(-1, keepdim=True).clamp_min(GROUP_EPS) / E4M3_MAX  # [..., K/group, 1]
    return _to_e4m3_(g / scale).flatten(-2), scale.squeeze(-1)


def quant_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 block quantisation of a weight w [N, K] (both divisible by `block`): (q [N, K], scale [N / block,
    K / block]) with amax clamped to 1e-4, scale = amax / 448 and q = x * (1 / scale), vLLM 0.32.0's order: the
    reciprocal of the rounded scale, then the product (x * (448 / amax) rounds another way on some values)."""
    N, K = w.shape
    v = w.float().reshape(N // block, block, K // block, block)  # [Nb, block, Kb, block]
    amax = v.abs().amax(dim=(1, 3), keepdim=True).clamp_min(BLOCK_AMAX_FLOOR)  # [Nb, 1, Kb, 1]
    scale = amax / E4M3_MAX  # [Nb, 1, Kb, 1] fp32
    q = _to_e4m3_(v * (1.0 / scale)).reshape(N, K)
    return q, scale.reshape(N // block, K // block)


def dequant_kv(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """A key or value through the FP8 KV cache: stored as sat(x / scale) in E4M3, read back as e4m3 * scale, in x's
    dtype. With scale 1.0 (vLLM's default) this is elementwise and idempotent, so a cache read twice is the same."""
    return (_to_e4m3_(x.float() / scale).float() * scale).to(x.dtype)


# ------------------------------------------------------------------------------------------------ GEMMs


HALVES = "halves"
"""`packed` for another valid fp32 summation order: K in two halves, each summed by F.linear, then added (the
what-if's order noise, SUM_ORDERS)."""
SUM_ORDERS = ("kernel", "linear", "halves")
"""the fp32 summation orders an FP8 Linear can sum its exact E4M3 products in (`set_sum_order`): the recipe's kernel
(oneDNN on the laid-out image where it exists), plain F.linear, and K in two halves. A GPU's FP8 kernel has an order
of its own; the spread over these three is the emulation's estimate of how much a figure hangs on it."""


def product(x: torch.Tensor, wq: torch.Tensor, packed: torch.Tensor | str | None = None) -> torch.Tensor:
    """fp32 [M, N] = x @ wq^T with fp32 accumulation: F.linear, or oneDNN on `packed`, wq's fp32 image laid out once
    (`pack_weight`; the engine's layout, as `decode.pack_linears` gives its other Linears: another summation order),
    or with `packed` = HALVES the two halves of K summed apart and added (a third order)."""
    if packed is None:
        return F.linear(x.float(), wq.float())
    if isinstance(packed, str):
        half = x.shape[-1] // 2
        return F.linear(x[:, :half].float(), wq[:, :half].float()).add_(F.linear(x[:, half:].float(),
                                                                                  wq[:, half:].float()))
    return torch.ops.mkldnn._linear_pointwise(x.float(), packed, None, "none", [], "")


@functools.cache
def onednn_linear() -> bool:
    """True where oneDNN's fp32 linear on a weight laid out once exists: an x86 CPU with PyTorch's mkldnn (the test
    `decode.can_pack(torch.float32)` makes)."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


def pack_weight(wq: torch.Tensor) -> torch.Tensor:
    """wq's fp32 image laid out once for oneDNN's linear (x86 CPUs with mkldnn: `decode.can_pack`)."""
    return torch.ops.mkldnn._reorder_linear_weight(wq.float(), 16)


def scaled_product(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                   packed: torch.Tensor | str | None = None) -> torch.Tensor:
    """fp32 [M, N] = sx * (sw * (xq @ wq^T)): E4M3 xq [M, K] and wq [N, K] multiplied exactly with fp32 accumulation,
    then the CUTLASS epilogue's two scalings in its order. sx [M, 1] or [], sw [1, N] or []."""
    # in place on the product's fresh fp32 buffer: sw * acc, then sx * that (each product rounded once, as before)
    return product(xq, wq, packed).mul_(sw).mul_(sx)  # [M, N]


def block_product(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                  block: int = BLOCK, reverse: bool = False) -> torch.Tensor:
    """fp32 [M, N] = Σ_k (xq_k @ wq_k^T) * sx_k * sw_k over the K / block blocks, as the Triton block kernel
    accumulates (`reverse`: the last block first, another order). xq [M, K], sx [M, K/block], wq [N, K],
    sw [N/block, K/block]."""
    x3 = xq.float().unflatten(-1, (-1, block)).transpose(0, 1)  # [Kb, M, block]
    w3 = wq.float().unflatten(-1, (-1, block)).transpose(0, 1)  # [Kb, N, block]
    parts = torch.bmm(x3, w3.transpose(1, 2))  # [Kb, M, N] fp32, one block's products each
    sw_cols = sw.repeat_interleave(block, dim=0)[: wq.shape[0]].T  # [Kb, N]
    scaled = parts * sx.T[:, :, None] * sw_cols[:, None, :]  # [Kb, M, N]
    scaled = scaled.flip(0) if reverse else scaled
    out = scaled[0]
    for k in range(1, scaled.shape[0]):  # the kernel's order: block 0, then 1, ...
        out = out + scaled[k]
    return out
