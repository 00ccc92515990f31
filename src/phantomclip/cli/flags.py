"""A job's config dataclass as command-line flags (one --flag per field, its docstring as help, and back), and the
parser's own rules: usage errors as one line, a flag given once and never empty, names printed whatever their bytes."""

from __future__ import annotations

import argparse
import sys


def field_docs(cls) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string under each field), read from its source."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                    defaults: dict | None = None, knobs: dict[str, str] | None = None) -> None:
    """One --flag per dataclass field, typed from its default, with the field's docstring as help; a field named in
    `knobs` (a config's KNOB_FIELDS) adds its loss.KNOBS range, the same in every command. `defaults` overrides
    some fields' defaults for this command."""
    import dataclasses

    from ..maths.loss import KNOBS

    docs = field_docs(cls)
    for name, knob in (knobs or {}).items():
        docs[name] = f"{docs.get(name, KNOBS[knob].help).rstrip('.')}; {KNOBS[knob].range_text()}"
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = (defaults or {}).get(f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        # list fields take comma-separated values (the config's __post_init__ splits them)
        if isinstance(default, list):
            default = ",".join(map(str, default))
        help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        if isinstance(default, bool):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help_text)
        elif isinstance(default, (int, float)):
            parser.add_argument(flag, type=type(default), default=default, help=help_text)
        elif "float" in str(f.type):
            parser.add_argument(flag, type=float, default=default, help=help_text)
        elif str(f.type).replace(" ", "") == "int|None":  # a whole number or unset: typed as int, not as its None
            parser.add_argument(flag, type=int, default=default, help=help_text)
        else:
            parser.add_argument(flag, default=default, help=help_text)


def config_from_args(cls, args, **overrides):
    """The config dataclass `cls` from parsed flags (its fields' names), with `overrides` applied."""
    import dataclasses

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def typed_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The fields (dests) of the options typed in `argv`, an abbreviation argparse accepts included: what a config
    file must not override."""
    options = {o: a.dest for a in parser._actions for o in a.option_strings if o.startswith("--")}
    typed = set()
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        matches = [name] if name in options else [o for o in options if o.startswith(name)]
        if len(matches) == 1:
            typed.add(options[matches[0]])
    return typed


EXIT_USAGE = 2
"""the exit status of bad input: a usage error, a bad value, a file that cannot be used."""


def say(line: str, stream=None) -> None:
    """Print a line naming paths (files.shown: a name that is not UTF-8 shown as \\xNN, a newline or other control
    character in it as \\xNN too, so the line stays one line)."""
    from ..base.files import shown

    print(shown(line), file=stream or sys.stdout)


class StoreOnce(argparse.Action):
    """argparse's plain store, refusing what a shell makes of a slip: an empty value (an unset variable in
    `--json "$OUT"` was silently the default) and a single-value flag given twice (the first was silently dropped)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("flags_given", set())
        if self.dest in given:
            parser.error(f"{option_string} is given twice: give it once (a flag of several values takes them "
                         "after one flag)")
        if any(isinstance(v, str) and not v.strip() for v in (values if isinstance(values, list) else [values])):
            parser.error(f"{option_string} is empty: give a value, or drop {option_string} for its default")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors (a bad flag value, an unknown flag) as one line on stderr, exit 2, like every other
    bad input (argparse prints the whole usage block first). Every flag that stores one value is a StoreOnce: the
    rule is registered once here, for every command's parser and group, not flag by flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def _print_message(self, message: str, file=None) -> None:
        """argparse's print of --help, --version and its errors, without its `except OSError: pass`: a stdout that
        cannot be written (a full disk, /dev/full) is the CLI's to say on stderr (cli.main), never an exit 0 with
        nothing written. A stderr that cannot be written has nowhere to say it: its error keeps its own exit status."""
        file = file or sys.stderr
        try:
            if message:
                file.write(message)
        except OSError:
            if file is sys.stdout:
                raise


def names_never_fail_the_streams() -> None:
    """A path whose name is not UTF-8 (Python holds its bytes as lone surrogates) is printed, not a
    UnicodeEncodeError: stdout and stderr write what they cannot encode as a backslash escape (files.printable
    spells names in the messages themselves the same way)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError):  # a captured or replaced stream (tests, pipes set up by a caller)
            pass
