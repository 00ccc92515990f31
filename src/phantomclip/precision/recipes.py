"""Precision recipes: how a trainer (or an engine) turns fp32 master weights into a forward pass.

One table, `RECIPES`, defines them all; adding a recipe is one entry. Every recipe starts from the same
fp32 master weights, as a real trainer does, so differences between recipes are differences in numerics only.

Matmul kernels. Low-precision matmuls on GPUs (and CPUs with AMX / AVX512-BF16) take bf16/fp16 inputs,
accumulate in fp32 and round the output once. CPUs without native support (AVX2 only) run PyTorch's bf16
and fp16 matmuls 7-8x slower than fp32. There we *emulate* the same arithmetic: round inputs and weights to
the low dtype, multiply in fp32 (the products of two bf16 or fp16 numbers are exact in fp32), round the
output to the low dtype. Measured on this project's CPU (tests/test_recipes.py): the result differs from
PyTorch's native kernel only by summation order (about 0.01-0.2% of outputs by one ulp), while the
bf16-vs-fp32 gap this tool measures is orders of magnitude larger. `matmul="native"` forces PyTorch's kernels.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..base.errors import PhantomclipError
from ..base.numerics import dtype_name


@dataclass(frozen=True)
class Recipe:
    """One way to run a forward pass from fp32 master weights."""

    name: str
    weight_dtype: torch.dtype
    """dtype the body's parameters are stored in."""
    autocast_dtype: torch.dtype | None = None
    """if set, run the forward under torch.autocast to this dtype (weights stay in `weight_dtype`)."""
    fp32_modules: tuple[str, ...] = ()
    """module roles kept in fp32 with fp32 inputs (see `MODULE_ROLES`): e.g. ('lm_head', 'final_norm')."""
    quant: tuple[str, ...] = ()
    """FP8 quantisers an engine adds around the computation (fp8_layers.FP8_QUANTS): e.g. ('fp8-w8a8', 'fp8-kv')."""
    doc: str = field(default="", compare=False)
    """one line for `--help` and the report."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype the body's matmuls produce."""
        return self.autocast_dtype or self.weight_dtype


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in [
        Recipe("fp32", torch.float32, doc="fp32 weights, fp32 forward (a typical fp32 trainer)"),
        Recipe("bf16", torch.bfloat16, doc="bf16 weights, bf16 forward (a typical engine, or a pure-bf16 trainer)"),
        Recipe("fp16", torch.float16, doc="fp16 weights, fp16 forward (Qi et al. 2025: fp16 on both sides)"),
        Recipe(
            "bf16-autocast",
            torch.float32,
            autocast_dtype=torch.bfloat16,
            doc="fp32 master weights, bf16 autocast forward (TRL with bf16=True)",
        ),
        Recipe(
            "fp32-head",
            torch.bfloat16,
            fp32_modules=("final_norm", "lm_head"),
            doc="bf16 body, final norm and lm_head in fp32 (MiniMax-M1)",
        ),
        # trl 1.16 trl/trainer/grpo_trainer.py (_cast_lm_head_to_fp32) and trainer/utils.py (add_fused_lm_head):
        # the head's weight in fp32, its input hidden state cast to fp32 and its matmul run with autocast off,
        # over a model TRL loads in fp32 (model_init_kwargs dtype defaults to float32) and runs under bf16 autocast.
        Recipe(
            "bf16-autocast-fp32-head",
            torch.float32,
            autocast_dtype=torch.bfloat16,
            fp32_modules=("lm_head",),
            doc="fp32 master weights, bf16 autocast body, lm_head in fp32 outside autocast (TRL bf16=True with "
                "cast_lm_head_to_fp32=True)",
        ),
        Recipe(
            "fp16-autocast",
            torch.float32,
            autocast_dtype=torch.float16,
            doc="fp32 master weights, fp16 autocast forward (TRL with fp16=True; Qi et al. 2025's fp16 training)",
        ),
    ]
}
DEFAULT_TRAINERS = ("fp32", "bf16", "fp16", "bf16-autocast", "fp32-head")
"""the recipes `diagnose` scores when --trainer is not given; the others are the setups a framework's own settings
produce (TRL's cast_lm_head_to_fp32 under bf16 autocast, its fp16 mixed precision), scored when a config selects
them or --trainer names them (each recipe is one more scoring pass)."""


