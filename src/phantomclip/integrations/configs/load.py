"""Reading a trainer's YAML config for `diagnose --from-trl-config` and `--from-verl-config`: the one loader and the
one number check both readers use, so a bad file gets the same one-line answer from either."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...base.errors import ConfigError, brief, check_number
from ...base.files import InputError, json_reason, read_input

EXPANSION_LIMIT = 100_000
"""the most values (keys, scalars, lists and mappings) a trainer config may hold once its YAML aliases are expanded.
A real one holds about a thousand (verl's flattened default trainer config, _generated_ppo_trainer.yaml, is about 470
lines of one key and one value each); a 350-byte alias bomb (nine aliases of nine aliases, nine deep) holds 9^9 =
387,420,489, which anything that walks it (a str(), a note, a comparison) takes minutes and gigabytes to expand."""


def read_mapping(config: str | Path | dict, flag: str, holds: str, repeated: list[str] | None = None) -> dict:
    """The YAML file's top-level mapping (a dict is taken as it is). ConfigError, one line naming `flag`, when the
    file cannot be read, is not text, is not YAML, does not hold a mapping (`holds` says of what), or holds aliases
    that expand past EXPANSION_LIMIT values (`yaml_document`). A key given twice in one mapping is refused, or, where
    `repeated` is a list (a reader whose trainer takes the last value, as PyYAML does), named in it."""
    if isinstance(config, dict):
        return config
    path = Path(config)
    try:
        doc, twice = yaml_document(read_input(path))
    except InputError as e:  # a FIFO or device (never read: it may never end), too large, unreadable, not text
        raise ConfigError(f"{flag} {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{flag} {path}: {e}") from None
    except RecursionError:  # a document nested thousands deep overflows the parser's stack
        raise ConfigError(f"{flag} {path}: nested too deep to be a trainer config (thousands of levels): give the "
                          "trainer's YAML or JSON config") from None
    except ValueError as e:  # not the parser's: int()'s digit limit on a number of thousands of digits
        raise ConfigError(f"{flag} {path}: not a trainer config ({json_reason(e)})") from None
    if twice and repeated is None:
        raise ConfigError(f"{flag} {path}: {twice[0]}: give each key once")
    if repeated is not None:
        repeated.extend(twice)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of {holds} at the top level, found {type(doc).__name__}")
    return doc


def yaml_document(text: str) -> tuple[object, list[str]]:
    """The one YAML document in `text`, read with PyYAML's safe constructors (plain data, no code), and the keys
    given twice in one mapping ('key data given twice (lines 1 and 4)'; PyYAML keeps the last). Aliases are read as
    they are composed, before any value is built: a document whose aliases would expand past EXPANSION_LIMIT values is
    a ConfigError naming the alias, in well under a second. YAMLError becomes ConfigError too (its first line). The
    loader any reader of a user's YAML file should use."""
    import yaml

    sizes: dict[int, int] = {}
    twice: list[str] = []
    last_alias: list[yaml.Event] = []

    class Bounded(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                last_alias[:] = [self.peek_event()]
            node = super().compose_node(parent, index)
            if id(node) not in sizes:  # an alias is its anchor's node, sized when it was composed
                sizes[id(node)] = _expanded_size(node, sizes, twice)
            if sizes[id(node)] > EXPANSION_LIMIT:
                alias = last_alias[0] if last_alias else None
                name = f"the alias *{alias.anchor} (line {alias.start_mark.line + 1})" if alias else "its aliases"
                raise ConfigError(f"{name} expands to more than {EXPANSION_LIMIT:,} values (an alias bomb, not a "
                                  "trainer config): write the values out")
            return node

    try:
        return yaml.load(text, Loader=Bounded), twice  # noqa: S506 (Bounded is a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML ({str(e).splitlines()[0]})") from None


def _expanded_size(node, sizes: dict[int, int], twice: list[str]) -> int:
    """How many values `node` holds with its aliases expanded (its children are sized already: composition is bottom
    up); a mapping's keys given twice are added to `twice`."""
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return 1 + sum(sizes[id(child)] for child in node.value)
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if key.value in seen:
                    twice.append(f"key {brief(key.value)} given twice (lines {seen[key.value]} and {line})")
                seen.setdefault(key.value, line)
        return 1 + sum(sizes[id(k)] + sizes[id(v)] for k, v in node.value)
    return 1


TRAINER_NOTE = "your trainer recipe is "
"""how both readers' note on the trainer recipe they read begins: the CLI leaves it out when --trainer was typed."""


def trainer_note(recipe: str, where: str) -> str:
    """The note naming the trainer recipe a reader took from the config (`where`: the keys it read)."""
    return (f"{TRAINER_NOTE}{recipe} (from {where}), first row; the other recipes are measured too, to say what to "
            "change")


SAMPLING = (("temperature", float, {"low": 0, "low_open": True}),
            ("top_p", float, {"low": 0, "low_open": True, "high": 1}), ("top_k", int, {"low": -1}))
"""the sampling settings both readers take: (key, type, `number`'s bounds); top_k −1 is vLLM's and verl's 'off'."""


NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|infinity|nan)", re.IGNORECASE)
"""a number written as a string, as a trainer config reads one (Python's float() also takes '1_5' for 15)."""


