"""Inference engines other than the in-process `phantomclip.engine.LocalEngine`; each is an optional import."""

from __future__ import annotations

ENGINE_KINDS = ("local", "vllm")
"""the engines `diagnose --engine` and `phantomclip engines` can use."""


def start_engine(kind: str, lm, dtype, matmul: str = "auto", logprobs_mode: str = "raw",
                 max_model_len: int | None = None, seed: int = 0):
    """An engine of `kind` on the weights of `lm` (a models.LoadedModel) in `dtype`; vLLM is imported only here.
    `matmul` applies to the local engine, the log-probs mode, context limit and seed to vLLM. Call close() after."""
    if kind == "local":
        from ..engine import LocalEngine

        return LocalEngine(lm.model, dtype, matmul=matmul)
    from .vllm import VLLMEngine

    return VLLMEngine.for_model(lm, dtype, logprobs_mode, max_model_len, seed)
