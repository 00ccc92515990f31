"""The fourth adversarial pass, one test per class of fault, each with the audit's instance and a variant: config
files that expand without bound, links inside the directories phantomclip writes, two jobs on one run, values read
silently as something else, history from another run, gate keys the result has, unbounded sizes, and start-up.

`bad_cli` (conftest) runs the CLI in-process and asserts exit 2, one stderr line and no traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import SIGNAL_AT, bad_cli, over
from phantomclip.base.errors import ConfigError
from phantomclip.cli.main import main
from phantomclip.integrations.configs.load import EXPANSION_LIMIT
from phantomclip.integrations.configs.trl import diagnose_settings_from_trl
from phantomclip.integrations.configs.verl import diagnose_settings_from_verl

TINY = ["--model", "tiny-random"]


def _no_model_work(monkeypatch):
    """Any model load fails the test: a case that passes refused its input before loading anything."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("phantomclip.models.load.check_vocab", loaded)


# ------------------------------------------------------------------------------ 1. YAML aliases without bound


def _alias_bomb(levels: int, field: str) -> str:
    """A YAML document whose `field` (a dotted path, nested as mappings) is an alias of `levels` levels of nine
    aliases each: 9^levels leaves written in a few hundred bytes."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    *parents, leaf = field.split(".")
    body = f"{leaf}: *a{levels - 1}"
    for parent in reversed(parents):
        body = f"{parent}: {{{body}}}"
    return "\n".join(lines) + "\n" + body + "\n"


@pytest.mark.parametrize("flag,field", [("--from-trl-config", "min_p"),  # the audit's instance
                                        ("--from-verl-config", "actor_rollout_ref.rollout.name")])
def test_an_alias_bomb_is_one_line_before_any_value_is_used(flag, field, tmp_path, capsys, monkeypatch):
    """9^9 leaves in about 500 bytes: refused while the document is composed, naming the file and the alias in the
    first node past EXPANSION_LIMIT. Counting every list and scalar: a0 holds 1 + 9 = 10 values, a_i 1 + 9 a_(i-1):
    a4 66,430, a5 597,871 > 100,000, so the line of a5 (line 6, nine *a4) is the one named."""
    _no_model_work(monkeypatch)
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9, field))
    assert path.stat().st_size < 600
    t0 = time.perf_counter()
    line = bad_cli(["diagnose", *TINY, flag, str(path)], capsys)
    assert time.perf_counter() - t0 < 20  # it ran past 60 s; composing 600 bytes takes milliseconds
    assert line == (f"phantomclip diagnose: error: {flag} {path}: the alias *a4 (line 6) expands to more than "
                    f"{EXPANSION_LIMIT:,} values (an alias bomb, not a trainer config): write the values out")


def test_an_alias_under_the_bound_is_read_and_a_value_is_shown_briefly(tmp_path):
    """An ordinary anchor is read as written; a field aliased to 9^4 = 6,561 leaves (about 15,700 values in the
    document, under the bound) that is not what the field holds is refused in a line showing a few dozen characters
    of the value, not its 33 kB repr."""
    ok = tmp_path / "ok.yaml"
    ok.write_text("t: &t 0.7\ntemperature: *t\ntop_p: *t\n")
    settings, _ = diagnose_settings_from_trl(ok)
    assert (settings["temperature"], settings["top_p"]) == (0.7, 0.7)
    for field, fragment in (("model_name_or_path", "model_name_or_path is a list"), ("min_p", "min_p is [[[[")):
        path = tmp_path / f"{field}.yaml"
        path.write_text(_alias_bomb(4, field))
        with pytest.raises(ConfigError) as e:
            diagnose_settings_from_trl(path)
        assert fragment in str(e.value) and len(str(e.value)) < 300, str(e.value)[:400]


# ------------------------------------------------------------------- 4. values read as something else, unsaid


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_vllm_own_names_select_their_quantisers_and_an_unknown_one_is_unjudged(tmp_path):
    """vLLM's own spellings map to the recipes they select (fp8_vllm.VLLM_ARGS read backwards); a setting vLLM takes
    that no recipe emulates is said and leaves the result unjudged; one phantomclip's reader owns is refused."""
    cases = {"vllm_kwargs: {quantization: fp8_per_channel}": "fp8-w8a8-channel",  # the audit's instance
             "vllm_kwargs: {quantization: fp8_per_block, kv_cache_dtype: fp8_e4m3}": "fp8-block,fp8-kv",
             "quantization: fp8_per_tensor": "fp8-w8a8"}
    for text, quant in cases.items():
        assert diagnose_settings_from_trl(_yaml(tmp_path, text))[0]["engine_quant"] == quant, text
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "vllm_kwargs: {quantization: awq}\n"))
    assert "engine_quant" not in settings and settings["unmapped"] == "vLLM vllm_kwargs.quantization 'awq'"
    assert any("'awq': not a setting phantomclip emulates" in n for n in notes)
    refused = {"vllm_kwargs: [quantization, fp8]": "vllm_kwargs is a list (['quantization', 'fp8']), not a mapping",
               "vllm_dtype: 0": "vllm_dtype is a number (0), not a name",  # was bf16, unsaid
               "vllm_dtype: fp8": "vllm_dtype 'fp8' is not a dtype",
               "vllm_importance_sampling_mode: token_clip": "is not one of TRL's",
               "model_init_kwargs: [dtype, float16]": "model_init_kwargs is a list"}
    for text, fragment in refused.items():
        with pytest.raises(ConfigError, match=None) as e:
            diagnose_settings_from_trl(_yaml(tmp_path, text + "\n"))
        assert fragment in str(e.value), (text, str(e.value))