class RecipeError(PhantomclipError):
    """A recipe, dtype or module role that does not exist, or a model it cannot be applied to."""


def get_recipe(name: str) -> Recipe:
    """Look up a recipe by name; the error lists the valid names. 'base+q1+q2' is the recipe `base` with the FP8
    quantisers q1, q2 (`with_quant`), e.g. 'bf16+fp8-w8a8+fp8-kv'."""
    base, *quant = name.split("+")
    if base not in RECIPES:
        raise RecipeError(f"unknown recipe {base!r}: use one of {', '.join(RECIPES)}")
    return with_quant(RECIPES[base], tuple(quant)) if quant else RECIPES[base]


def with_quant(recipe: Recipe, quant: tuple[str, ...]) -> Recipe:
    """`recipe` run by an FP8 engine: the same layout with the quantisers `quant` (precision/fp8.py) around its Linears
    and KV cache, named 'base+q1+q2'. An empty `quant` gives `recipe` back."""
    from .fp8_layers import KV_QUANT, KVQ_QUANT, Fp8Error, check_quants

    if not quant:
        return recipe
    try:
        check_quants(quant)
    except Fp8Error as e:
        raise RecipeError(str(e)) from None
    kv = next((q for q in quant if q in (KV_QUANT, KVQ_QUANT)), None)
    if kv and ATTENTION_FP32 in recipe.fp32_modules:
        raise RecipeError(f"{recipe.name}: {kv} needs the model's own attention, not fp32 attention")
    quant = tuple(dict.fromkeys(recipe.quant + quant))
    return replace(recipe, name="+".join([recipe.name.split("+")[0], *quant]), quant=quant,
                   doc=f"{recipe.doc}, with {' and '.join(quant)}")


def without_quant(recipe: Recipe) -> Recipe:
    """The same recipe without its FP8 quantisers: what β_quant compares an FP8 engine's recipe with."""
    return RECIPES[recipe.name.split("+")[0]] if recipe.quant else recipe


def engine_recipe(dtype: torch.dtype) -> Recipe:
    """The plain recipe an engine of this dtype runs (weights and compute in `dtype`)."""
    return next(r for r in RECIPES.values() if r.weight_dtype == dtype and not r.autocast_dtype and not r.fp32_modules)


class QuantError(RecipeError):
    """An FP8 recipe a model cannot serve (a layer shape the block size does not divide): names recipe and layer."""


# ---------------------------------------------------------------------------------------------- modules


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder without the head (model.model for Llama-style models): its output is the final hidden state."""
    body = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(body, nn.Module):
        raise RecipeError(f"cannot find the decoder body of {type(model).__name__} (no attribute base_model_prefix)")
    return body


def final_norm(model: nn.Module) -> nn.Module:
    """The norm between the last decoder layer and the head (its output is what the head reads)."""
    base = decoder_body(model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    raise RecipeError(f"cannot find the final norm of {type(model).__name__} "
                      f"(looked for norm, final_layernorm, ln_f under {type(base).__name__})")


def lm_head(model: nn.Module) -> nn.Module:
    """The output head (Linear hidden -> vocabulary), possibly tied to the input embeddings."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise RecipeError(f"cannot find the output head of {type(model).__name__} (get_output_embeddings() is None)")
    return head


def _all_norms(model: nn.Module) -> list[nn.Module]:
    """Every normalisation layer (RMSNorm / LayerNorm by class name), the final norm included."""
    return [m for m in model.modules()
            if type(m).__name__.endswith(("RMSNorm", "LayerNorm", "Norm")) and list(m.parameters(recurse=False))]


MODULE_ROLES = {
    "lm_head": lambda m: [lm_head(m)],
    "final_norm": lambda m: [final_norm(m)],
    "norm": _all_norms,
}
"""Role name -> function finding those modules in a Hugging Face causal LM (a recipe keeps them in fp32)."""
ATTENTION_FP32 = "attention_softmax"
"""A role that is not a module: attention scores, softmax and the weighted sum computed in fp32."""


def _cast_output_hook(dtype: torch.dtype):
    def hook(module, args, output):
        return output.to(dtype) if isinstance(output, torch.Tensor) else output

    return hook


