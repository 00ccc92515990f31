"""Bad input and faults, fifth pass: what a recorded file, its header, a recorder, a config's IS-mode and a
signal can do. One test per class, each with the audit's instance and a variant; every refusal is one line naming the
file and the field (or the flag), exit 2, no traceback.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SIGNAL_AT, bad_cli
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
    engine, exit 0. The same engine spelt another way (bf16 / bfloat16, kv 'auto' / unset) is one engine; another
    model name (each step of a run is sampled by its own checkpoint) or no recorded dtype is no contradiction."""
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
    # another checkpoint's step, and a file that records no dtype: a run's directory (the post-mortem's input), read
    _jsonl(run / "step_4.jsonl", {"model": "checkpoint-4", "engine": {"dtype": "bfloat16"}})
    _jsonl(run / "step_5.jsonl", {"model": "", "engine": {}})
    _, records = read_rollouts(str(run))
    assert len(list(records)) == 4


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
    a header (unhashable); the variant: a 400-digit temperature. Each goes through rollouts.record._number or the
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
    ({"loss_mask": 1}, "loss_mask must be one 0 or 1 per completion token (2), got 1"),
    ({"loss_mask": torch.tensor(1)}, "loss_mask must be one 0 or 1 per completion token (2), got 1"),
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
    assert "row 0: loss_mask must be one 0 or 1 per completion token (1), got 1" in _read_error(miles)


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


# ------------------------------------------------------------------------------------------------ 3: --save-rollouts


def test_save_rollouts_is_checked_with_json_before_sampling(tmp_path, capsys):
    """The audit's instances: `--save-rollouts x --json x` left the JSON in x and the rollouts gone; an unwritable
    path was refused only after sampling. Variants: the same file spelt ./x, or reached through a hard link. One line
    before any work (bad_cli: nothing else on stderr, no progress line)."""
    x = tmp_path / "x"
    line = bad_cli(["diagnose", *TINY, "--save-rollouts", str(x), "--json", str(x)], capsys)
    assert line == (f"phantomclip diagnose: error: --save-rollouts {x} and --json {x} name the same file: the one "
                    "written last would replace the other; give --save-rollouts another path")
    x.write_text("{}")
    os.link(x, tmp_path / "y")
    line = bad_cli(["diagnose", *TINY, "--save-rollouts", f"{tmp_path}/./x", "--json", str(tmp_path / "y")], capsys)
    assert "name the same file" in line
    line = bad_cli(["diagnose", *TINY, "--save-rollouts", str(x / "under-a-file.jsonl")], capsys)
    assert line.startswith(f"phantomclip diagnose: error: --save-rollouts cannot write {x / 'under-a-file.jsonl'}")
    from phantomclip.base.files import check_distinct_outputs

    check_distinct_outputs({"--json": os.devnull, "--save-rollouts": os.devnull})  # /dev/null takes both


WRITE_INTO_STDOUT = """
import sys
from phantomclip.rollouts.record import Header, Record, write_records
print("the rendered result")
write_records("/dev/stdout", Header(source="s"), [Record([1], [2], [-0.5])])
print("wrote /dev/stdout")
"""


@pytest.mark.parametrize("flag", ["--json", "--save-rollouts"])
def test_a_path_nothing_can_be_written_to_is_refused_before_sampling(flag, capsys):
    """/proc/nope/x passed the check as root (a /proc path was taken for a descriptor to write into, and os.access
    says yes to root everywhere) and failed after the whole run: now one line before any work."""
    from phantomclip.base.files import _can_create_in

    line = bad_cli(["diagnose", *TINY, flag, "/proc/nope/x"], capsys)
    assert line.endswith(f"{flag} cannot write /proc/nope/x: nothing under /proc is there to write into; choose "
                         "another location"), line
    assert not _can_create_in(Path("/proc"))  # the probe, where os.access(W_OK) says yes to root


def test_save_rollouts_into_a_redirected_stdout_keeps_what_was_printed(tmp_path):
    """The audit's instance: `--save-rollouts /dev/stdout > f` reopened f at offset 0 and wrote over what was printed
    before (or the records were written over after). The records are written into the descriptor itself, after what
    was printed, as --json does (files.atomic_write_bytes)."""
    out = tmp_path / "f"
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-c", WRITE_INTO_STDOUT], stdout=f, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert lines[0] == "the rendered result" and lines[-1] == "wrote /dev/stdout" and len(lines) == 4
    assert json.loads(lines[1])["source"] == "s" and json.loads(lines[2])["logp_engine"] == [-0.5]


