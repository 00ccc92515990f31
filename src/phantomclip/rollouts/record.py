"""Rollout records: the token ids a real engine sampled and the log-probs it gave them, as a user's run recorded them.

A record is the boundary between the user's engine (vLLM or SGLang on their GPUs, inside TRL, verl, slime or their
own loop) and phantomclip: past `to_rollout` nothing knows where the tokens came from, and every table, split, answer
and gate of `diagnose` works unchanged (docs/rollouts.md has the format field by field, and what each framework adds
to write it).

The file is JSON Lines, read as a stream (one record in memory at a time, never the whole file): an optional first
line, the header, holds what every record shares (`Header`: the engine, the sampling settings, which log-probs); each
further line is one sequence (`Record`). A value a record gives for a header field wins for that record. Every field
is checked as it is read, and every record against the model before anything is scored (`check_against_model`); a
malformed one is one line naming the file, the line and the field (`RecordError`, exit 2).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..base.errors import PhantomclipError
from ..base.files import JSON_ERRORS, InputError, atomic_write_bytes, json_reason, printable, shown

ROLLOUTS_SCHEMA = 1
"""the header's `phantomclip_rollouts` value this reader understands."""
LOGPROBS = {"raw": "log-softmax over the full vocabulary of the logits before temperature and truncation (vLLM "
                   "logprobs_mode='raw_logprobs', its default)",
            "tempered": "log-softmax over the full vocabulary after temperature, before truncation (SGLang's default, "
                        "so slime's and miles' rollout_log_probs)",
            "processed": "after temperature and top-p/top-k/min-p, renormalised over the kept tokens (vLLM "
                         "logprobs_mode='processed_logprobs', as TRL asks vLLM for them)"}
"""which log-probs a record holds; β is measured against the same definition on the trainer's side."""
LINE_LIMIT = 2**26
"""the longest line read (64 MiB): a sequence of 100,000 tokens with its routes (48 layers x 8 experts) is about 40
MB of JSON; a longer line is refused rather than read without bound."""


class RecordError(PhantomclipError):
    """A rollout file or record that cannot be measured: the message names the file, the line and the field."""


@dataclass(frozen=True)
class RecordedSampling:
    """How the engine sampled: the settings that decide which distribution a 'processed' log-prob is of."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or vLLM's -1): off."""
    min_p: float = 0.0


@dataclass(frozen=True)
class EngineInfo:
    """The engine that sampled, as the run knew it (all optional, all said in the output)."""

    name: str = ""
    """'vllm', 'sglang', 'phantomclip-local', ..."""
    version: str = ""
    dtype: str = ""
    """the dtype it computed in: 'bfloat16', 'float16', 'float32' (or bf16/fp16/fp32)."""
    quantization: str = ""
    """vLLM's `quantization` argument ('fp8', 'fp8_per_channel', ...); empty: none."""
    kv_cache_dtype: str = ""
    """vLLM's `kv_cache_dtype` ('fp8', 'fp8_e4m3'; 'auto' or empty: the model's dtype)."""
    device: str = ""
    """where it ran, e.g. 'NVIDIA H100 80GB HBM3'."""


@dataclass(frozen=True)
class Header:
    """The first line of a rollout file: what every record shares. Every field optional; `phantomclip_rollouts`
    marks the line as a header."""

    phantomclip_rollouts: int = ROLLOUTS_SCHEMA
    source: str = ""
    """what wrote the file: 'vllm' (record_vllm), 'trl', 'verl', 'slime', 'phantomclip diagnose', or the user's."""
    model: str = ""
    """the checkpoint the tokens were sampled from, as the run named it (said, not checked: β checks it)."""
    engine: EngineInfo = field(default_factory=EngineInfo)
    sampling: RecordedSampling | None = None
    """None: not recorded ('raw' log-probs are then measured at temperature 1, as they are defined; 'processed' ones
    are refused, since their distribution is unknown)."""
    logprobs: str = "raw"
    """'raw', 'tempered' or 'processed' (LOGPROBS)."""
    recorded_at: str = ""
    """when, ISO 8601."""


