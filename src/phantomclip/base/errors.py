"""The one base class of every expected failure: bad input that the command line reports as one line, exit 2.

Each module raises its own subclass (ModelError, PromptError, ...), so a caller can catch one kind, and the CLI
catches them all through `PhantomclipError` instead of listing them by hand.
"""

from __future__ import annotations

import math


class PhantomclipError(ValueError):
    """A failure caused by the user's input, with a message written for the user (what is wrong, what to do)."""


class ConfigError(PhantomclipError):
    """A command's configuration that cannot run (bad value, unknown name, unwritable output)."""


class IntegrationError(PhantomclipError):
    """A TRL version, trainer class, sharding or model setting the TRL integration cannot work with."""


class WriteError(PhantomclipError):
    """A file that could not be written (read-only directory, full disk): the path and the system's reason."""


class PhantomclipWarning(UserWarning):
    """Something the user should know that does not stop the command (a torn last line skipped); the CLI prints it as
    one line on stderr."""


SEED_LIMIT = 2**32
"""seeds are in [0, 2^32), NumPy's range, the one users know. The streams derived from a seed stay far inside what
torch.Generator accepts (< 2^64): the trainer's seed · 7919 + step and seed · 1_000_003 + step are below 2^53."""


def check_number(flag: str, value, low: float | None = None, high: float | None = None, low_open: bool = False,
                 integer: bool = False, error: type[PhantomclipError] = ConfigError, high_open: bool = False) -> None:
    """Refuse a flag's value outside [low, high] (low excluded if low_open, high if high_open), or not finite, or
    (integer) not a whole number, with one line naming the flag and the range: the one rule every command's config
    validates with."""
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        kind = "a whole number" if integer else "a finite number"
        show = lambda v: str(v) if isinstance(v, int) else f"{v:g}"  # noqa: E731 (a seed's limit stays exact)
        lo = "" if low is None else f"{'>' if low_open else '>='} {show(low)}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {show(high)}"
        bounds = " and ".join(b for b in (lo, hi) if b)
        raise error(f"{flag} must be {kind}{' ' + bounds if bounds else ''}, got {value!r}")


def brief(value, width: int = 60) -> str:
    """`value` as a message shows a value the user gave: its repr, at most `width` characters ('...' where cut).
    reprlib's bounded repr: a list of a million items or a structure nested a thousand deep costs a few elements'
    work, never the whole value's (a YAML alias expanding to 9^6 leaves was a 3.8 MB 'one-line' error)."""
    import reprlib

    cut = reprlib.Repr()  # Python 3.11's Repr takes its limits as attributes, not arguments
    cut.maxlevel, cut.maxdict = 3, 4
    cut.maxtuple = cut.maxlist = cut.maxarray = cut.maxset = cut.maxfrozenset = cut.maxdeque = 6
    cut.maxstring = cut.maxlong = cut.maxother = width
    try:
        shown = cut.repr(value)
    except ValueError:  # int()'s digit limit: an integer of thousands of digits has no repr
        shown = "a value too long to print"
    return shown if len(shown) <= width else shown[: width - 3] + "..."


def check_seed(flag: str, value, error: type[PhantomclipError] = ConfigError) -> None:
    check_number(flag, value, 0, SEED_LIMIT - 1, integer=True, error=error)


FIELD_KINDS = {"str": ((str,), "a string"), "int": ((int,), "a whole number"), "float": ((int, float), "a number"),
               "bool": ((bool,), "true or false"), "None": ((type(None),), "None"),
               "list[str]": ((list,), "a list of names (or one comma-separated string)")}
"""a config field's annotation part -> the Python types a value of it may have (an int is a float's value too), and
how the error line says it."""


def check_field_types(cfg, error: type[PhantomclipError] = ConfigError) -> None:
    """Refuse a config field whose value is not of its annotated type (TrainConfig(steps="3"), trainer=5), with one
    line naming the flag: an API user gets the CLI's one-line answer, not a TypeError from deep inside validate. A
    bool is no number, and a list must hold strings."""
    import dataclasses

    for f in dataclasses.fields(cfg):
        value, parts = getattr(cfg, f.name), [p.strip() for p in str(f.type).split("|")]
        ok = any(isinstance(value, FIELD_KINDS[p][0] if p in FIELD_KINDS else object)
                 and not (isinstance(value, bool) and p != "bool") for p in parts)
        if ok and isinstance(value, list):
            ok = all(isinstance(v, str) for v in value)
        if not ok:
            want = " or ".join(FIELD_KINDS[p][1] if p in FIELD_KINDS else p for p in parts)
            raise error(f"--{f.name.replace('_', '-')} must be {want}, got {value!r}")


def ascii_digits(text: str) -> bool:
    """Whether `text` is one or more of the digits 0-9: the test before int() on a part of a name or key. str.isdigit
    also takes '²' and other digits int() refuses (a ValueError traceback in --device cuda:², --fail-if x.²>0, a
    snapshot named step-².safetensors)."""
    return text.isascii() and text.isdigit()


LENGTH_LIMIT = 2**24
"""the most tokens a completion length may be (--max-tokens, --knob-length, a config's max_completion_length or
max_response_length): 16,777,216, past any released model's context, and the knob advice's float64 lag vector of
that length is 134 MB; a larger value was an allocator traceback after the whole measurement."""
STEPS_LIMIT = 100_000
"""the most steps a run may have: every step's prompts are drawn before the first step (about 30 µs a step on this
project's 2-core CPU), so 10**12 steps printed nothing for minutes; 100,000 is 3 s of that and days of training."""
SEEDS_LIMIT = 1_000
"""the most seeds an experiment may run per arm (10**8 built its run list for minutes before the first run)."""
GROUP_LIMIT = 2**16
"""the most completions per prompt (--group-size): 65,536, past any GRPO recipe's (TRL's default 8, DAPO's 16); a
group of 10^10 ran past 120 s printing nothing."""
BATCH_ROWS_LIMIT = 2**20
"""the most rows a step samples (--prompts-per-step x --group-size), and the most sequences diagnose samples (--n,
--batch-size): 1,048,576, whatever the memory says after (diagnose --n 10^9 built its prompt list for minutes)."""
DRAWS_LIMIT = 10**7
"""the most prompt draws a run makes before its first step (--steps x --prompts-per-step: each step's prompts are
drawn up front, about 0.4 µs a draw on this project's 2-core CPU, so 10^7 is about 4 s)."""
