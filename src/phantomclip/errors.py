"""The one base class of every expected failure: bad input that the command line reports as one line, exit 2.

Each module raises its own subclass (ModelError, PromptError, ...), so a caller can catch one kind, and the CLI
catches them all through `PhantomclipError` instead of listing them by hand.
"""

from __future__ import annotations

import os
from pathlib import Path


class PhantomclipError(ValueError):
    """A failure caused by the user's input, with a message written for the user (what is wrong, what to do)."""


class ConfigError(PhantomclipError):
    """A command's configuration that cannot run (bad value, unknown name, unwritable output)."""


def check_output_path(path: str | Path, flag: str = "--json") -> None:
    """Fail before a long run, not after it, when `path` cannot be written."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory: give a file path such as {path / 'out.json'}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot write under {parent}: choose a writable location")
