"""Bad input and faults, fifth pass (issue 59): what a recorded file, its header, a recorder, a config's IS-mode and a
signal can do. One test per class, each with the audit's instance and a variant; every refusal is one line naming the
file and the field (or the flag), exit 2, no traceback.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import bad_cli
from phantomclip.base.errors import PhantomclipError
from phantomclip.rollouts.readers import read_rollouts

TINY = ["--model", "tiny-random:0", "--trainer", "fp32"]
RECORD = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "logp_engine": [-1.0, -2.0]}


def _jsonl(path: Path, header: dict | None, *records: dict | str) -> Path:
    lines = ([json.dumps({"phantomclip_rollouts": 1, **header})] if header is not None else [])
    lines += [r if isinstance(r, str) else json.dumps(r) for r in records or (RECORD,)]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _read_error(path: Path) -> str:
    """The one RecordError line reading every record of `path` gives."""
    with pytest.raises(PhantomclipError) as e:
        _, records = read_rollouts(str(path))
        list(records)
    assert "\n" not in str(e.value)
    return str(e.value)


# ------------------------------------------------------------------------------------------------ 1: one header a file


@pytest.mark.parametrize("second, field", [({"quantization": "fp8"}, "engine.quantization 'fp8'"),
                                           ({"dtype": "float32"}, "engine.dtype 'fp32'"),
                                           ({"kv_cache_dtype": "fp8_e4m3"}, "engine.kv_cache_dtype 'fp8_e4m3'")])
def test_a_directorys_files_that_record_another_engine_are_refused_naming_both(tmp_path, capsys, second, field):
    """The audit's instance: a second file whose engine is FP8 (or fp32) was measured as the first file's bf16
    engine, exit 0. The same engine spelt another way (bf16 / bfloat16, kv 'auto' / unset) is one engine."""
    run = tmp_path / "run"
    run.mkdir()
    _jsonl(run / "step_1.jsonl", {"model": "m", "engine": {"dtype": "bfloat16"}})
    _jsonl(run / "step_2.jsonl", {"model": "m", "engine": {"dtype": "bf16", "kv_cache_dtype": "auto"}})
    _, records = read_rollouts(str(run))
    assert len(list(records)) == 2  # the same measurement: read on
    _jsonl(run / "step_3.jsonl", {"model": "m", "engine": {"dtype": "bfloat16", **second}})
    line = _read_error(run)
    want = field if "dtype 'fp32'" not in field else "engine.dtype 'fp32' differs from step_1.jsonl's 'bf16'"
    assert line.startswith(f"{run / 'step_3.jsonl'}: ") and want in line and "step_1.jsonl" in line, line
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(run)], capsys, after_progress=True)
    assert "step_3.jsonl" in line and field.split()[0] in line
    (run / "step_3.jsonl").unlink()
    _jsonl(run / "step_4.jsonl", {"model": "another", "engine": {"dtype": "bfloat16"}})  # another checkpoint
    assert "model 'another' differs from step_1.jsonl's 'm'" in _read_error(run)


# ------------------------------------------------------------------------------------------------ 5: malformed values


BIG = "9" * 400  # a whole number JSON reads as an int that no float holds (float() of it: OverflowError)


@pytest.mark.parametrize("text, fragment", [
    ('{"prompt_ids": [1], "completion_ids": [2], "logp_engine": [-%s]}' % BIG, "logp_engine[0] is a whole number"),
    ('{"prompt_ids": [1], "completion_ids": [2], "logp_engine": [-1], "advantage": %s}' % BIG, "advantage is a whole"),
    ('{"prompt_ids": [1], "completion_ids": [2], "logp_engine": [-1], "logprobs": ["raw"]}', 'logprobs = ["raw"]'),
    ('{"phantomclip_rollouts": 1, "logprobs": ["raw"]}', 'logprobs = ["raw"]'),
    ('{"phantomclip_rollouts": 1, "sampling": {"temperature": %s}}' % BIG, "sampling.temperature is a whole number"),
])
def test_a_malformed_value_is_one_line_naming_file_and_field(tmp_path, text, fragment):
    """The audit's instances: a 400-digit log-prob or advantage (OverflowError), `"logprobs": ["raw"]` in a record or
    a header (unhashable); the variant: a 400-digit temperature. Each goes through rollouts.record.number or the
    string check first."""
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n" + json.dumps(RECORD) + "\n")
    line = _read_error(path)
    assert line.startswith(f"{path}:1: ") and fragment in line, line


def _slime(tmp_path: Path, **changes) -> Path:
    sample = {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_log_probs": [-1.0, -2.0], "loss_mask": [1, 1],
              "weight_versions": ["7"], "status": "completed", **changes}
    path = tmp_path / "7.pt"
    torch.save({"rollout_id": 7, "samples": [sample]}, path)
    return path


@pytest.mark.parametrize("changes, fragment", [
    ({"loss_mask": 1}, "loss_mask = 1 is not a list"),
    ({"loss_mask": torch.tensor(1)}, "loss_mask = 1 is not a list"),
    ({"weight_versions": 5}, "weight_versions = 5 is not a list"),
    ({"weight_versions": ["²"]}, "weight_versions[0] = '²' is not a version number"),
    ({"weight_versions": ["9" * 5000]}, "weight_versions[0] = '99999"),
    ({"weight_versions": [{"v": 1}]}, "weight_versions[0] = {'v': 1} is not a version"),
])
def test_a_slime_dumps_malformed_field_is_one_line(tmp_path, changes, fragment):
    line = _read_error(_slime(tmp_path, **changes))
    assert line.startswith(f"{tmp_path / '7.pt'} sample 0: ") and fragment in line, line


def test_slime_weight_versions_read_as_numbers_and_names_are_left_out(tmp_path):
    """A tensor of versions reads as its numbers; SGLang's default name 'default' says nothing of the step."""
    for versions, want in ((torch.tensor([3, 5]), 5), (["4", "default"], 4), (["default"], None)):
        _, records = read_rollouts(str(_slime(tmp_path, weight_versions=versions)))
        assert next(records).record.weight_version == want


