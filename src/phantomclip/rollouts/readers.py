"""Readers of the rollout records frameworks already write, one function per source in `READERS`, each giving the
same (rollouts.Header, stream of rollouts.Located) as phantomclip's own JSON Lines (docs/rollouts.md says which
file each framework writes and the lines a user adds to write one). A reader streams where its format allows,
never executes code from the file, and checks every field before anything is scored (rollouts.parse_record).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

from ..base.files import check_input, printable
from .record import (
    EngineInfo,
    Header,
    Located,
    Record,
    RecordError,
    check_same_measurement,
    parse_header,
    parse_json,
    parse_record,
    read_rollout_lines,
)
from .slime_dumps import is_train_dump, read_slime, slime_record

Reader = Callable[[str], tuple[Header, Iterator[Located]]]

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
    return slime_record({"tokens": row["tokens"], "response_length": row["response_length"],
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
    """The rollout files of a directory (not its subdirectories, not its evaluation dumps, not slime rollout-data
    dumps beside its train-data dumps: `rollout_dumps_beside_train_dumps`), in the order of the numbers in their
    names (step 2 before step 10), then by name."""
    found = [p for p in Path(directory).iterdir() if p.suffix.lower() in SUFFIXES and p.is_file()
             and not p.name.startswith(EVAL_PREFIX)]
    if not found:
        raise RecordError(f"{printable(directory)}: holds no rollout file ({', '.join(SUFFIXES)}): give the directory "
                          "the recorder wrote")
    beside = set(rollout_dumps_beside_train_dumps(directory))
    found = [p for p in found if p not in beside]
    return sorted(found, key=lambda p: ([int(x) for x in re.findall(r"\d+", p.name)], p.name))


def rollout_dumps_beside_train_dumps(directory: str) -> list[Path]:
    """slime's rollout-data dumps in a directory that also holds its train-data dumps (format 2): those hold the same
    samples (slime joins the two by rollout_position: tests/test_qwen2.5_0.5B_debug_train_dump_e2e.py @624b824) with
    the trainer's own log-probs beside the engine's, so the rollout-data dumps are left out, not counted twice."""
    dumps = [p for p in Path(directory).iterdir() if p.is_file() and SUFFIXES.get(p.suffix.lower()) == "slime"
             and not p.name.startswith(EVAL_PREFIX)]
    train = [p for p in dumps if is_train_dump(p)]
    return sorted(p for p in dumps if p not in train) if train else []


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