def test_a_users_file_is_never_replaced_and_an_earlier_output_is_with_a_word(tmp_path, capsys):
    """A file phantomclip did not write is refused before any work, for --save-rollouts and --json alike, and left as
    it was; an earlier rollout file (its header's first key) is replaced whole, and the line that says it was
    written says so; a new path says nothing more."""
    from phantomclip.cli.main import main

    old, new, mine = tmp_path / "old.jsonl", tmp_path / "new.json", tmp_path / "notes.txt"
    mine.write_text("a user's file\n")
    for flag in ("--save-rollouts", "--json"):
        line = bad_cli(["diagnose", *TINY, flag, str(mine)], capsys)
        assert line.endswith(f"error: {flag} {mine}: a file phantomclip did not write is there and is never "
                             "replaced: remove it first or choose another path"), line
    assert mine.read_text() == "a user's file\n"
    old.write_text('{"phantomclip_rollouts": 1, "source": "an earlier run"}\n')
    assert main(["diagnose", *TINY, "--n", "2", "--max-tokens", "2", "--no-batch-invariance", "--framework", "trl",
                 "--save-rollouts", str(old), "--json", str(new)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == [f"wrote {new}", f"wrote {old} (it replaced the file that was there)"]
    assert json.loads(old.read_text().splitlines()[0])["phantomclip_rollouts"] == 1


# ------------------------------------------------------------------------------------------------ 10: SIGTERM



@pytest.mark.parametrize("module, said", [("torch", "phantomclip: terminated"),
                                          ("diagnose.job", "phantomclip diagnose: terminated")])
def test_sigterm_is_one_line_and_143(module, said):
    """The audit's instance: SIGTERM ended a run with no line (rc -15). At start-up (torch importing) and in the
    command (its own imports): one line and 143, as Ctrl-C gives 130."""
    done = subprocess.run([sys.executable, "-c", SIGNAL_AT, module, "SIGTERM"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143 and done.stderr.strip() == said, (done.returncode, done.stderr[-2000:])


KILL_INSIDE_THE_WRITE = """
import os, signal, sys
from phantomclip.base import files
from phantomclip.base.console import Terminated, terminate_as_interrupt
real = os.fsync
def term_then_sync(fd):  # the temp file is written and not yet renamed: the moment a kill strands it
    os.kill(os.getpid(), signal.SIGTERM)
    real(fd)
os.fsync = term_then_sync
with terminate_as_interrupt():
    try:
        files.write_json({"a": 1}, sys.argv[1])
    except Terminated:
        sys.exit(143)
"""


def test_sigterm_inside_an_atomic_write_leaves_no_temp_file(tmp_path):
    """The audit's instance: a kill inside an atomic write left `.NAME.XXXX.tmp` beside the target (SIGINT removed
    it). Terminated runs the write's `finally`, as KeyboardInterrupt does; the old file stays whole."""
    target = tmp_path / "out.json"
    target.write_text('{"old": 1}')
    done = subprocess.run([sys.executable, "-c", KILL_INSIDE_THE_WRITE, str(target)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"] and target.read_text() == '{"old": 1}'


# ------------------------------------------------------------------------------------------------ 12: lost output


@pytest.mark.parametrize("buffered", [True, False])
def test_output_lost_to_a_full_disk_is_one_line_and_not_0(buffered):
    """The audit's instances: `--version > /dev/full` and `diagnose --help > /dev/full` exited 0 with nothing
    written. Buffered (the default) the text waits in stdout's buffer until the exit; unbuffered (PYTHONUNBUFFERED)
    argparse's own write fails, and argparse swallowed that."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({} if buffered else
                                                                              {"PYTHONUNBUFFERED": "1"})
    for args in (["--version"], ["diagnose", "--help"]):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-c", "import sys; from phantomclip.cli.main import main; "
                                   "sys.exit(main())", *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                  env=env, timeout=120)
        assert done.returncode == 2, (args, done.returncode, done.stderr[-2000:])
        assert done.stderr == ("phantomclip: error: cannot write stdout (No space left on device): free some space or "
                               "redirect stdout elsewhere\n")


def test_a_file_name_with_a_newline_stays_on_one_line(tmp_path, capsys):
    """The audit's instance: a file name's newline printed raw split the one error line; variant: an ESC sequence."""
    for name in ("a\nverdict: OK.jsonl", "b\x1b[2J.jsonl"):
        line = bad_cli(["diagnose", *TINY, "--rollouts", str(tmp_path / name)], capsys)
        shown = name.replace("\n", "\\x0a").replace("\x1b", "\\x1b")
        assert line == f"phantomclip diagnose: error: {tmp_path}/{shown}: cannot be read (No such file or directory)"


# ------------------------------------------------------------------------------------------------ 7: recorders


def test_recorders_refuse_what_diagnose_refuses_when_built(tmp_path):
    """The audit's instances: record_vllm(dtype='fp8'), quantization='awq'; the recorders built with
    engine_dtype 'fp8' / 'int4' or out_dir '/dev/null/x'; staleness_bound(max_staleness=-3) returned -1; a ratio
    ['shadow'] was a bare TypeError; a weight version '²' a bare ValueError. Each one line, a PhantomclipError."""
    from types import SimpleNamespace

    from phantomclip.integrations.recorders import AsyncRolloutRecorder, RolloutRecorder, _vllm_version, record_vllm
    from phantomclip.integrations.trl_async.ratio import resolve
    from phantomclip.integrations.trl_async.versions import staleness_bound

    cases = [(lambda: record_vllm([], tmp_path / "r.jsonl", dtype="fp8"), "record_vllm: dtype 'fp8' is not one"),
             (lambda: record_vllm([], tmp_path / "r.jsonl", dtype="bf16", quantization="awq"),
              "record_vllm: quantization 'awq' is not one diagnose reads: give one of fp8, "),
             (lambda: RolloutRecorder(tmp_path, engine_dtype="fp8"), "RolloutRecorder: dtype 'fp8'"),
             (lambda: AsyncRolloutRecorder(tmp_path, engine_dtype="int4"), "AsyncRolloutRecorder: dtype 'int4'"),
             (lambda: RolloutRecorder("/dev/null/x"), "RolloutRecorder out_dir /dev/null/x: cannot use it"),
             (lambda: AsyncRolloutRecorder("/dev/null/x"), "AsyncRolloutRecorder out_dir /dev/null/x"),
             (lambda: staleness_bound(SimpleNamespace(max_staleness=-3, gradient_accumulation_steps=1,
                                                      weight_sync_steps=1)),
              "staleness_bound: max_staleness must be a whole number >= 0, got -3"),
             (lambda: resolve(["shadow"]), "ratio must be one of trust-region, shadow, decoupled")]
    for call, fragment in cases:
        with pytest.raises(PhantomclipError) as e:
            call()
        assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert _vllm_version(SimpleNamespace(weight_versions=[SimpleNamespace(version="²")])) is None
    assert _vllm_version(SimpleNamespace(weight_versions=[SimpleNamespace(version="12")])) == 12
    RolloutRecorder(tmp_path / "new", engine_dtype="bf16")  # the vocabulary diagnose reads: accepted


# ------------------------------------------------------------------------------------------------ 9, 11: configs


def test_config_typos_and_ranges_are_refused_in_the_configs_words(tmp_path, capsys):
    """9: verl's `rollout_is: tokn` (verl raises at its first step) was a note judged as no correction; TRL's typo was
    refused. 11: a TRL vllm_importance_sampling_clip_max of -1 was refused as '--seq-mask-cap must be ...'; the
    variant: verl's rollout_is_threshold 0 and TRL's epsilon 1.5."""
    cases = [("--from-verl-config", "algorithm:\n  rollout_correction:\n    rollout_is: tokn\n",
              "algorithm.rollout_correction.rollout_is 'tokn' is not one of verl's (null, token, sequence): verl "
              "refuses it at its first step"),
             ("--from-trl-config", "vllm_importance_sampling_clip_max: -1\n",
              "vllm_importance_sampling_clip_max must be a finite number >= 1, got -1.0"),
             ("--from-verl-config", "algorithm:\n  rollout_correction:\n    rollout_is: token\n"
              "    rollout_is_threshold: 0\n",
              "algorithm.rollout_correction.rollout_is_threshold must be a finite number >= 1, got 0.0"),
             ("--from-trl-config", "epsilon: 1.5\n", "epsilon must be a finite number > 0 and < 1, got 1.5")]
    for flag, text, fragment in cases:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        line = bad_cli(["diagnose", flag, str(path)], capsys)
        assert line == f"phantomclip diagnose: error: {flag} {path}: {fragment}", line


def test_an_async_trl_config_says_its_importance_sampling_fields_are_not_read(tmp_path):
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    settings, notes = diagnose_settings_from_trl({"max_staleness": 2, "vllm_importance_sampling_mode": "token_mask"})
    assert settings["setup"] == "trl-async" and "is_mode" not in settings
    assert any(n.startswith("vllm_importance_sampling_mode: not read; AsyncGRPOConfig has no vLLM importance-sampling "
                            "correction") for n in notes), notes
