"""Inference engines other than the in-process `phantomclip.engine.LocalEngine`; each is an optional import."""
