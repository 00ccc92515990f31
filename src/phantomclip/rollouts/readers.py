"""Readers of the rollout records frameworks already write, one function per source in `READERS`, each giving the
same (rollouts.Header, stream of rollouts.Located) as phantomclip's own JSON Lines (docs/rollouts.md says which
file each framework writes and the lines a user adds to write one). A reader streams where its format allows,
never executes code from the file, and checks every field before anything is scored (rollouts.parse_record).
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from ..base.errors import ascii_digits, brief
from ..base.files import check_input, printable
from .record import (
    EngineInfo,
    Header,
    Located,
    Record,
    RecordError,
    check_same_measurement,
    fail,
    parse_header,
    parse_json,
    parse_record,
    read_rollout_lines,
)

Reader = Callable[[str], tuple[Header, Iterator[Located]]]

def read_slime(path: str) -> tuple[Header, Iterator[Located]]:
    """A slime or miles `--save-debug-rollout-data` file: `torch.save({"rollout_id": int, "samples": [Sample.to_dict()
    ...]})` (slime slime/observability/rollout_data_utils.py `save_debug_rollout_data` @624b824; miles
    miles/ray/rollout/debug_data.py @31f1ca9, which adds a top-level "metadata"). Per sample: `tokens` is prompt +
    response, the last `response_length` of them the response; `rollout_log_probs` one per response token, SGLang's
    log-prob after temperature over the full vocabulary ('tempered', unless the run set
    SGLANG_RETURN_ORIGINAL_LOGPROB); `loss_mask` 0 on tool tokens, which the engine did not sample (such a sample is
    refused: its placeholder 0.0 log-probs are no measurement); `rollout_routed_experts` [len(tokens) − 1, layers, k]
    (a torch tensor in slime, a numpy array in miles); `weight_versions` one string per engine call. The step is the
    file's rollout_id. Loaded with torch.load(weights_only=True), which refuses any pickled object that could run
    code; numpy arrays (miles' routes) are let through as data, nothing else. One rollout's dump is loaded whole (a
    pickle cannot be streamed)."""
    import numpy as np
    import torch

    name = printable(path)
    check_input(path)
    if Path(path).stat().st_size == 0:  # torch.load of 0 bytes is an IndexError from inside its zip reader
        raise RecordError(f"{name}: is empty (0 bytes): give the file --save-debug-rollout-data wrote")
    allowed = [np.ndarray, np.dtype, np.dtypes.Int32DType, np.dtypes.UInt8DType, np.dtypes.Int64DType,
               np.dtypes.UInt16DType, getattr(np, "_core", np.core).multiarray._reconstruct]
    try:  # torch warns of pickle protocols other than its own: the refusal below, not a warning, is what to say
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        what = str(e).split("Unsupported global: GLOBAL ")[-1].split(" ")[0] if "Unsupported global" in str(e) else ""
        raise RecordError(f"{name}: refused: loading it would run code ({what or 'a pickled object'}); phantomclip "
                          "loads only tensors, numbers, strings, lists and dicts: convert it to a rollout JSONL file "
                          "(docs/rollouts.md)") from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError) as e:
        raise RecordError(f"{name}: not a torch file torch.load can read ({str(e).splitlines()[0][:100]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise RecordError(f"{name}: not a slime/miles rollout dump (a dict with 'samples', as "
                          "--save-debug-rollout-data writes)")
    step = data.get("rollout_id") if isinstance(data.get("rollout_id"), int) else None
    header = Header(source="slime/miles --save-debug-rollout-data", logprobs="tempered",
                    engine=EngineInfo(name="sglang"))
    return header, (Located(f"{name} sample {i}", _slime_record(s, f"{name} sample {i}", step))
                    for i, s in enumerate(data["samples"]))


def _slime_record(sample, where: str, step: int | None) -> Record:
    """One slime Sample dict as a record (every field checked by parse_record)."""
    if not isinstance(sample, dict):
        raise fail(where, "is not a Sample dict")
    tokens, n = _plain(sample.get("tokens")), sample.get("response_length")
    if not isinstance(tokens, list) or not isinstance(n, int) or not 0 < n < len(tokens):
        raise fail(where, f"tokens ({_count(tokens)}) and response_length ({n!r}) do not split into a prompt and a "
                          "response of at least one token each")
    mask = _plain(sample.get("loss_mask"))
    if mask is not None and not isinstance(mask, list):
        raise fail(where, f"loss_mask = {brief(mask)} is not a list (one 0 or 1 per response token)")
    if mask is not None and not all(m == 1 for m in mask):
        raise fail(where, "has tool or environment tokens (loss_mask 0) the engine did not sample: multi-turn "
                          "samples are not measured yet; give single-turn samples")
    routes = sample.get("rollout_routed_experts")
    versions = _weight_versions(_plain(sample.get("weight_versions")), where)
    obj = {"prompt_ids": tokens[:-n], "completion_ids": tokens[-n:],
           "logp_engine": _plain(sample.get("rollout_log_probs")), "step": step,
           "weight_version": versions[-1] if versions else None, "routed_experts": _plain(routes),
           "finished": sample.get("status") == "completed"}
    return parse_record(obj, where)


VERSION_DIGITS = 18
"""the longest weight version read, in digits: a counter of updates, far below 10^18 (a 5,000-digit one is beyond
int()'s digit limit, a ValueError)."""


def _weight_versions(values, where: str) -> list[int]:
    """slime's weight_versions (one per engine call) as whole numbers. SGLang names a version with a string ('3', or
    its default 'default'): a name that is no number is left out, as it says nothing of the step; a number in other
    digits than 0-9 ('²', which int() refuses), a number longer than VERSION_DIGITS, or an entry that is not a string
    or a whole number is refused naming the field."""
    if values is None:
        return []
    if not isinstance(values, list):
        raise fail(where, f"weight_versions = {brief(values)} is not a list (one version per engine call)")
    out = []
    for i, v in enumerate(values):
        text = str(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else v
        if not isinstance(text, str):
            raise fail(where, f"weight_versions[{i}] = {brief(v)} is not a version (a string or a whole number >= 0)")
        if not text.isdigit():  # a name such as SGLang's 'default'
            continue
        if not ascii_digits(text) or len(text) > VERSION_DIGITS:
            raise fail(where, f"weight_versions[{i}] = {brief(text)} is not a version number (at most "
                              f"{VERSION_DIGITS} digits 0-9)")
        out.append(int(text))
    return out


def _plain(x):
    """A tensor or numpy array as nested lists (what parse_record checks); anything else as it is."""
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, list) else x


def _count(x) -> str:
    return f"{len(x)} tokens" if isinstance(x, list) else repr(type(x).__name__)


PARQUET_BATCH = 1024
"""rows read from a Parquet file at a time: one batch of records in memory, whatever the file's size."""
MILES_COLUMNS = {"tokens", "response_length", "rollout_log_probs"}
"""miles' dashboard columns (miles/ray/rollout/debug_data.py `save_dashboard_columns` @31f1ca9: tokens = prompt +
response, rollout_log_probs one per response token, loss_mask)."""


def read_parquet(path: str) -> tuple[Header, Iterator[Located]]:
    """A Parquet rollout file, read in row batches (PARQUET_BATCH rows in memory at a time): phantomclip's own columns
    (a record's fields, one column each; the header as JSON under the file's key-value metadata
    `phantomclip_rollouts`), or miles' dashboard columns (`dashboard_columns/rollout_<id>.parquet`: SGLang's
    'tempered' log-probs, as miles' torch dumps). Needs pyarrow (TRL and datasets install it)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecordError(f"{printable(path)}: reading Parquet needs pyarrow: pip install pyarrow") from None
    check_input(path)
    name = printable(path)
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own errors for a file that is not Parquet
        raise RecordError(f"{name}: not a Parquet file pyarrow can read ({str(e).splitlines()[0][:100]})") from None
    meta = (f.schema_arrow.metadata or {}).get(b"phantomclip_rollouts")
    columns = set(f.schema_arrow.names)
    if meta is not None:
        header = parse_header(parse_json(meta.decode("utf-8", "replace"), f"{name} metadata"), f"{name} metadata")
        convert = _own_row
    elif MILES_COLUMNS <= columns:
        header, convert = Header(source="miles dashboard columns", logprobs="tempered",
                                 engine=EngineInfo(name="sglang")), _miles_row
    else:
        raise RecordError(f"{name}: neither phantomclip's rollout columns (with its 'phantomclip_rollouts' "
                          f"metadata) nor miles' ({', '.join(sorted(MILES_COLUMNS))}); its columns: "
                          f"{', '.join(sorted(columns))[:120]}")

    def records() -> Iterator[Located]:
        i = 0
        for batch in f.iter_batches(batch_size=PARQUET_BATCH):
            for row in batch.to_pylist():
                where = f"{name} row {i}"
                yield Located(where, convert(row, where))
                i += 1

    return header, records()


def _own_row(row: dict, where: str) -> Record:
    return parse_record({k: v for k, v in row.items() if v is not None}, where)


def _miles_row(row: dict, where: str) -> Record:
    return _slime_record({"tokens": row["tokens"], "response_length": row["response_length"],
                          "rollout_log_probs": row["rollout_log_probs"], "loss_mask": row.get("loss_mask")},
                         where, None)


READERS: dict[str, Reader] = {
    "jsonl": read_rollout_lines,
    "slime": read_slime,
    "parquet": read_parquet,
}
"""source name -> reader; `read_rollouts` picks one by the file's suffix (SUFFIXES)."""
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".pt": "slime", ".pth": "slime",
            ".parquet": "parquet"}
"""file suffix -> reader."""


def read_rollouts(path: str) -> tuple[Header, Iterator[Located]]:
    """The header and the records of the rollout file `path`, by the reader its suffix names; of a directory, every
    rollout file in it (`rollout_files`), the first file's header standing for all."""
    if Path(path).is_dir():
        return read_directory(path)
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise RecordError(f"{printable(path)}: not a rollout file phantomclip reads (suffixes: "
                          f"{', '.join(SUFFIXES)}); docs/rollouts.md says what each framework writes")
    return READERS[SUFFIXES[suffix]](path)


EVAL_PREFIX = "eval_"
"""slime's evaluation dumps, written beside the training rollouts with the same id (`eval_{id}.pt`, other sampling):
never merged into a step; `evaluation_files` names them so a user can diagnose one on its own."""


def evaluation_files(directory: str) -> list[Path]:
    """The evaluation dumps a rollout directory holds (left out of its rollouts)."""
    return sorted(p for p in Path(directory).iterdir()
                  if p.name.startswith(EVAL_PREFIX) and p.suffix.lower() in SUFFIXES and p.is_file())


def rollout_files(directory: str) -> list[Path]:
    """The rollout files of a directory (not its subdirectories, not its evaluation dumps), in the order of the
    numbers in their names (step 2 before step 10), then by name."""
    found = [p for p in Path(directory).iterdir() if p.suffix.lower() in SUFFIXES and p.is_file()
             and not p.name.startswith(EVAL_PREFIX)]
    if not found:
        raise RecordError(f"{printable(directory)}: holds no rollout file ({', '.join(SUFFIXES)}): give the directory "
                          "the recorder wrote")
    return sorted(found, key=lambda p: ([int(x) for x in re.findall(r"\d+", p.name)], p.name))


def read_directory(directory: str) -> tuple[Header, Iterator[Located]]:
    """Every rollout file of `directory` as one stream, under the first file's header: a later file whose header
    records another measurement (another engine dtype, FP8 argument or model: record.MEASURED_FIELDS) is refused
    naming both files when the stream reaches it, before anything is scored. Each record takes its own file's log-prob
    kind and sampling where it gives none, so records of files whose headers differ are told apart
    (rollouts.batches.pack_records measures one kind at a time)."""
    files = rollout_files(directory)
    first, _ = read_rollouts(str(files[0]))

    def records() -> Iterator[Located]:
        for path in files:
            header, located = read_rollouts(str(path))
            check_same_measurement(first, printable(files[0].name), header, printable(str(path)))
            for item in located:
                r = item.record
                r.logprobs, r.sampling = r.logprobs or header.logprobs, r.sampling or header.sampling
                yield item

    return first, records()
