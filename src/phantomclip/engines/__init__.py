"""Inference engines other than the in-process `phantomclip.engine.LocalEngine`; each is an optional import."""

ENGINE_KINDS = ("local", "vllm")
"""the engines `diagnose --engine` and `phantomclip engines` can use."""