def test_trainer_dtypes_and_repeated_keys_are_said(tmp_path):
    """model_init_kwargs dtype float16 under TRL's default bf16 autocast is a mix no recipe measures (was judged
    as bf16-autocast unsaid); with bf16 off it is the fp16 recipe. A key given twice: a note for TRL (PyYAML keeps
    the last), refused for verl (OmegaConf refuses it)."""
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "model_init_kwargs: {dtype: float16}\n"))
    assert settings["unmapped"].startswith("model_init_kwargs.dtype float16") and any("float16 with bf16" in n
                                                                                      for n in notes)
    settings, _ = diagnose_settings_from_trl(_yaml(tmp_path, "model_init_kwargs: {dtype: float16}\nbf16: false\n"))
    assert settings["trainer"].startswith("fp16,") and "unmapped" not in settings
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "epsilon: 0.1\nepsilon: 0.3\n"))
    assert settings["epsilon"] == 0.3 and "key 'epsilon' given twice (lines 1 and 2): TRL's YAML reader" in notes[0]
    with pytest.raises(ConfigError, match=r"key 'data' given twice \(lines 1 and 3\): give each key once"):
        diagnose_settings_from_verl(_yaml(tmp_path, "data: {max_response_length: 8}\nalgorithm: {}\n"
                                                    "data: {max_response_length: 4096}\n"))


@pytest.mark.parametrize("block,fragment", [
    ("rollout_rs: [token_k1], rollout_rs_threshold: 2.0", "rollout_rs is a list (['token_k1']), not a name"),
    ("rollout_rs: token_k1, rollout_rs_threshold: '0.5_1_5'", "rollout_rs_threshold '0.5_1_5': expected UPPER or"),
    ("rollout_is: token, rollout_is_threshold: '1_5'", "rollout_is_threshold is '1_5', not a number"),
    ("rollout_rs: token_k1, rollout_rs_threshold: [2.0]", "rollout_rs_threshold is [2.0]: give UPPER"),
    ("bypass_mode: 'false'", "bypass_mode is 'false', not true or false"),
])
def test_verl_correction_fields_of_the_wrong_shape_are_refused(block, fragment, tmp_path):
    """rollout_rs_threshold '0.5_1_5' was read as lower 0.5, upper 15, and rollout_is_threshold '1_5' as 15
    (float() takes '1_5'); a list of options was a note about an option named "['token_k1']"."""
    with pytest.raises(ConfigError) as e:
        diagnose_settings_from_verl(_yaml(tmp_path, f"algorithm: {{rollout_correction: {{{block}}}}}\n"))
    assert fragment in str(e.value), str(e.value)
    band = diagnose_settings_from_verl(_yaml(tmp_path, "algorithm: {rollout_correction: {rollout_rs: token_k1, "
                                                       "rollout_rs_threshold: '0.5_2.0'}}\n"))[0]
    assert (band["icepop_low"], band["icepop_high"]) == (0.5, 2.0)  # r in [1/upper, 1/lower]