def _dtype_key(text: str) -> str:
    """An engine dtype as one spelling (bf16 and bfloat16 are one dtype); an unknown one as written, lower case."""
    from ..base.numerics import dtype_name, parse_dtype

    try:
        return dtype_name(parse_dtype(text)) if text.strip() else ""
    except ValueError:
        return text.strip().lower()


def _argument_key(text: str) -> str:
    """A vLLM argument's value as one spelling: 'auto' and 'none' are its unset value, as an empty one."""
    key = text.strip().lower()
    return "" if key in ("auto", "none") else key


MEASURED_FIELDS = {
    "engine.dtype": lambda h: _dtype_key(h.engine.dtype),
    "engine.quantization": lambda h: _argument_key(h.engine.quantization),
    "engine.kv_cache_dtype": lambda h: _argument_key(h.engine.kv_cache_dtype),
}
"""the header fields compared across one directory's files: the engine's dtype (a file that records none agrees:
UNSET_AGREES) and its FP8 arguments (unset means none). Not the model: a run's steps are sampled by different
checkpoints, found by matching (diagnose.which_weights). The log-prob kind and sampling are a record's own, held to
one per measurement by batches.pack_records. The rest (engine name, version, device, source, date) is only said."""
UNSET_AGREES = {"engine.dtype"}


def check_same_measurement(first: Header, first_name: str, other: Header, other_name: str) -> None:
    """Refuse (RecordError naming both files and the field) a rollout file whose header records another measurement
    than the first file's (MEASURED_FIELDS): one directory is measured with one engine and one checkpoint, and a second
    file's FP8 or fp32 engine measured as the first file's bf16 one gives a β of nothing that ran."""
    for name, key in MEASURED_FIELDS.items():
        a, b = key(first), key(other)
        if a != b and not (name in UNSET_AGREES and not (a and b)):
            raise RecordError(f"{other_name}: {name} {b!r} differs from {first_name}'s {a!r}: one directory is "
                              "measured as one engine; measure the files apart (--rollouts FILE) "
                              "or put them in directories of their own")


@dataclass
class Record:
    """One sampled sequence."""

    prompt_ids: list[int]
    """the prompt's token ids as the engine saw them (chat template applied), at least one."""
    completion_ids: list[int]
    """the sampled tokens, at least one (a stop token the engine sampled is included)."""
    logp_engine: list[float]
    """the engine's log-prob of each completion token (one per completion id, finite, <= 0)."""
    step: int | None = None
    """the training step whose rollout this was."""
    weight_version: int | None = None
    """the version of the weights that sampled it (TRL's async model_version, slime's weight_versions); selects the
    checkpoint in a post-mortem when `step` is absent."""
    advantage: float | None = None
    """the sequence's advantage (GRPO's group-normalised reward): where recorded, the share of tokens phantom-clipped
    at α = 0 is measured (a token is clipped when exp(β) leaves the trust region on its advantage's side)."""
    routed_experts: list[list[list[int]]] | None = None
    """MoE models: the experts the engine chose, [positions][layers][k], for the first positions of prompt +
    completion (vLLM's `routed_experts` covers every position but the last, whose output is never used); replayed in
    the trainer's forward to split off β_route."""
    finished: bool | None = None
    """True where the sequence ended on a stop token."""
    logprobs: str | None = None
    """overrides the header's; None: the header's."""
    sampling: RecordedSampling | None = None
    """overrides the header's; None: the header's."""
    loss_mask: list[int] | None = None
    """one 0 or 1 per completion token: 0 on tokens the policy did not sample (a multi-turn sample's tool or
    environment output, slime's loss_mask 0), which are read as context and left out of every figure, as the
    trainer leaves them out of its loss; None: every completion token was sampled."""
    nucleus: list[list[int]] | None = None
    """per completion token, the token ids the engine's top-p kept when it sampled it (slime's
    rollout_top_p_token_ids): 'processed' log-probs are renormalised over exactly these (and the sampled token), on
    the trainer's side too; None: the trainer's own truncation stands for the engine's."""
    logp_trainer_recorded: list[float] | None = None
    """the user's trainer's log-prob of each completion token as its run recorded it (slime's train dump log_probs)."""
    canary: bool | None = None
    """True for a probe record (the canary, docs/rollouts.md "Engine or learning"): fixed tokens the engine read, not
    sampled, at this step's weights; kept out of the run's own figures and read step by step on their own."""


