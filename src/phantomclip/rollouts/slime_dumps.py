"""slime's and miles' torch dumps as rollout records: `--save-debug-rollout-data` (what the engine sampled) and
`--save-debug-train-data` (format 2: the same samples with the trainer's own log-probs beside the engine's).

Every field read is checked against slime's source at commit 624b824 (THUDM/slime) and miles' at 31f1ca9: the
files and lines are cited where each is read. A dump is loaded with torch.load(weights_only=True) and an allow-list
of exactly the numpy globals plain data needs, so nothing in it can run code.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..base.errors import ascii_digits, brief
from ..base.files import check_input, printable
from .record import EngineInfo, Header, Located, Record, RecordError, fail, parse_record

NUMPY_SCALAR_KINDS = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16",
                      "Float32", "Float64")
"""numpy's numeric dtypes (np.dtypes.<kind>DType): a numpy scalar (a reward np.float32(1.0)) or array pickles as its
dtype's class and raw bytes. Object, string and void dtypes are left out: they hold no number."""


def numpy_safe_globals() -> list:
    """What torch.load(weights_only=True) must be told to let through for numpy arrays and scalars, and nothing else:
    the array and scalar rebuilders (`multiarray._reconstruct`, `multiarray.scalar`, which build a value from a dtype
    and raw bytes, calling no user code), np.ndarray, np.dtype and the numeric dtype classes. Files written under
    numpy 1 name the rebuilders under numpy.core, numpy 2 under numpy._core: both names are listed."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    rebuilders = [core.multiarray._reconstruct, core.multiarray.scalar]
    return [np.ndarray, np.dtype, *rebuilders, *((f, f"numpy.core.multiarray.{f.__name__}") for f in rebuilders),
            *(getattr(np.dtypes, f"{kind}DType") for kind in NUMPY_SCALAR_KINDS)]


def load_dump(path: str) -> dict:
    """A slime/miles dump as plain data (tensors, numbers, strings, lists, dicts, numpy arrays and scalars); a file
    that pickles anything else is refused in one line naming what it pickles."""
    import torch

    name = printable(path)
    check_input(path)
    if Path(path).stat().st_size == 0:  # torch.load of 0 bytes is an IndexError from inside its zip reader
        raise RecordError(f"{name}: is empty (0 bytes): give the file --save-debug-rollout-data wrote")
    try:  # torch warns of pickle protocols other than its own: the refusal below, not a warning, is what to say
        with torch.serialization.safe_globals(numpy_safe_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(e))  # torch's words for what it refused
        what = next((g for g in found.groups() if g), "") if found else ""
        raise RecordError(f"{name}: refused: it pickles {what or 'an object'}, which is not plain data (tensors, "
                          "numbers, strings, lists, dicts, numpy arrays and scalars) and could run code when loaded; "
                          "convert it to a rollout JSONL file (docs/rollouts.md)") from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError) as e:
        raise RecordError(f"{name}: not a torch file torch.load can read ({str(e).splitlines()[0][:100]})") from None
    if isinstance(data, dict) and "rollout_data" in data and "samples" not in data:
        raise RecordError(f"{name}: a per-rank --save-debug-train-data file without format_version (miles @31f1ca9 and "
                          "slime before format 2 save {rollout_id, rank, rollout_data} with context-parallel shards "
                          "as they lay): not read; give slime's format-2 train dump, or the run's "
                          "--save-debug-rollout-data dump")
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise RecordError(f"{name}: not a slime/miles dump (a dict with 'samples', as --save-debug-rollout-data and "
                          "--save-debug-train-data write)")
    return data


def read_slime(path: str) -> tuple[Header, Iterator[Located]]:
    """A slime or miles `--save-debug-rollout-data` file: `torch.save({"rollout_id": int, "samples": [Sample.to_dict()
    ...]})` (slime slime/observability/rollout_data_utils.py `save_debug_rollout_data` @624b824; miles
    miles/ray/rollout/debug_data.py @31f1ca9, which adds a top-level "metadata"). The step is the file's rollout_id.
    Per sample, `slime_record`. Without a recorded nucleus the log-probs are SGLang's after temperature over the full
    vocabulary ('tempered', unless the run set SGLANG_RETURN_ORIGINAL_LOGPROB); with one (`--rollout-top-p` < 1)
    they are renormalised over it ('processed'). One rollout's dump is loaded whole (a pickle cannot be streamed)."""
    data = load_dump(path)
    name = printable(path)
    if "format_version" in data or "dp_shards" in data:
        return read_train_data(data, name)
    return _dump_records(data, name, "slime/miles --save-debug-rollout-data", slime_record)