@functools.cache
def _fp32_attention_name() -> str:
    """Register (once) an attention function that runs PyTorch's SDPA on fp32 copies of q, k, v."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp32_sdpa(module, query, key, value, attention_mask, **kwargs):
        floating = attention_mask is not None and attention_mask.is_floating_point()
        mask = attention_mask.float() if floating else attention_mask  # an additive float mask joins the fp32 sum
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
        return out.to(query.dtype), weights

    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("phantomclip_fp32_sdpa", fp32_sdpa)
    AttentionMaskInterface.register("phantomclip_fp32_sdpa", sdpa_mask)  # the same causal/padding mask as sdpa
    return "phantomclip_fp32_sdpa"


def _cast_inputs_pre_hook(dtype: torch.dtype):
    def hook(module, args, kwargs):
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


# ------------------------------------------------------------------------------------ matmul kernels


NATIVE_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
"""/proc/cpuinfo flags of the instructions that make a CPU's low-precision matmul fast, per dtype. A CPU with bf16
instructions but none for fp16 runs PyTorch's native fp16 matmul through slow fallback kernels: on an AMD EPYC with
AVX512-BF16 and no AVX512-FP16, a training step of the bundled model took about 110 s with native fp16 kernels
against 6 s with native bf16 (the fp16 arm of `experiment sanity`, 2026-12-01)."""


@functools.cache
def native_low_precision_cpu(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True if this CPU has native matmul instructions for `dtype` (bf16: AMX or AVX512-BF16; fp16: AMX-FP16 or
    AVX512-FP16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return any(flag in flags.split() for flag in NATIVE_CPU_FLAGS.get(dtype, ()))


def resolve_matmul(matmul: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> str:
    """'auto' -> 'native' on CUDA or on a CPU with native `dtype` instructions, else 'emulated'."""
    if matmul not in ("auto", "native", "emulated"):
        raise RecipeError(f"unknown matmul mode {matmul!r}: use auto, native or emulated")
    if matmul != "auto":
        return matmul
    return "native" if torch.device(device).type != "cpu" or native_low_precision_cpu(dtype) else "emulated"


def kernel_name(matmul: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """What a forward in `dtype` runs: 'fp32', else the resolved 'native' or 'emulated' low-precision matmul."""
    return "fp32" if dtype == torch.float32 else resolve_matmul(matmul, device, dtype)


def cpu_description(matmul: str = "auto") -> dict:
    """This CPU's model name, whether it has native bf16 / fp16 matmul instructions, and the kernel `matmul` picks for
    each (diagnose's header and JSON: figures depend on the kernel, so every one names its machine)."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        name = "unknown"
    native = {dtype_name(d): native_low_precision_cpu(d) for d in (torch.bfloat16, torch.float16)}
    kernels = {dtype_name(d): kernel_name(matmul, d) for d in (torch.bfloat16, torch.float16)}
    return {"model": name, "native": native, "kernels": kernels}


def _emulated_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward with low-precision inputs: fp32 products and accumulation, one rounding at the end."""
    device = x.device.type
    low = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
    if low == torch.float32:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
    if torch.is_grad_enabled() and self.weight.requires_grad:
        # Training: the same arithmetic, differentiable (the cast's gradient passes straight through to the
        # fp32 master weight, as in mixed-precision training). No cache: the weight changes every step.
        b32 = None if self.bias is None else self.bias.to(low).float()
        with torch.autocast(device, enabled=False):
            return F.linear(x.to(low).float(), self.weight.to(low).float(), b32).to(low)
    # Inference: cache the fp32 image of the low-precision weight; refresh when the weight is modified in place.
    key = (self.weight.data_ptr(), self.weight._version, low)
    if getattr(self, "_pc_key", None) != key:
        self._pc_w32 = self.weight.detach().to(low).float()
        self._pc_b32 = None if self.bias is None else self.bias.detach().to(low).float()
        self._pc_key = key
    exact = getattr(self, "_pc_exact_weight", None)  # apply_recipe(exact_weights=True): the unrounded fp32 master
    with torch.autocast(device, enabled=False):
        out = F.linear(x.to(low).float(), self._pc_w32 if exact is None else exact, self._pc_b32)  # [..., out] fp32
    return out.to(low)


def use_emulated_matmul(model: nn.Module) -> nn.Module:
    """Route every nn.Linear of `model` through `_emulated_linear_forward` (in place)."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.forward = types.MethodType(_emulated_linear_forward, mod)
    return model


def is_emulated(linear: nn.Module) -> bool:
    """True if `linear` runs the emulated kernel (`use_emulated_matmul`) on its own stored weights, i.e. computes
    round(x) @ image(w) in fp32 and rounds the output: another fp32 product of the same operands is the same kernel
    up to summation order. False for any other forward, and for `apply_recipe(exact_weights=True)`'s Linears."""
    forward = linear.__dict__.get("forward")
    return (getattr(forward, "__func__", None) is _emulated_linear_forward
            and getattr(linear, "_pc_exact_weight", None) is None)


# ------------------------------------------------------------------------------------------ applying


@torch.no_grad()
def apply_recipe(master: nn.Module, recipe: Recipe, matmul: str = "auto", exact_weights: bool = False,
                 device: torch.device | str | None = None) -> nn.Module:
    """A copy of `master` (fp32 weights) laid out for `recipe`; `master` is left untouched.

    Use the result's forward inside `forward_context(recipe)`. `exact_weights=True` keeps the recipe's arithmetic
    (inputs and outputs of every Linear rounded to the low dtype) but multiplies by the unrounded fp32 master
    weights: what is left of a recipe's error once weight rounding is taken out (`phantomclip trace` splits β
    into weights and compute this way). It needs the emulated kernel (native kernels read the stored low-precision
    weights), applies to Linear layers only (embeddings and norms keep the recipe's weights) and to inference
    only (the differentiable path always rounds the weight). `device`: where the copy will run, which decides the
    kernel `matmul='auto'` picks (default: where `master` is; give it for a skeleton on the meta device).
    """
    model = copy.deepcopy(master)
    if recipe.fp32_modules:
        for role in recipe.fp32_modules:
            if role not in MODULE_ROLES and role != ATTENTION_FP32:
                valid = ", ".join([*MODULE_ROLES, ATTENTION_FP32])
                raise RecipeError(f"unknown module role {role!r}: use one of {valid}")
        head = lm_head(model)
        if "lm_head" in recipe.fp32_modules and head.weight is model.get_input_embeddings().weight:
            # Tied embeddings: give the head its own fp32 copy so the embedding can go to bf16 alone.
            head.weight = nn.Parameter(head.weight.detach().clone())
    model.to(recipe.weight_dtype)
    # Buffers such as RoPE's inv_freq stay in fp32, as from_pretrained(dtype=bf16) and vLLM keep them: casting
    # them would add a position-dependent error no real engine or trainer has.
    master_buffers = dict(master.named_buffers())
    for name, buf in model.named_buffers():
        src = master_buffers.get(name)
        if src is not None and src.is_floating_point():
            _set_buffer(model, name, src.clone())
    kept = _keep_fp32(model, master, recipe)
    device = next(model.parameters()).device if device is None else device
    emulated = resolve_matmul(matmul, device, recipe.compute_dtype) == "emulated"
    if emulated:
        use_emulated_matmul(model)
    if recipe.autocast_dtype is not None:
        for mod in kept:  # TRL's fp32 head under autocast: its matmul runs with autocast off (after the kernels)
            _outside_autocast(mod)
    if exact_weights:
        if not emulated:
            raise RecipeError(f"exact_weights needs matmul='emulated' (got {matmul!r}): a native kernel can only "
                              f"multiply by the weights stored in {recipe.weight_dtype}")
        _use_exact_weights(model, master)
    if recipe.quant:
        _use_quant(model, recipe)
    return model.eval()


def _keep_fp32(model: nn.Module, master: nn.Module, recipe: Recipe) -> list[nn.Module]:
    """The modules of `recipe.fp32_modules` (and fp32 attention) in fp32 with fp32 inputs, their master values copied
    back; returns them (a module named by two roles once)."""
    kept: dict[int, tuple[nn.Module, nn.Module]] = {}
    for role in recipe.fp32_modules:
        if role == ATTENTION_FP32:
            model.set_attn_implementation(_fp32_attention_name())
        else:
            kept.update({id(m): (m, src) for m, src in zip(MODULE_ROLES[role](model), MODULE_ROLES[role](master))})
    if kept:
        head, final = lm_head(model), final_norm(model)
        feeds_fp32_head = id(head) in kept
    for mod, src in kept.values():
        # Copy fp32 master values back (the .to() above rounded them) and feed the module fp32 inputs.
        mod.to(torch.float32)
        for p, p_master in zip(mod.parameters(), src.parameters()):
            p.copy_(p_master)
        mod.register_forward_pre_hook(_cast_inputs_pre_hook(torch.float32), with_kwargs=True)
        if mod is not head and not (mod is final and feeds_fp32_head):
            # A module inside the low-precision body hands its fp32-computed output back in the compute dtype.
            mod.register_forward_hook(_cast_output_hook(recipe.compute_dtype))
    return [mod for mod, _ in kept.values()]


def _outside_autocast(module: nn.Module) -> None:
    """Run `module`'s forward with autocast off (its fp32 weights and fp32 inputs then compute in fp32), as TRL runs
    its fp32 head inside a bf16-autocast forward."""
    inner = module.forward

    def forward(*args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        with torch.autocast("cpu" if x is None else x.device.type, enabled=False):
            return inner(*args, **kwargs)

    module.forward = forward


def check_fits(model: nn.Module, names) -> None:
    """Refuse (QuantError, one line naming the recipe and the layer) a recipe of `names` the model's shapes cannot
    serve, right after the model loads: fp8-block on a Linear the 128 x 128 block does not divide is otherwise met
    where the recipe is laid out, after the sampling (diagnose --trainer bf16+fp8-block, trace --recipe). The same
    check apply_recipe makes, with the same LM head left out."""
    from .fp8_layers import LINEAR_QUANTS, Fp8Error, check_blocks

    for name in names:
        recipe = get_recipe(name)
        if any(q in LINEAR_QUANTS and LINEAR_QUANTS[q].weight == "block" for q in recipe.quant):
            try:
                check_blocks(model, {id(lm_head(model))}, recipe.name)
            except Fp8Error as e:
                raise QuantError(str(e)) from None


def _use_quant(model: nn.Module, recipe: Recipe) -> None:
    """Put the recipe's FP8 quantisers in (precision/fp8.py): the engine's Linears but the LM head (and MoE routers),
    and its KV cache. After the kernels are chosen: a quantised Linear runs its own FP8 forward."""
    from .fp8_layers import KV_QUANT, KVQ_QUANT, LINEAR_QUANTS, Fp8Error, use_fp8, use_fp8_kv

    for q in recipe.quant:
        if q in LINEAR_QUANTS:
            try:
                use_fp8(model, q, {id(lm_head(model))}, recipe.name)
            except Fp8Error as e:
                raise QuantError(str(e)) from None
        elif q in (KV_QUANT, KVQ_QUANT):
            use_fp8_kv(model, query=q == KVQ_QUANT)


def _use_exact_weights(model: nn.Module, master: nn.Module) -> None:
    """Give every Linear of `model` (emulated) the fp32 weight of the same-named Linear of `master`."""
    masters = dict(master.named_modules())
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod._pc_exact_weight = masters[name].weight.detach().float()  # [out, in] fp32, not rounded


def _set_buffer(model: nn.Module, dotted: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = dotted.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    owner._buffers[leaf] = value


def forward_context(recipe: Recipe, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager:
    """torch.autocast for autocast recipes, a no-op context otherwise."""
    if recipe.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=recipe.autocast_dtype)


def engine_quants(spec: str) -> tuple[str, ...]:
    """'fp8-w8a8,fp8-kv' -> ('fp8-w8a8', 'fp8-kv'): the FP8 quantisers of --engine-quant (empty: none). A spec of
    separators alone (',', '+') names none though it is not empty: RecipeError, not an engine run without FP8."""
    quant = tuple(q for q in (s.strip() for s in (spec or "").replace("+", ",").split(",")) if q)
    if not quant and (spec or "").strip():
        from .fp8_layers import FP8_QUANTS

        raise RecipeError(f"{spec!r} names no quantiser: give one or more of {', '.join(FP8_QUANTS)}, or leave it "
                          "empty for an engine without FP8")
    return quant