@dataclass(frozen=True)
class Located:
    """A record and where it was read: 'file:line N' (or 'file record N' for a binary source)."""

    where: str
    record: Record


# ------------------------------------------------------------------------------------------------ checks


def fail(where: str, what: str) -> RecordError:
    """The one RecordError of a field: where it was read, then what is wrong and what to do."""
    return RecordError(f"{where}: {what}")


def _int_list(value, where: str, name: str, minimum: int = 1) -> list[int]:
    if not isinstance(value, list) or len(value) < minimum:
        raise fail(where, f"{name} must be a list of at least {minimum} token id(s), got "
                           f"{_show(value)}")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise fail(where, f"{name}[{i}] = {_show(v)} is not a token id (a whole number >= 0)")
    return value


def _show(value) -> str:
    """A value as a short, printable fragment (never a megabyte of a hostile file)."""
    text = printable(repr(value) if not isinstance(value, (list, dict)) else json.dumps(value)[:60])
    return text if len(text) <= 60 else text[:57] + "..."


def _number(value, where: str, name: str) -> float:
    """A field's number as a float: the one conversion every numeric field of a record or header goes through. A
    bool, a string or a list is no number, and a whole number too large for a float (JSON reads 400 digits as an
    int; float() of it is an OverflowError) is refused naming the field; a NaN or an infinity is returned as it is,
    for the field's own range check."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(where, f"{name} = {_show(value)} is not a number")
    try:
        return float(value)
    except OverflowError:
        raise fail(where, f"{name} is a whole number of {value.bit_length()} bits, too large for a float: give the "
                           "value itself") from None


def check_logprobs(values, n: int, where: str, name: str = "logp_engine") -> list[float]:
    """The log-probs `name` of n completion tokens (the engine's, or the trainer's as recorded): a list of n finite
    numbers <= 0. A positive log-prob is no probability (log-softmax in fp32 has 0 as its largest value), a NaN or
    -inf one cannot be compared: both are refused with the token's index."""
    if not isinstance(values, list) or len(values) != n:
        got = len(values) if isinstance(values, list) else _show(values)
        raise fail(where, f"{name} has {got} values for {n} completion tokens: give one log-prob per sampled token")
    out = []
    for i, v in enumerate(values):
        x = _number(v, where, f"{name}[{i}]")
        if not math.isfinite(x) or x > 0:
            why = "is not finite" if not math.isfinite(x) else "is not a log-prob (<= 0)"
            raise fail(where, f"{name}[{i}] = {_show(v)} {why}: record the {name.split('_')[1]}'s log-prob per token")
        out.append(x)
    return out


GREEDY_BELOW = 1e-5
"""a temperature below this is greedy sampling: vLLM's `_SAMPLING_EPS` (vllm/sampling_params.py: "Zero temperature
means greedy sampling", tested as temperature < 1e-5); log-probs divided by a temperature that small overflow to NaN."""