def _dump_records(data: dict, name: str, source: str, to_record) -> tuple[Header, Iterator[Located]]:
    """A dump's header and its samples as records (`to_record(sample, where, step)`): the step is the dump's
    rollout_id; the log-probs are 'processed' where the first sample carries a top-p nucleus, else 'tempered'."""
    step = _plain(data.get("rollout_id"))
    step = step if isinstance(step, int) else None
    samples = data["samples"]
    nucleus = bool(samples) and isinstance(samples[0], dict) and samples[0].get("rollout_top_p_token_ids") is not None
    header = Header(source=source, logprobs="processed" if nucleus else "tempered", engine=EngineInfo(name="sglang"))
    return header, (Located(f"{name} sample {i}", to_record(s, f"{name} sample {i}", step))
                    for i, s in enumerate(samples))


def slime_record(sample, where: str, step: int | None, trainer: list | None = None) -> Record:
    """One slime Sample dict as a record (slime/utils/types.py `Sample` @624b824; every field checked by
    parse_record): `tokens` is prompt + response, the last `response_length` of them the response;
    `rollout_log_probs` one per response token (`_validate_response_metadata_lengths`), 0.0 placeholders on tool
    tokens (`add_response_tokens`: `[0.0] * previous_response_length`); `loss_mask` one per response token, 0 on
    tool tokens, which slime's trainer leaves out of its loss and of train_rollout_logprob_abs_diff (loss.py
    `sum_of_sample_mean` over the loss masks, line 1140), so they are context here; `rollout_top_p_token_ids` /
    `rollout_top_p_token_offsets` the nucleus of response token r at ids[offsets[r]:offsets[r + 1]] (offsets one
    longer than the response); `rollout_routed_experts` [len(tokens) − 1, layers, k] (a torch tensor in slime, a
    numpy array in miles); `weight_versions` one string per engine call. `trainer`: the trainer's own log-prob of
    each response token, where a train dump recorded them (`train_record`)."""
    if not isinstance(sample, dict):
        raise fail(where, "is not a Sample dict")
    tokens, n = _plain(sample.get("tokens")), _plain(sample.get("response_length"))
    if not isinstance(tokens, list) or not isinstance(n, int) or not 0 < n < len(tokens):
        raise fail(where, f"tokens ({_count(tokens)}) and response_length ({n!r}) do not split into a prompt and a "
                          "response of at least one token each")
    versions = _weight_versions(_plain(sample.get("weight_versions")), where)
    obj = {"prompt_ids": tokens[:-n], "completion_ids": tokens[-n:],
           "logp_engine": _plain(sample.get("rollout_log_probs")), "step": step,
           "weight_version": versions[-1] if versions else None,
           "routed_experts": _plain(sample.get("rollout_routed_experts")),
           "finished": sample["status"] == "completed" if "status" in sample else None,
           "loss_mask": _plain(sample.get("loss_mask")), "nucleus": _nucleus(sample, where, n),
           "logp_trainer_recorded": trainer}
    return parse_record(obj, where)


TRAIN_FORMAT = 2
"""the `format_version` of slime's --save-debug-train-data this reader understands (slime/observability/
train_data_utils.py `_build_dump_payload` @624b824)."""
TRAIN_COLUMNS = {"tokens": "tokens", "response_length": "response_lengths", "rollout_log_probs": "rollout_log_probs",
                 "loss_mask": "loss_masks", "rollout_top_p_token_ids": "rollout_top_p_token_ids",
                 "rollout_top_p_token_offsets": "rollout_top_p_token_offsets",
                 "rollout_routed_experts": "rollout_routed_experts"}
"""a Sample field `slime_record` reads -> the train dump's per-sample column holding it (slime/ray/rollout.py
`_convert_samples_to_train_data` names the columns; `_split_train_data_by_dp` ships them to the trainer)."""


def read_train_data(data: dict, name: str) -> tuple[Header, Iterator[Located]]:
    """slime's `--save-debug-train-data` dump, format 2 (slime/observability/train_data_utils.py `_build_dump_payload`,
    written by `save_debug_train_data` @624b824): {"format_version": 2, "rollout_id", "rank" (the writer's), "samples",
    "dp_shards" (the DP / micro-batch layout), "raw_reward"}, one file per rollout holding every DP rank's samples:
    the last pipeline stage's tensor-parallel rank 0 gathers them, context-parallel shards restored to one value per
    response token first (`restore_context_parallel_fields_to_cpu`). The step is the rollout_id; per sample,
    `train_record`. A dump of another format_version, or without one, is refused."""
    version = _plain(data.get("format_version"))
    if version != TRAIN_FORMAT:
        said = f"format_version {brief(version)}" if "format_version" in data else "no format_version"
        raise RecordError(f"{name}: a --save-debug-train-data dump with {said}: phantomclip reads format "
                          f"{TRAIN_FORMAT} (slime @624b824); give the run's --save-debug-rollout-data dump instead")
    return _dump_records(data, name, "slime --save-debug-train-data", train_record)