def number(flag: str, key: str, value, cast=float, low: float | None = None, low_open: bool = False,
           high: float | None = None, knob: str | None = None):
    """A config value as a finite number (cast=int: a whole number) in [low, high] (low excluded if low_open), and in
    the range of loss.KNOBS[knob] where the value becomes that knob's setting, else ConfigError naming the key: a
    boolean, a fraction where a count belongs, a string that is not plainly a number ('1_5', which float() reads as
    15), or an out-of-range value is refused here, in the config's words, not later under a flag the user never
    typed (a TRL vllm_importance_sampling_clip_max of -1 was '--seq-mask-cap must be ...')."""
    if isinstance(value, bool) or (isinstance(value, str) and not NUMBER_TEXT.fullmatch(value.strip())):
        raise ConfigError(f"{flag}: {key} is {brief(value)}, not a number")  # int(True) is 1: `true` is no length
    try:
        out = cast(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{flag}: {key} is {brief(value)}, not a number") from None
    if cast is int and isinstance(value, float) and value != out:
        raise ConfigError(f"{flag}: {key} is {brief(value)}, not a whole number")
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{flag}: {key} is {brief(value)}, not a finite number")
    check_number(f"{flag}: {key}", out, low, high, low_open=low_open, integer=cast is int)
    if knob is not None:
        from ...maths.loss import KNOBS

        KNOBS[knob].check(f"{flag}: {key}", out)
    return out


def text(flag: str, key: str, value, empty: bool = True) -> str:
    """A config value that names something (a model, a dtype, a mode) as a string; a list, mapping, number or bool
    there (or, `empty` False, a blank string) is ConfigError naming the key and what it is. None is not handled
    here: a caller reads a missing key as its default first."""
    if not isinstance(value, str):
        raise ConfigError(f"{flag}: {key} is {_kind(value)} ({brief(value, 40)}), not a name: give it as a string")
    if not empty and not value.strip():
        raise ConfigError(f"{flag}: {key} is empty: give a name, or drop the key")
    return value


def mapping(flag: str, key: str, value) -> dict:
    """A config value that must be a mapping (vllm_kwargs, a verl block): {} for a missing one, ConfigError naming
    the key for a list, string or number (the trainer would refuse it, or read nothing from it)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: {key} is {_kind(value)} ({brief(value, 40)}), not a mapping of key: value")
    return value


def _kind(value) -> str:
    return {list: "a list", dict: "a mapping", str: "a string", bool: "a boolean", int: "a number",
            float: "a number"}.get(type(value), f"a {type(value).__name__}")


CONFIG_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "16": "fp16"}
"""a dtype as trainers and engines spell it -> phantomclip's: torch's names (a 'torch.' prefix dropped), vLLM's
`dtype` ('half', 'float'; vllm/config/model.py _STR_DTYPE_TO_TORCH_DTYPE), verl's PrecisionType lists
(verl/utils/torch_dtypes.py HALF_LIST, FLOAT_LIST, BFLOAT_LIST)."""


def _vllm_quant() -> dict[tuple[str, str], str]:
    """(vLLM engine argument, value) -> --engine-quant, from fp8_vllm.VLLM_ARGS (the arguments phantomclip itself
    starts vLLM with for each quantiser), plus vLLM's other spellings of the same quantisers: 'fp8_per_tensor' takes
    the same online per-tensor path as 'fp8', and kv_cache_dtype 'fp8_e4m3' is the same cache as 'fp8'
    (fp8_vllm's module docstring)."""
    from ...precision.fp8_vllm import VLLM_ARGS

    table = {(key, value): quant for quant, args in VLLM_ARGS.items() for key, value in (args or {}).items()}
    table[("quantization", "fp8_per_tensor")] = table[("quantization", "fp8")]
    table[("kv_cache_dtype", "fp8_e4m3")] = table[("kv_cache_dtype", "fp8")]
    return table


VLLM_QUANT = _vllm_quant()
"""vLLM's own FP8 settings -> --engine-quant (quantization='fp8' is fp8-w8a8, 'fp8_per_channel' fp8-w8a8-channel,
'fp8_per_block' fp8-block; kv_cache_dtype='fp8' fp8-kv)."""
TRAINER_KEYS = ("model_init_kwargs", "actor_rollout_ref.actor.")
"""the config keys the trainer recipe is read from (TRL's, verl's): an unmapped value of one is moot when --trainer
is typed, since the recipe measured is then the one typed."""


def unmapped(settings: dict, what: str) -> None:
    """Add `what` ('key value') to the settings' `unmapped`, the config values no measured recipe matches (the
    answer then judges nothing); several are joined by '; '."""
    settings["unmapped"] = "; ".join(filter(None, (settings.get("unmapped", ""), what)))


def without_trainer_keys(text: str) -> str:
    """`unmapped` less the values read from TRAINER_KEYS."""
    return "; ".join(part for part in text.split("; ") if part and not part.startswith(TRAINER_KEYS))


KNOWN_KEYS = {"trl": "trl_1.16_fields.txt", "verl": "verl_b178a3c_keys.txt"}
"""each framework's known config keys, as files in phantomclip/data (their headers say where each list was read)."""


def known_keys(framework: str) -> frozenset[str]:
    """The keys a `framework` config may hold (KNOWN_KEYS' file: one a line, '#' lines are its header)."""
    from importlib.resources import files

    lines = files("phantomclip").joinpath("data", KNOWN_KEYS[framework]).read_text(encoding="utf-8").splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


def unknown_keys_note(keys: list[str], known: frozenset[str], where: str) -> str | None:
    """One note naming the keys a framework would not know (a typo such as `epsilon_hgh` falls back to the default
    silently otherwise), each with its nearest known key where one is close (difflib, ratio >= 0.8); None for none."""
    import difflib

    unknown = [k for k in keys if k not in known]
    if not unknown:
        return None
    named = []
    for key in unknown[:5]:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        named.append(f"{key} (did you mean {near[0]}?)" if near else key)
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return (f"not a key of {where}, so nothing was read from it: {', '.join(named)}{more}; the setting keeps its "
            "default here")


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
