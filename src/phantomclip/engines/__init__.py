"""Inference engines: anything that samples completions and reports each sampled token's log-prob. The in-process
engine (local, over its static-cache decode forward: decode), vLLM (vllm, an optional import, with its share of a
shared GPU: vllm_memory), weights pushed K times (drift), and `phantomclip engines`, which compares them on speed
(compare, compare_text). This module is the registry: which engine a job starts, and what each cannot run.

May import: base, precision, models.
"""

from __future__ import annotations

from ..precision.recipes import Recipe, engine_recipe
from .vllm_memory import BesideVllm

ENGINE_KINDS = ("local", "vllm")
"""the engines `diagnose --engine`, `train --engine` and `phantomclip engines` can use."""


def start_engine(kind: str, lm, dtype, matmul: str = "auto", logprobs_mode: str = "raw",
                 max_model_len: int | None = None, seed: int = 0, recipe: Recipe | None = None,
                 weight_sync: bool = False, beside: BesideVllm | None = None):
    """An engine of `kind` on the weights of `lm` (a models.LoadedModel) in `dtype`; vLLM is imported only here.
    `matmul` and `recipe` (default: plain `dtype`; the local engine can keep modules in fp32) apply to the local
    engine; the log-probs mode, context limit, seed, `weight_sync` (allow `load_weights`) and `beside` (what the job
    runs beside vLLM on a shared GPU, which sets vLLM's memory share: vllm_memory.py) to vLLM, which computes in one
    dtype only. Call close() after."""
    recipe = recipe or engine_recipe(dtype)
    if kind == "local":
        from .local import LocalEngine

        return LocalEngine(lm.model, recipe=recipe, matmul=matmul)
    from .vllm import VLLMEngine, VLLMError

    unsupported = cannot_run(kind, recipe, weight_sync)
    if unsupported:
        raise VLLMError(unsupported)
    from ..precision.fp8_vllm import engine_args
    from .vllm_memory import vllm_share

    share = vllm_share(lm.model, recipe.weight_dtype, max_model_len or lm.context_length,
                       beside or BesideVllm(batch_tokens=0, training=False))
    return VLLMEngine.for_model(lm, recipe.weight_dtype, logprobs_mode, max_model_len, seed, weight_sync=weight_sync,
                                gpu_memory_utilization=share, **engine_args(recipe.quant))


def cannot_run(kind: str, recipe: Recipe, weight_sync: bool = False) -> str | None:
    """Why an engine of `kind` cannot compute in `recipe` (None when it can): vLLM runs one dtype throughout, so a
    recipe that keeps modules in fp32 over a lower-precision body (fp32-head) exists only in the local engine; an FP8
    recipe runs where the installed vLLM serves it, and not in a job that loads new weights (`weight_sync`)."""
    if kind == "vllm" and recipe.quant:  # what this vLLM build does with the recipe (found by running it: fp8_vllm)
        from ..precision.fp8_vllm import installed_build, vllm_refusal

        return vllm_refusal(recipe.name, recipe.quant, installed_build(), weight_sync)
    if kind == "vllm" and recipe != engine_recipe(recipe.weight_dtype):
        return (f"the engine recipe {recipe.name!r} keeps modules in fp32 over a lower-precision body, which vLLM "
                "cannot (it runs one dtype): run it with --engine local")
    return None