def _sampling(value, where: str) -> RecordedSampling | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise fail(where, f"sampling must be an object, got {_show(value)}")
    unknown = set(value) - {f.name for f in fields(RecordedSampling)}
    if unknown:
        raise fail(where, f"sampling has unknown field(s) {', '.join(sorted(map(str, unknown)))}: use temperature, "
                           "top_p, top_k, min_p")
    s = RecordedSampling(**{k: value[k] for k in value})
    checks = {"temperature": (s.temperature, 0, math.inf), "top_p": (s.top_p, 0, 1), "min_p": (s.min_p, 0, 1)}
    for name, (v, low, high) in checks.items():
        x = _number(v, where, f"sampling.{name}")
        if not (low <= x <= high):  # NaN fails every comparison
            raise fail(where, f"sampling.{name} = {_show(v)} is outside [{low:g}, {high:g}]")
    s = RecordedSampling(_number(s.temperature, where, "sampling.temperature"), s.top_p, s.top_k, s.min_p)
    if s.temperature < GREEDY_BELOW or s.top_p == 0:
        name, v = ("temperature", s.temperature) if s.temperature < GREEDY_BELOW else ("top_p", s.top_p)
        raise fail(where, f"sampling.{name} = {v:g} is greedy decoding (vLLM samples greedily below a temperature of "
                           f"{GREEDY_BELOW:g}): its log-probs are not those of the distribution the tokens came from")
    if not math.isfinite(s.temperature):
        raise fail(where, f"sampling.temperature = {s.temperature:g}: give the finite temperature the engine "
                           "sampled at")
    if isinstance(s.top_k, bool) or not isinstance(s.top_k, int) or s.top_k < -1:
        raise fail(where, f"sampling.top_k = {_show(s.top_k)} is not a whole number >= -1 (-1 or 0: off)")
    return RecordedSampling(float(s.temperature), float(s.top_p), max(s.top_k, 0), float(s.min_p))


