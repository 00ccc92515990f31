"""Reading a trainer's YAML config for `diagnose --from-trl-config` and `--from-verl-config`: the one loader and the
one number check both readers use, so a bad file gets the same one-line answer from either."""

from __future__ import annotations

import math
from pathlib import Path

from ..errors import ConfigError


def read_mapping(config: str | Path | dict, flag: str, holds: str) -> dict:
    """The YAML file's top-level mapping (a dict is taken as it is). ConfigError, one line naming `flag`, when the
    file cannot be read, is not text, is not YAML, or does not hold a mapping (`holds` says of what)."""
    if isinstance(config, dict):
        return config
    import yaml

    path = Path(config)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path}: not a text file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of {holds} at the top level, found {type(doc).__name__}")
    return doc


def number(flag: str, key: str, value, cast=float):
    """A config value as a finite number (or int), else ConfigError naming the key."""
    try:
        out = cast(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{flag}: {key} is {value!r}, not a number") from None
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{flag}: {key} is {value!r}, not a finite number")
    return out