def test_an_empty_torch_file_and_parquet_metadata_that_is_no_object_are_one_line(tmp_path):
    empty = tmp_path / "0.pt"
    empty.write_bytes(b"")
    assert _read_error(empty) == f"{empty}: is empty (0 bytes): give the file --save-debug-rollout-data wrote"
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for meta, shown in (("5", "got 5"), ('["raw"]', 'got ["raw"]')):
        path = tmp_path / "own.parquet"
        pq.write_table(pa.Table.from_pylist([RECORD]).replace_schema_metadata({"phantomclip_rollouts": meta}), path)
        assert _read_error(path) == f"{path} metadata: the header must be a JSON object, {shown}"
    miles = tmp_path / "rollout_1.parquet"
    pq.write_table(pa.Table.from_pylist([{"tokens": [1, 2, 3], "response_length": 1, "rollout_log_probs": [-1.0],
                                          "loss_mask": 1}]), miles)
    assert "row 0: loss_mask = 1 is not a list" in _read_error(miles)


# ------------------------------------------------------------------------------------------------ 6: typed flags


@pytest.mark.parametrize("flag, recorded", [
    (["--engine-dtype", "fp32"], "engine.dtype 'bfloat16'"),
    (["--engine-quant", "fp8-kv"], "engine.quantization 'fp8'"),
    (["--logprobs-mode", "processed"], "logprobs 'raw'"),
    (["--temperature", "0.5"], "temperature 1"),
])
def test_a_typed_flag_the_file_contradicts_is_refused_naming_both(tmp_path, capsys, flag, recorded):
    """The audit's instance: --engine-dtype fp32 against a file that records bf16 measured bf16 without a word;
    likewise --engine-quant and --logprobs-mode, while --temperature was refused: one rule for all."""
    path = _jsonl(tmp_path / "r.jsonl", {"engine": {"dtype": "bfloat16", "quantization": "fp8"},
                                         "sampling": {"temperature": 1.0}})
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(path), *flag], capsys)
    assert line == (f"phantomclip diagnose: error: {' '.join(flag)}: {path} records {recorded}, the setting its "
                    "tokens were sampled with; drop the flag")


def test_a_typed_flag_equal_to_the_files_value_is_taken(tmp_path):
    """The same settings spelt the file's way or another (bf16 for bfloat16, fp8-w8a8 for vLLM's 'fp8') pass the
    check; the settings come from the file either way."""
    from phantomclip.diagnose.config import DiagnoseConfig
    from phantomclip.diagnose.recorded import peek, recorded_config

    path = _jsonl(tmp_path / "r.jsonl", {"engine": {"dtype": "bfloat16", "quantization": "fp8"}})
    cfg = DiagnoseConfig(rollouts=str(path), engine_dtype="bf16", engine_quant="fp8-w8a8", logprobs_mode="raw",
                         typed_flags=["engine_dtype", "engine_quant", "logprobs_mode"])
    got, _ = recorded_config(cfg, peek(str(path)))
    assert (got.engine_dtype, got.engine_quant, got.logprobs_mode) == ("bf16", "fp8-w8a8", "raw")
    bare = _jsonl(tmp_path / "bare.jsonl", None)  # nothing recorded: the typed flags fill it, said in a note
    got, notes = recorded_config(DiagnoseConfig(rollouts=str(bare), engine_dtype="fp32", engine_quant="fp8-kv",
                                                typed_flags=["engine_dtype", "engine_quant"]), peek(str(bare)))
    assert (got.engine_dtype, got.engine_quant) == ("fp32", "fp8-kv")
    assert "the engine's FP8 arguments are not recorded: measured with --engine-quant fp8-kv" in notes
