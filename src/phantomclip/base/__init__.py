"""The shared leaf every job stands on: one error type and its one-line message, files that are never half-written,
the directories phantomclip owns and their lock, the console (progress, Ctrl-C, the error line), devices, and
floating-point facts (dtype names, rounding, spacing).

May import: nothing (the package root only).
"""