def train_record(sample, where: str, step: int | None) -> Record:
    """One sample of a format-2 train dump as a record: the trainer's per-sample columns (`TRAIN_COLUMNS`; tokens
    int64 prompt + response, `total_lengths` = len(tokens), loss_masks int32 and rollout_log_probs float32 one per
    response token, as the trainer moved them to its GPU: backends/megatron_utils/actor.py `_get_rollout_data`) read
    as `slime_record` reads a rollout dump's Sample, and `log_probs`, the trainer's own float32 log-prob of each
    response token (backends/megatron_utils/loss.py `get_log_probs_and_entropy`: fp32 logits over
    --rollout-temperature, renormalised over the recorded nucleus as the engine's are; captured from the training
    forward where slime made no separate recompute, actor.py `train_actor`), as the record's logp_trainer_recorded.
    A dump without the engine's log-probs, or whose log_probs are not one per response token, is refused."""
    if not isinstance(sample, dict):
        raise fail(where, "is not a sample dict")
    if sample.get("rollout_log_probs") is None:
        raise fail(where, "has no rollout_log_probs (the engine's log-prob of each response token: slime carries them "
                          "into training only where the rollout recorded them), so β has nothing to compare: dump a "
                          "run whose rollout records Sample.rollout_log_probs")
    n, tokens = _plain(sample.get("response_lengths")), _plain(sample.get("tokens"))
    trainer, mask = _plain(sample.get("log_probs")), _plain(sample.get("loss_masks"))
    if trainer is not None and not (isinstance(trainer, list) and len(trainer) == n
                                    and (mask is None or isinstance(mask, list) and len(mask) == n)):
        raise fail(where, f"log_probs ({_count(trainer)}) are not one per response token (response_lengths {n!r}, "
                          f"loss_masks {_count(mask)}): format 2 restores the trainer's log-probs to the whole "
                          "response; give the dump as slime wrote it, or the run's --save-debug-rollout-data dump")
    total = _plain(sample.get("total_lengths"))
    if total is not None and isinstance(tokens, list) and total != len(tokens):
        raise fail(where, f"total_lengths {brief(total)} is not the number of tokens ({len(tokens)}): give the dump "
                          "as slime wrote it")
    return slime_record({field: sample[column] for field, column in TRAIN_COLUMNS.items() if column in sample},
                        where, step, trainer=trainer)


TRAIN_PEEK_BYTES = 64
"""what `is_train_dump` reads of a dump's pickle: its protocol header, the dict's opening and its first key."""


def is_train_dump(path: Path) -> bool:
    """Whether a torch file is a train-data dump, read without loading it: `_build_dump_payload`'s dict has
    format_version as its first key, which pickles (in insertion order) within the first bytes of the zip's data.pkl,
    where a rollout dump's first key is rollout_id. A file that is no torch zip is not one (its reader says why)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            pickled = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
            if pickled is None:
                return False
            with z.open(pickled) as f:
                return b"format_version" in f.read(TRAIN_PEEK_BYTES)
    except (OSError, zipfile.BadZipFile):
        return False


def _nucleus(sample: dict, where: str, n: int) -> list[list[int]] | None:
    """The kept ids of each response token from slime's ragged pair (slime/utils/types.py: "For response token i,
    kept ids are rollout_top_p_token_ids[offsets[i]:offsets[i + 1]]"); None where the sample has none."""
    ids, offsets = _plain(sample.get("rollout_top_p_token_ids")), _plain(sample.get("rollout_top_p_token_offsets"))
    if ids is None and offsets is None:
        return None
    if not isinstance(ids, list) or not isinstance(offsets, list) or len(offsets) != n + 1 or offsets[0] != 0 \
            or offsets[-1] != len(ids) or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise fail(where, f"rollout_top_p_token_offsets ({_count(offsets)}) do not split rollout_top_p_token_ids "
                          f"({_count(ids)}) into {n} nuclei, one per response token (offsets start at 0, rise, and "
                          "end at the number of ids)")
    return [ids[a:b] for a, b in zip(offsets, offsets[1:])]


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
    """A tensor, numpy array or numpy scalar as nested lists or a Python number (what parse_record checks); anything
    else as it is."""
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, list) else x


def _count(x) -> str:
    return f"{len(x)} values" if isinstance(x, list) else repr(type(x).__name__)