def _optional_int(value, where: str, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise fail(where, f"{name} = {_show(value)} is not a whole number >= 0")
    return value


def _routes(value, where: str, positions: int) -> list | None:
    """[positions][layers][k] expert ids: the same layers and k at every position, at most prompt + completion
    positions (checked against the model's layers and experts later, `check_against_model`)."""
    if value is None:
        return None
    if not isinstance(value, list) or not value or len(value) > positions:
        raise fail(where, f"routed_experts must list the experts of 1 to {positions} positions (prompt + "
                           f"completion), got {len(value) if isinstance(value, list) else _show(value)}")
    shape = None
    for i, pos in enumerate(value):
        if not isinstance(pos, list) or not pos or not all(isinstance(layer, list) for layer in pos):
            raise fail(where, f"routed_experts[{i}] must be a list of layers, each a list of expert ids")
        here = (len(pos), len(pos[0]))
        if shape is None:
            shape = here
        if here != shape or any(len(layer) != shape[1] for layer in pos):
            raise fail(where, f"routed_experts[{i}] has another shape than routed_experts[0] ({shape[0]} layers x "
                               f"{shape[1]} experts): every position routes every layer to k experts")
        for layer in pos:
            for e in layer:
                if isinstance(e, bool) or not isinstance(e, int) or e < 0:
                    raise fail(where, f"routed_experts[{i}] holds {_show(e)}, not an expert id (a whole number "
                                       ">= 0)")
    return value


RECORD_FIELDS = {f.name for f in fields(Record)}


def parse_record(obj, where: str) -> Record:
    """A Record from one JSON object, every field checked (RecordError naming `where` and the field)."""
    if not isinstance(obj, dict):
        raise fail(where, f"a record must be a JSON object, got {_show(obj)}")
    unknown = sorted(str(k) for k in set(obj) - RECORD_FIELDS)
    if unknown:
        raise fail(where, f"unknown field(s) {', '.join(unknown)[:120]}: a record has "
                           f"{', '.join(f.name for f in fields(Record))} (docs/rollouts.md)")
    for name in ("prompt_ids", "completion_ids", "logp_engine"):
        if name not in obj:
            raise fail(where, f"missing {name}: a record needs prompt_ids, completion_ids and logp_engine")
    prompt = _int_list(obj["prompt_ids"], where, "prompt_ids")
    completion = _int_list(obj["completion_ids"], where, "completion_ids")
    advantage = obj.get("advantage")
    if advantage is not None and not math.isfinite(_number(advantage, where, "advantage")):
        raise fail(where, f"advantage = {_show(advantage)} is not a finite number")
    finished, canary = obj.get("finished"), obj.get("canary")
    for name, flag in (("finished", finished), ("canary", canary)):
        if flag is not None and not isinstance(flag, bool):
            raise fail(where, f"{name} = {_show(flag)} is not true or false")
    return Record(
        prompt_ids=prompt, completion_ids=completion,
        logp_engine=check_logprobs(obj["logp_engine"], len(completion), where),
        logp_trainer_recorded=None if obj.get("logp_trainer_recorded") is None else check_logprobs(
            obj["logp_trainer_recorded"], len(completion), where, "logp_trainer_recorded"),
        step=_optional_int(obj.get("step"), where, "step"),
        weight_version=_optional_int(obj.get("weight_version"), where, "weight_version"),
        advantage=None if advantage is None else float(advantage),
        routed_experts=_routes(obj.get("routed_experts"), where, len(prompt) + len(completion)),
        finished=finished, logprobs=_logprobs_mode(obj.get("logprobs"), where, optional=True),
        sampling=_sampling(obj.get("sampling"), where), canary=canary or None,
        loss_mask=_loss_mask(obj.get("loss_mask"), where, len(completion)),
        nucleus=_nucleus(obj.get("nucleus"), where, len(completion)),
    )


def _loss_mask(value, where: str, n: int) -> list[int] | None:
    """One 0/1 per completion token (True/False read as 1/0); None where every token is 1."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n or any(v not in (0, 1) for v in value):
        raise fail(where, f"loss_mask must be one 0 or 1 per completion token ({n}), got {_show(value)}")
    return None if all(value) else [int(v) for v in value]


def _nucleus(value, where: str, n: int) -> list[list[int]] | None:
    """Per completion token, a list of token ids (checked against the vocabulary later, `check_against_model`)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else _show(value)
        raise fail(where, f"nucleus has {got} entries for {n} completion tokens: give the kept token ids of each")
    for i, ids in enumerate(value):
        _int_list(ids, where, f"nucleus[{i}]", minimum=0)
    return value


def _logprobs_mode(value, where: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or value not in LOGPROBS:  # a list is unhashable: checked as a string first
        raise fail(where, f"logprobs = {_show(value)}: use {', '.join(LOGPROBS)} (docs/rollouts.md says which is "
                          "which)")
    return value


def _text(value, where: str, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise fail(where, f"{name} = {_show(value)} is not a string")
    text = str(value)
    if len(text) > 200:
        raise fail(where, f"{name} is {len(text)} characters long: at most 200")
    # A file's words are shown as text everywhere (terminal, JSON, the article): control characters (a newline that
    # would forge an output line, ESC sequences a terminal would obey) as \xNN, a file name's stray bytes as printable
    return shown(text)


def parse_header(obj: dict, where: str) -> Header:
    """A Header from the first line's object (RecordError naming the field)."""
    if not isinstance(obj, dict):  # a Parquet file's metadata may hold any JSON value
        raise fail(where, f"the header must be a JSON object, got {_show(obj)}")
    known = {f.name for f in fields(Header)}
    unknown = sorted(str(k) for k in set(obj) - known)
    if unknown:
        raise fail(where, f"unknown header field(s) {', '.join(unknown)[:120]}: a header has {', '.join(known)}")
    if obj.get("phantomclip_rollouts") != ROLLOUTS_SCHEMA:
        raise fail(where, f"phantomclip_rollouts = {_show(obj.get('phantomclip_rollouts'))}: this phantomclip reads "
                           f"version {ROLLOUTS_SCHEMA}")
    engine = obj.get("engine") or {}
    if not isinstance(engine, dict):
        raise fail(where, f"engine must be an object, got {_show(engine)}")
    unknown = sorted(str(k) for k in set(engine) - {f.name for f in fields(EngineInfo)})
    if unknown:
        raise fail(where, f"unknown engine field(s) {', '.join(unknown)[:120]}: use "
                           f"{', '.join(f.name for f in fields(EngineInfo))}")
    info = EngineInfo(**{k: _text(v, where, f"engine.{k}") for k, v in engine.items()})
    return Header(source=_text(obj.get("source"), where, "source"), model=_text(obj.get("model"), where, "model"),
                  engine=info, sampling=_sampling(obj.get("sampling"), where),
                  logprobs=_logprobs_mode(obj.get("logprobs", "raw"), where),
                  recorded_at=_text(obj.get("recorded_at"), where, "recorded_at"))


# ------------------------------------------------------------------------------------------------ reading


def open_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file, streamed: a regular file only (opened without blocking, so a FIFO
    cannot hang it), each line at most LINE_LIMIT bytes, blank lines skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    try:
        import stat

        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(path, "is not a regular file: give the rollout file itself (a directory of them is "
                                   "read with --rollouts DIR)" if stat.S_ISDIR(mode) else "is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            for number, raw in enumerate(iter(lambda: f.readline(LINE_LIMIT + 1), b""), start=1):
                if len(raw) > LINE_LIMIT:
                    raise fail(f"{printable(str(path))}:{number}", f"the line is longer than {LINE_LIMIT >> 20} MiB")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise fail(f"{printable(str(path))}:{number}", "is not UTF-8 text") from None
                if text.strip():
                    yield number, text
    except OSError as e:
        raise InputError(path, f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def read_rollout_lines(path: str | Path) -> tuple[Header, Iterator[Located]]:
    """(the header, the records as a stream) of a phantomclip rollout file. A file without a header line has the
    default header (raw log-probs, nothing else known)."""
    lines = open_lines(path)
    name = printable(str(path))
    first = next(lines, None)
    if first is None:
        raise RecordError(f"{name}: holds no record")
    number, text = first
    obj = parse_json(text, f"{name}:{number}")
    if isinstance(obj, dict) and "phantomclip_rollouts" in obj:
        header, pending = parse_header(obj, f"{name}:{number}"), None
    else:
        header, pending = Header(), (number, obj)

    def records() -> Iterator[Located]:
        if pending is not None:
            yield Located(f"{name}:{pending[0]}", parse_record(pending[1], f"{name}:{pending[0]}"))
        for n, line in lines:
            yield Located(f"{name}:{n}", parse_record(parse_json(line, f"{name}:{n}"), f"{name}:{n}"))

    return header, records()


def parse_json(text: str, where: str):
    """One JSON value of a rollout file (a line, or a Parquet file's header metadata); RecordError naming `where`."""
    try:
        return json.loads(text)
    except JSON_ERRORS as e:
        raise fail(where, f"is not JSON ({json_reason(e)})") from None


# ------------------------------------------------------------------------------------------------ writing


def write_records(path: str | Path, header: Header, records: list[Record]) -> None:
    """A rollout file: the header line, then one record a line, written as --json writes (files.atomic_write_bytes):
    a file atomically (temp file, then rename), so a job killed while writing leaves the old file or none; a stream
    this process holds (/dev/stdout redirected to a file) into its own descriptor, after what was printed, where
    opening the path again would start at offset 0 and write over it. The text is built whole first: the records
    are in memory already, and their JSON is about as large."""
    lines = [json.dumps(_compact(asdict(header)), allow_nan=False)]
    lines += [json.dumps(_compact(asdict(r)), allow_nan=False) for r in records]
    atomic_write_bytes(Path(path), "".join(line + "\n" for line in lines).encode("utf-8"))


def _compact(obj: dict) -> dict:
    """A record or header without its empty optional fields (None, '', an empty EngineInfo)."""
    out = {}
    for k, v in obj.items():
        if isinstance(v, dict):
            v = _compact(v)
        if v not in (None, "", {}):
            out[k] = v
    return out
