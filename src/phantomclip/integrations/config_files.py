"""Reading a trainer's YAML config for `diagnose --from-trl-config` and `--from-verl-config`: the one loader and the
one number check both readers use, so a bad file gets the same one-line answer from either."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError, check_number
from ..files import InputError, json_reason, read_input


def read_mapping(config: str | Path | dict, flag: str, holds: str) -> dict:
    """The YAML file's top-level mapping (a dict is taken as it is). ConfigError, one line naming `flag`, when the
    file cannot be read, is not text, is not YAML, or does not hold a mapping (`holds` says of what)."""
    if isinstance(config, dict):
        return config
    import yaml

    path = Path(config)
    try:
        doc = yaml.safe_load(read_input(path))
    except InputError as e:  # a FIFO or device (never read: it may never end), too large, unreadable, not text
        raise ConfigError(f"{flag} {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag} {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:  # a document nested thousands deep overflows the parser's stack
        raise ConfigError(f"{flag} {path}: nested too deep to be a trainer config (thousands of levels): give the "
                          "trainer's YAML or JSON config") from None
    except ValueError as e:  # not the parser's: int()'s digit limit on a number of thousands of digits
        raise ConfigError(f"{flag} {path}: not a trainer config ({json_reason(e)})") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of {holds} at the top level, found {type(doc).__name__}")
    return doc


TRAINER_NOTE = "your trainer recipe is "
"""how both readers' note on the trainer recipe they read begins: the CLI leaves it out when --trainer was typed."""


def trainer_note(recipe: str, where: str) -> str:
    """The note naming the trainer recipe a reader took from the config (`where`: the keys it read)."""
    return (f"{TRAINER_NOTE}{recipe} (from {where}), first row; the other recipes are measured too, to say what to "
            "change")


SAMPLING = (("temperature", float, {"low": 0, "low_open": True}),
            ("top_p", float, {"low": 0, "low_open": True, "high": 1}), ("top_k", int, {"low": -1}))
"""the sampling settings both readers take: (key, type, `number`'s bounds); top_k −1 is vLLM's and verl's 'off'."""


def number(flag: str, key: str, value, cast=float, low: float | None = None, low_open: bool = False,
           high: float | None = None):
    """A config value as a finite number (cast=int: a whole number) in [low, high] (low excluded if low_open), else
    ConfigError naming the key: a boolean, a fraction where a count belongs, or an out-of-range value is refused
    here, in the config's words, not later under a flag the user never typed."""
    if isinstance(value, bool):  # int(True) is 1: YAML's `true` is no length
        raise ConfigError(f"{flag}: {key} is {value!r}, not a number")
    try:
        out = cast(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{flag}: {key} is {value!r}, not a number") from None
    if cast is int and isinstance(value, float) and value != out:
        raise ConfigError(f"{flag}: {key} is {value!r}, not a whole number")
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{flag}: {key} is {value!r}, not a finite number")
    check_number(f"{flag}: {key}", out, low, high, low_open=low_open, integer=cast is int)
    return out


@contextmanager
def naming_file(flag: str, config) -> Iterator[None]:
    """A ConfigError of a reader ('--from-trl-config: key ...') names the file it read, when it read one."""
    try:
        yield
    except ConfigError as e:
        text = str(e)
        if isinstance(config, (str, Path)) and text.startswith(f"{flag}: "):
            raise ConfigError(f"{flag} {config}: {text.removeprefix(flag + ': ')}") from None
        raise