def test_a_typed_trainer_keeps_an_unmapped_engine_unjudged(tmp_path, capsys):
    """--trainer typed over a verl config whose rollout dtype is unmapped: the trainer's reading is moot, the
    engine's is not, so the answer still says 'not judged' (was: judged as if the engine were bf16)."""
    path = _yaml(tmp_path, "actor_rollout_ref: {rollout: {dtype: int8}, actor: {fsdp_config: {dtype: int4}}}\n")
    out = tmp_path / "d.json"
    assert main(["diagnose", *TINY, "--n", "2", "--max-tokens", "2", "--trainer", "fp32", "--from-verl-config",
                 str(path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["unmapped"] == "actor_rollout_ref.rollout.dtype 'int8'"
    assert result["answer"]["status"] == "not judged"


def test_an_empty_list_of_quantisers_or_interventions_is_refused(capsys, monkeypatch):
    """--engine-quant ',' ran an engine without FP8; --intervention ',' ran the baseline."""
    _no_model_work(monkeypatch)
    for command in ("train", "diagnose"):
        line = bad_cli([command, *TINY, "--engine-quant", ","], capsys)
        assert line.startswith(f"phantomclip {command}: error: --engine-quant: ',' names no quantiser: give one")
    line = bad_cli(["train", *TINY, "--intervention", " , "], capsys)
    assert "--intervention ' , ' names no intervention" in line


def test_the_async_monitor_refuses_a_negative_staleness(tmp_path):
    import trl_async_setup as setup
    from phantomclip.base.errors import IntegrationError
    from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor

    trainer, _ = setup.make_trainer(str(tmp_path / "x"), steps=1)
    for name, value in (("max_staleness", -1), ("weight_sync_steps", 0)):
        good = getattr(trainer.args, name)
        setattr(trainer.args, name, value)
        with pytest.raises(IntegrationError, match=f"{name} must be a whole number >= "):
            AsyncPrecisionMonitor().attach(trainer)
        setattr(trainer.args, name, good)


# --------------------------------------------------------------- 2. links inside the directories phantomclip owns

T = ["train", *TINY, "--steps", "2", "--group-size", "2", "--max-tokens", "4", "--checkpoint-every", "1"]


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its bytes (what a refused command must leave as it was)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_linked_snapshots_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    """`train --resume` where snapshots/ is a link to another directory wrote its snapshot files there; the link
    is refused before any file of the run is read or rewritten (the audit's instance). Variant: a link deeper down,
    a snapshot file linked to a user's file, is refused and the file left as it was."""
    import os
    import stat

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    assert main([*T, "--keep-snapshots", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    umask = os.umask(0)
    os.umask(umask)
    # every file written beneath the run gets the usual permissions, whatever the writer did to its temp file
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    assert modes and set(modes.values()) == {0o666 & ~umask}, modes
    (run / "snapshots").rename(elsewhere)
    (run / "snapshots").symlink_to(elsewhere, target_is_directory=True)
    before, theirs = _tree(run), _tree(elsewhere)
    line = bad_cli(over(T, "--keep-snapshots", "1", "--out", str(run), "--resume", "--steps", "3"), capsys)
    assert line == (f"phantomclip train: error: {run / 'snapshots'} is a symbolic link, where phantomclip keeps a "
                    "directory of its own: it writes and reads through no link it did not make; remove the link")
    assert _tree(run) == before and _tree(elsewhere) == theirs
    (run / "snapshots").unlink()
    (run / "snapshots").mkdir()
    user = tmp_path / "notes.txt"
    user.write_text("mine\n")
    (run / "snapshots" / "step-000003.safetensors").symlink_to(user)  # the snapshot step 3 writes
    line = bad_cli(over(T, "--keep-snapshots", "1", "--out", str(run), "--resume", "--steps", "3"), capsys,
                   after_progress=True)
    assert "step-000003.safetensors is a symbolic link, where phantomclip keeps a file of its own" in line, line
    assert user.read_text() == "mine\n"


def test_report_and_experiment_refuse_a_link_at_any_depth(tmp_path, capsys):
    """`report --out R` where R/data is a link, and `experiment --out X` where X/none (or X/none/seed-0) is one:
    refused, nothing written through them (the audit's instances; the seed directory is the variant)."""
    target = tmp_path / "target"
    target.mkdir()
    report = tmp_path / "R"
    report.mkdir()
    (report / "data").symlink_to(target, target_is_directory=True)
    line = bad_cli(["report", "--out", str(report)], capsys, after_progress=True)  # after the note on the demo
    assert line.startswith(f"phantomclip report: error: {report / 'data'} is a symbolic link, where phantomclip keeps "
                           "a directory of its own")
    assert list(target.iterdir()) == [] and not (report / "index.html").exists()
    for linked in ("none", "none/seed-0"):
        out = tmp_path / f"X-{linked.replace('/', '-')}"
        (out / linked).parent.mkdir(parents=True, exist_ok=True)
        (out / linked).symlink_to(target, target_is_directory=True)
        line = bad_cli(["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "1",
                        "--group-size", "2", "--max-tokens", "2", "--out", str(out)], capsys)
        assert line == (f"phantomclip experiment: error: {out / linked} is a symbolic link, where phantomclip keeps a "
                        "directory of its own: it writes and reads through no link it did not make; remove the link")
        assert list(target.iterdir()) == [] and not (out / "experiment.json").exists()


@pytest.mark.parametrize("kind", ["hard link", "user text"])
def test_a_lock_file_phantomclip_did_not_make_is_refused_and_left_alone(kind, tmp_path, capsys):
    """A .lock that is a hard link to a user's file: the file held a PID afterwards (the audit's instance). A
    regular .lock holding text other than a pid (a user's own file of that name) is the variant."""
    out = tmp_path / "run"
    out.mkdir()
    user = tmp_path / "notes.txt"
    user.write_text("my notes\n")
    if kind == "hard link":
        (out / ".lock").hardlink_to(user)
        said = "has 2 hard links (another name's file would change with it), where phantomclip keeps its lock file"
    else:
        (out / ".lock").write_text("my notes\n")
        said = "holds 'my notes', not the process id phantomclip writes in its lock file"
    line = bad_cli([*T, "--out", str(out)], capsys)
    assert said in line, line
    assert user.read_text() == "my notes\n" and (out / ".lock").read_text() == "my notes\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


# -------------------------------------------------------------------------------- 3. two jobs on one run

HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
if sys.argv[2] == "exclusive":  # what DirLock does: the pid in the file, the lock exclusive
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "exclusive" else fcntl.LOCK_SH)
print("locked", flush=True)
time.sleep(120)
"""


def _hold(lock: Path, how: str):
    """Another process holding `lock` (exclusively, as a running experiment does, or shared, as a job training one
    of its runs does) until killed."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), how], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_run_of_a_running_experiment_is_not_trained_by_another_job(tmp_path, capsys):
    """`train --resume EXP/none/seed-0` while the experiment in EXP runs (another process holds EXP/.lock): both
    proceeded (the audit's instance); now the resume is refused, naming the experiment and its pid, and the run is
    untouched. Variant: while a job trains one of its runs, the experiment itself is refused. Once the other
    process is gone, each proceeds (the lock is free at once)."""
    exp = tmp_path / "EXP"
    run = exp / "none" / "seed-0"
    exp.mkdir()
    (exp / "experiment.json").write_text('{"experiment": "sanity", "arms": ["none"], "seeds": [0]}')
    assert main([*T, "--out", str(run)]) == 0  # a run inside the experiment's directory, made by hand
    capsys.readouterr()
    before = _tree(run)
    holder = _hold(exp / ".lock", "exclusive")
    try:
        line = bad_cli(over(T, "--out", str(run), "--resume", "--steps", "3"), capsys)
    finally:
        holder.kill()
        holder.wait()
    assert line == (f"phantomclip train: error: {run} belongs to the experiment in {exp}, which another phantomclip "
                    f"process (pid {holder.pid}) is running: wait for it to finish, or stop it first")
    assert _tree(run) == before
    experiment = ["experiment", "sanity", *TINY, "--only", "none", "--seeds", "1", "--steps", "3", "--group-size",
                  "2", "--max-tokens", "4", "--out", str(exp)]
    holder = _hold(exp / ".lock", "shared")
    try:
        line = bad_cli(experiment, capsys)
    finally:
        holder.kill()
        holder.wait()
    assert line == (f"phantomclip experiment: error: {exp} is in use by another phantomclip process training a run "
                    "of this experiment: wait for it to finish, or stop it first")
    assert _tree(run) == before
    assert main(over(T, "--out", str(run), "--resume", "--steps", "3")) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_the_report_honours_a_run_being_written(tmp_path, capsys):
    """`report --from RUN` while another process writes RUN (holds its lock): the page draws the steps logged so far
    and says so in one warning line naming the writer; once it is gone, no warning. The report's probe takes no
    lock a writer would keep waiting on, and writes nothing into the run."""
    run = tmp_path / "run"
    assert main([*T, "--out", str(run)]) == 0
    capsys.readouterr()
    before = _tree(run)
    holder = _hold(run / ".lock", "exclusive")
    try:
        assert main(["report", "--from", str(run), "--out", str(tmp_path / "R")]) == 0
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert (f"phantomclip report: warning: {run} is being written (phantomclip process {holder.pid}): the page draws "
            "the 2 steps it has logged so far") in err, err
    assert (run / ".lock").read_text() == str(holder.pid) and {k: v for k, v in _tree(run).items() if k != ".lock"} \
        == {k: v for k, v in before.items() if k != ".lock"}
    assert main(["report", "--from", str(run), "--out", str(tmp_path / "R")]) == 0
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ 5. history from another run


def test_rows_copied_from_another_run_are_refused(tmp_path, capsys):
    """metrics.jsonl of another run (another intervention, the same two steps) copied in was continued from (the
    audit's instance); every row carries its run's id (run/id, from config.json), so the resume is refused naming
    the line and nothing is rewritten. Variants: a copied tokens.jsonl on resume, and the copied metrics read back
    as an experiment reads a finished run, and by the report."""
    from phantomclip.runs.checks import RunFileError
    from phantomclip.runs.rundir import RunDir

    own, other = tmp_path / "own", tmp_path / "other"
    assert main([*T, "--out", str(own)]) == 0
    assert main([*T, "--intervention", "tis", "--out", str(other)]) == 0
    capsys.readouterr()
    ids = {json.loads(line)["run/id"] for p in (own, other) for line in (p / "metrics.jsonl").read_text().splitlines()}
    assert len(ids) == 2  # one id per run, on every row
    for name in ("metrics.jsonl", "tokens.jsonl"):
        mine = (own / name).read_bytes()
        (own / name).write_bytes((other / name).read_bytes())
        before = _tree(own)
        line = bad_cli(over(T, "--out", str(own), "--resume", "--steps", "3"), capsys)
        assert line.startswith(f"phantomclip train: error: {own / name}, line 1: a row of another run (run/id "), line
        assert line.endswith("the file was copied from another run; restore this run's, or start a new --out"), line
        assert _tree(own) == before
        if name == "metrics.jsonl":
            with pytest.raises(RunFileError, match="line 1: a row of another run"):
                RunDir(own).metrics()
            line = bad_cli(["report", "--from", str(own), "--out", str(tmp_path / "R")], capsys)
            assert f"{own / name}, line 1: a row of another run" in line, line
        (own / name).write_bytes(mine)
    assert main(over(T, "--out", str(own), "--resume", "--steps", "3")) == 0


# ------------------------------------------------------------------------------------- 8. start-up and order


def test_a_model_folder_is_never_taken_for_a_run(tmp_path, capsys):
    """`train --out` on a Hugging Face model folder said it 'already holds a run' (its config.json); it says what it
    is, for a new run (the audit's instance) and for --resume (the variant, which read the model's config.json as
    the run's flags), and the folder is left as it was."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "hidden_size": 64, "max_tokens": 7}))
    before = _tree(folder)
    said = (f"{folder} holds a config.json that is not a phantomclip run's (no versions.phantomclip: a model's "
            "folder?): give a run directory, or another --out")
    assert bad_cli([*T, "--out", str(folder)], capsys) == f"phantomclip train: error: {said}"
    assert bad_cli([*T, "--resume", str(folder)], capsys) == f"phantomclip train: error: {said}"
    assert _tree(folder) == before


# ------------------------------------------------------------- 6. gate keys the result has, refusals before work


def _documented_gate_roots() -> list[str]:
    """The top-level keys docs/metrics.md's CI gate section names (the bullet citing gates.DIAGNOSE_KEYS)."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text(encoding="utf-8")
    listed = text.split("(`gates.DIAGNOSE_KEYS`):", 1)[1].split("Any other start", 1)[0]
    return [k for k in re.findall(r"`([a-z_0-9-]+)`", listed) if not k.startswith("-")]


def test_every_key_the_json_and_the_docs_name_is_a_gate_root(tmp_path, capsys, monkeypatch):
    """`--fail-if 'fp8.beta_quant.outside_trust_region>=0'` with --engine-quant was refused ('no figure starts with
    fp8') though the result has it (the audit's instance): one key table, gates.DIAGNOSE_KEYS, equal to the
    docs' list and holding every top-level key of real results (with --engine-quant and --drift, which add keys).
    Variant: a key the run's settings leave out (fp8.* without --engine-quant) is refused before any model loads."""
    from phantomclip.diagnose.gates import DIAGNOSE_KEYS

    assert _documented_gate_roots() == list(DIAGNOSE_KEYS)
    out = tmp_path / "d.json"
    code = main(["diagnose", *TINY, "--n", "2", "--max-tokens", "4", "--engine-quant", "fp8-w8a8", "--drift", "1",
                 "--json", str(out), "--fail-if", "fp8.beta_quant.outside_trust_region>=0"])
    err = capsys.readouterr().err
    result = json.loads(out.read_text())
    share = result["fp8"]["beta_quant"]["outside_trust_region"]
    assert code == 1 and f"gate failed: fp8.beta_quant.outside_trust_region = {share:g}, bound: >= 0" in err, err
    assert set(result) <= set(DIAGNOSE_KEYS) and {"fp8", "drift"} <= set(result)
    _no_model_work(monkeypatch)
    for gate, needs in (("fp8.beta_quant.outside_trust_region>0", "--engine-quant"), ("drift.max_abs>0", "--drift K")):
        line = bad_cli(["diagnose", *TINY, "--fail-if", gate], capsys)
        assert line == (f"phantomclip diagnose: error: --fail-if {gate.split('>')[0]}: the result has "
                        f"{gate.split('.')[0]!r} only with {needs}; add it, or drop this gate")


@pytest.mark.parametrize("command", [["diagnose", "--trainer", "fp32,bf16+fp8-block", "--n", "2"],
                                     ["diagnose", "--engine-quant", "fp8-block", "--n", "2"],
                                     ["trace", "--recipe", "bf16+fp8-block", "--n", "2"]])
def test_a_recipe_the_model_shape_refuses_is_refused_before_sampling(command, capsys, monkeypatch):
    """fp8-block on tiny-random's 64-wide layers: `--trainer bf16+fp8-block` was refused after sampling and
    scoring the first recipe (the audit's instance, with --engine-quant's: the engine's start); `trace --recipe`
    too (the variant). Now right after the model loads: no token is sampled."""
    def sampled(*args, **kwargs):
        raise AssertionError("tokens were sampled before the recipe was refused")

    monkeypatch.setattr("phantomclip.engines.local.LocalEngine.generate", sampled)
    line = bad_cli([*command[:1], *TINY, *command[1:]], capsys, after_progress=True)
    assert line.endswith("recipe bf16+fp8-block: layer model.layers.0.self_attn.q_proj has weight 64 x 64, not "
                         "divisible by the 128 x 128 block of fp8-block; use fp8-w8a8 or fp8-w8a16 for this model")


# ------------------------------------------------------------------------------------ 7. sizes without bound


def test_a_group_or_a_step_past_any_memory_is_refused_before_work(capsys, monkeypatch):
    """`train --group-size 10000000000 --max-tokens 2 --steps 1` ran past 120 s printing nothing (the audit's
    instance): refused by the bounds before anything loads, as are a step's rows and the run's prompt draws. The
    variant: a group under the bound whose step cannot fit this machine is refused once the model is known, before
    the engine starts, with the floor it needs worked out from the model's shape."""
    import re

    from phantomclip.models.load import load_model

    with monkeypatch.context() as m:
        _no_model_work(m)
        for extra, said in (
                (["--group-size", str(10**10)],
                 "--group-size must be a whole number >= 2 and <= 65536, got 10000000000"),
                (["--group-size", "60000", "--prompts-per-step", "30"],
                 "--prompts-per-step x --group-size is 1,800,000 rows, more than the 1,048,576 a run may have"),
                (["--steps", "100000", "--prompts-per-step", "1000"],
                 "--steps x --prompts-per-step is 100,000,000 prompt draws, more than the 10,000,000 a run may have")):
            line = bad_cli(over(["train", *TINY, "--max-tokens", "2", "--steps", "1"], *extra), capsys)
            assert said in line, line
        line = bad_cli(["diagnose", *TINY, "--n", str(10**9)], capsys)  # built a list of 10^9 prompts, unsaid
        assert line.endswith("--n must be a whole number >= 1 and <= 1048576, got 1000000000"), line

    def started(*args, **kwargs):
        raise AssertionError("the engine started for a step that cannot fit")

    monkeypatch.setattr("phantomclip.training.trainer.start_engine", started)
    line = bad_cli(["train", *TINY, "--group-size", "50000", "--prompts-per-step", "20", "--max-tokens", "400",
                    "--steps", "1"], capsys)
    positions = int(re.search(r"of up to ([0-9,]+) positions", line)[1].replace(",", ""))
    c = load_model("tiny-random").model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    # rows x positions x layers x (keys and values of the bf16 engine's cache + one fp32 hidden state per layer)
    floor = 1_000_000 * positions * c.num_hidden_layers * (2 * c.num_key_value_heads * head_dim * 2 + c.hidden_size * 4)
    assert f"needs at least {floor / 1e9:,.1f} GB (the engine's KV cache and the trainer's hidden states)" in line
    assert line.endswith("lower --group-size, --prompts-per-step or --max-tokens")




@pytest.mark.parametrize("module,said", [("torch", "phantomclip: interrupted"),  # the parsers' first heavy import
                                         ("diagnose.job", "phantomclip diagnose: interrupted")])  # the command's
def test_ctrl_c_while_the_libraries_import_is_one_line_and_130(module, said):
    """Ctrl-C in the first seconds, while torch imports, printed a KeyboardInterrupt traceback (the audit's instance):
    the signal is sent from inside the import itself, so the moment is exact. Variant: during the command's own
    imports, after the parsers, the command's 'interrupted' line. Both exit 130 with one line and no traceback."""
    import signal
    import subprocess
    import sys

    def as_a_terminal_starts_it():
        # Ctrl-C reaches a command started from a terminal; a suite run as a background job (`cmd &` in a script)
        # has SIGINT ignored and children inherit that (measured: the run then finishes with 0), as they inherit a
        # blocked signal mask
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    done = subprocess.run([sys.executable, "-c", SIGNAL_AT, module, "SIGINT"], capture_output=True, text=True,
                          timeout=120, preexec_fn=as_a_terminal_starts_it)
    assert done.returncode == 130 and done.stderr.strip() == said, (done.returncode, done.stderr[-2000:])


def test_r3_on_a_dense_model_is_refused_before_any_file_is_written(tmp_path, capsys):
    """A refused `train --intervention r3` on a dense model left config.json and .lock, so the next `train --out DIR`
    was refused (the audit's instance); the check now comes with the loaded model, before the engine starts and the
    run directory is made. Variant: a directory the user made beforehand is left empty, and trains afterwards."""
    for out in (tmp_path / "new", tmp_path / "made"):
        if out.name == "made":
            out.mkdir()
        line = bad_cli([*T, "--intervention", "r3", "--out", str(out)], capsys)
        assert line == ("phantomclip train: error: --intervention r3 needs a mixture-of-experts model; "
                        "LlamaForCausalLM is dense (no expert routers): leave it out, or use an MoE model (e.g. "
                        "tiny-moe)")
        assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == ([] if out.name == "made" else None)
        assert main([*T, "--out", str(out)]) == 0
        capsys.readouterr()


@pytest.mark.parametrize("damage", ["empty prompt row", "row past the context"])
def test_trace_run_checks_the_token_rows_it_will_use(damage, tmp_path, capsys):
    """`trace --run` on a snapshot whose tokens file has an empty prompt row raised 'ValueError: every prompt needs at
    least one token' (the audit's instance); a row longer than the model's context (tiny-random: 512 positions) is
    the variant. Each is one line naming the file."""
    run = tmp_path / "run"
    assert main([*T, "--keep-snapshots", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    path = run / "snapshots" / "step-000000.tokens.json"
    record = json.loads(path.read_text())
    if damage == "empty prompt row":
        record["prompt_ids"][0] = []
        said = "prompt_ids row 0 is empty, where the engine's prompt was: the file is damaged; restore it or remove it"
    else:
        record["prompt_ids"][0] = [1] * 600
        said = (f"a row of {600 + len(record['completion_ids'][0])} tokens is longer than tiny-random's context of "
                "512: the file is another model's or damaged")
    path.write_text(json.dumps(record))
    line = bad_cli(["trace", "--run", str(run)], capsys, after_progress=True)
    assert line == f"phantomclip trace: error: {path}: {said}", line
