"""The post-mortem finds which weights sampled each recorded step (diagnose/which_weights.py) and measures each step
against them (diagnose/postmortem.py): swapped checkpoints, an engine serving stale weights and a missing checkpoint
are each named, a step measured against other weights is said to hold α and never judged, and a row equals the
diagnose of that step's records against the weights that sampled them. Bad checkpoint directories are one line.

The run: three checkpoints of a tiny random model, steps 0, 10 and 20, each a perturbation of the first large enough
that records of one are far (nats) from another's shadow; each step's records sampled by the local bf16 engine at its
own checkpoint.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import bad_cli
from phantomclip.cli.main import main
from phantomclip.diagnose.canary import CANARY_MARGIN
from phantomclip.diagnose.which_weights import MATCH_FLOOR, MATCH_MARGIN, Match, decide_sampler
from phantomclip.engines.local import LocalEngine
from phantomclip.integrations.recorders import default_probe, read_canary, record_canary
from phantomclip.models.load import load_model
from phantomclip.rollouts.readers import read_rollouts

STEPS = (0, 10, 20)
ARGS = ["--trainer", "fp32"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(checkpoints dir, {step: the records that step's own weights sampled, as lines}), made once; beside each
    step's records, root/canary-S.jsonl (the engine holding step S's weights read the probe) and
    root/stale-S.jsonl (an engine never updated after step 0 read it: the sleep-mode fault)."""
    root = tmp_path_factory.mktemp("run")
    ckpts = root / "ckpts"
    lm = load_model("tiny-random:0")
    probe = default_probe(lm.tokenizer)
    stale = LocalEngine(lm.model, torch.bfloat16)  # a copy at step 0's weights, never synced again
    start = {k: v.clone() for k, v in lm.model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    records = {}
    for step, scale in zip(STEPS, (0.0, 0.5, 1.0)):
        with torch.no_grad():
            for name, p in lm.model.named_parameters():  # matrices moved by scale x their own std, the rest kept
                moved = start[name] + scale * start[name].std() * torch.randn(p.shape, generator=g)
                p.copy_(moved if p.dim() > 1 else start[name])
        lm.model.save_pretrained(ckpts / f"checkpoint-{step}")
        lm.tokenizer.save_pretrained(ckpts / f"checkpoint-{step}")
        out = root / f"r{step}.jsonl"
        assert main(["diagnose", "--model", str(ckpts / f"checkpoint-{step}"), "--n", "6", "--max-tokens", "10",
                     *ARGS, "--json", str(root / f"d{step}.json"), "--save-rollouts", str(out)]) == 0
        records[step] = out.read_text().splitlines()
        assert record_canary(LocalEngine(lm.model, torch.bfloat16), probe, root / f"canary-{step}.jsonl",
                             "bfloat16", step=step) == len(probe)
        record_canary(stale, probe, root / f"stale-{step}.jsonl", "bfloat16", step=step)
    return ckpts, records


def _steps_dir(tmp_path: Path, records: dict, served: dict[int, int] | None = None,
               canary: Path | None = None) -> Path:
    """A directory of one file per step: step s holds the records sampled by step served[s]'s weights (default s);
    with `canary` (the fixture's root/canary or root/stale) each step's probe file beside them."""
    d = tmp_path / "steps"
    d.mkdir()
    for step in STEPS:
        lines = records[(served or {}).get(step, step)]
        rows = [json.dumps(dict(json.loads(line), step=step)) for line in lines[1:]]
        (d / f"step-{step}.jsonl").write_text("\n".join([lines[0], *rows]) + "\n")
        if canary is not None:
            shutil.copy(canary.parent / f"{canary.name}-{step}.jsonl", d / f"probe-{step}.jsonl")
    return d


def _postmortem(tmp_path: Path, steps: Path, *args: str, model: str = "tiny-random:0") -> dict:
    out = tmp_path / "pm.json"
    assert main(["diagnose", "--model", model, *ARGS, "--rollouts", str(steps), "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


def _copy(ckpts: Path, tmp_path: Path, rename: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """The checkpoints copied, some renamed (old name -> new) or left out."""
    out = tmp_path / "ckpts"
    out.mkdir()
    for p in ckpts.iterdir():
        if p.name not in drop:
            shutil.copytree(p, out / (rename or {}).get(p.name, p.name))
    return out


def _rows(d: dict) -> list[dict]:
    return d["postmortem"]["steps"]


def test_each_step_is_matched_to_its_own_checkpoint_and_equals_its_own_diagnose(run, tmp_path):
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records), "--checkpoints", str(ckpts))
    rows = _rows(d)
    assert [(r["step"], r["weights"]["verdict"], r["weights"]["sampled_by"], r["lag"]) for r in rows] == [
        (0, "matched", 0, 0), (10, "matched", 10, 0), (20, "matched", 20, 0)]
    for r in rows:  # the row is that step's own diagnose, run apart on the file its checkpoint sampled
        alone = json.loads((ckpts.parent / f"d{r['step']}.json").read_text())["recipes"]["fp32"]
        assert r["beta_abs_mean"] == alone["beta_abs_mean"] and r["tokens"] == alone["tokens"]
        medians = r["weights"]["medians"]  # its own checkpoint's shadow is the matched level, the others nats away
        own = medians[str(r["step"])]
        assert own <= MATCH_MARGIN * MATCH_FLOOR and all(m > 0.5 for s, m in medians.items() if s != str(r["step"]))
    reasons = d["answer"]["reasons"]
    assert reasons[0].startswith("the worst of 3 steps measured at the weights that sampled them")
    assert not any(x.startswith("step ") for x in reasons)  # nothing found of the weights


def test_a_whole_run_keeps_the_last_steps_per_token_arrays_and_a_row_of_scalars_per_step(run, tmp_path,
                                                                                          monkeypatch):
    """What a post-mortem keeps from step to step is its rows: scalars and one entry per candidate checkpoint, no
    per-token array; no step's whole result (every recipe's per-token arrays) is still alive when the next step
    starts; the only per-token arrays of the result (what --json writes) are the last step's, equal to that step's
    own diagnose run apart (so a kept array of another step, or of every step, would fail here)."""
    import gc
    import weakref

    from phantomclip.diagnose import postmortem

    class Result(dict):  # a dict a weak reference can follow
        pass

    real, alive = postmortem.diagnose_step, []

    def tracked(*args, **kwargs):
        gc.collect()
        assert [r() for r in alive if r() is not None] == [], "a step's whole result outlived its row"
        result = Result(real(*args, **kwargs))
        alive.append(weakref.ref(result))
        return result

    monkeypatch.setattr(postmortem, "diagnose_step", tracked)
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records), "--checkpoints", str(ckpts))
    assert len(alive) == len(STEPS)

    def arrays(x, where=""):  # every list (or tuple) inside x, by where it sits
        if isinstance(x, dict):
            return [a for k, v in x.items() for a in arrays(v, f"{where}.{k}")]
        return [(where, len(x))] if isinstance(x, (list, tuple)) else []

    for r in _rows(d):
        assert arrays(r) == [] and len(r["weights"]["medians"]) == len(STEPS)
    alone = json.loads((ckpts.parent / f"d{STEPS[-1]}.json").read_text())
    n = alone["engine"]["tokens"]
    assert d["engine"]["tokens"] == n and {len(v) for k, v in d["tokens"].items() if k != "per_recipe"} == {n}
    assert d["tokens"]["per_recipe"].keys() == {"fp32"}
    for key, values in d["tokens"]["per_recipe"]["fp32"].items():
        assert values == alone["tokens"]["per_recipe"]["fp32"][key], key


def test_swapped_checkpoints_are_named_and_measured_against_the_weights_that_match(run, tmp_path):
    ckpts, records = run
    swapped = _copy(ckpts, tmp_path, {"checkpoint-0": "checkpoint-20", "checkpoint-20": "checkpoint-0"})
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records), "--checkpoints", str(swapped))
    rows = _rows(d)
    assert [(r["weights"]["verdict"], r["weights"]["sampled_by"]) for r in rows] == [
        ("served", 20), ("matched", 10), ("served", 0)]
    (tmp_path / "b").mkdir()
    straight = _postmortem(tmp_path / "b", _steps_dir(tmp_path / "b", records), "--checkpoints", str(ckpts))
    for got, want in zip(rows, _rows(straight)):  # the same weights and tokens: the same figures, bit for bit
        assert got["beta_abs_mean"] == want["beta_abs_mean"] and got["outside_trust_region"] == want[
            "outside_trust_region"]
    said = " ".join(d["answer"]["reasons"])
    assert "step 0: its records match the checkpoint named step 20" in said and "swapped or mislabelled" in said


def test_an_engine_serving_stale_weights_is_named_with_the_alpha_it_adds(run, tmp_path):
    """Step 20's records sampled with step 10's weights: measured against step 10's (β alone), named stale, and the
    policy's move between the two (what the trainer's ratio carries) measured on those tokens."""
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records, served={20: 10}), "--checkpoints", str(ckpts))
    last = _rows(d)[-1]
    assert last["weights"]["verdict"] == "served" and last["weights"]["sampled_by"] == 10 and last["lag"] == 0
    alpha = last["weights"]["alpha"]
    assert alpha["tokens"] == last["tokens"] and alpha["alpha_abs_mean"] > 0.5  # the checkpoints are nats apart
    assert any(x.startswith("step 20: the engine served step 10's weights (stale weights, 10 steps behind)")
               for x in d["answer"]["reasons"])


def test_a_missing_checkpoint_leaves_the_step_holding_alpha_and_out_of_the_status(run, tmp_path):
    """Without step 20's checkpoint its records match no weights given: measured against step 10's (lag 10), said to
    hold α, left out of the status; the verdict says the tables are not the engine's gap."""
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records), "--checkpoints",
                    str(_copy(ckpts, tmp_path, drop=("checkpoint-20",))))
    last = _rows(d)[-1]
    assert (last["weights"]["verdict"], last["lag"], last["contains_alpha"], last["status"]) == ("missing", 10, True,
                                                                                                 None)
    reasons = d["answer"]["reasons"]
    assert reasons[0].startswith("the worst of 2 steps measured at the weights that sampled them")
    assert any(x.startswith("step 20: no weights given sampled its records (closest: step 10's checkpoint, 10 steps")
               for x in reasons)
    assert "at α = 0" not in d["verdict"] and "holds the policy's change α as well as the mismatch β" in d["verdict"]


def test_without_checkpoints_only_the_steps_model_sampled_are_judged(run, tmp_path):
    ckpts, records = run
    out = tmp_path / "pm.json"
    assert main(["diagnose", "--model", str(ckpts / "checkpoint-0"), *ARGS, "--rollouts",
                 str(_steps_dir(tmp_path, records)), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert [(r["weights"]["verdict"], r["lag"], r["contains_alpha"]) for r in _rows(d)] == [
        ("matched", 0, False), ("missing", None, True), ("missing", None, True)]
    assert d["answer"]["reasons"][0].startswith("the worst of 1 steps measured")


def test_the_initial_model_stands_for_step_0_where_no_checkpoint_is(run, tmp_path):
    """TRL saves no checkpoint-0: --model, the run's initial weights, is step 0's candidate."""
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records), "--checkpoints",
                    str(_copy(ckpts, tmp_path, drop=("checkpoint-0",))), model=str(ckpts / "checkpoint-0"))
    assert [(r["weights"]["verdict"], r["checkpoint"]) for r in _rows(d)][0] == ("matched",
                                                                               str(ckpts / "checkpoint-0"))


def test_the_sampler_rule_by_hand():
    # floor 0.01: within 2x of it a candidate could have sampled; one could -> matched (if expected) or served
    m = Match(step=20, expected=20, medians={0: 0.30, 10: 0.015, 20: 0.25})
    decide_sampler(m, 0.01)
    assert (m.verdict, m.sampled_by, m.margin) == ("served", 10, pytest.approx(0.25 / 0.015))
    m = Match(step=20, expected=20, medians={10: 0.012, 20: 0.018})
    decide_sampler(m, 0.01)
    assert (m.verdict, m.sampled_by) == ("ambiguous", 20)  # both within 2x: the step's own is kept
    m = Match(step=20, expected=10, medians={0: 0.4, 10: 0.22})
    decide_sampler(m, 0.01)
    assert (m.verdict, m.sampled_by) == ("missing", 10)


def _bad(ckpts_dir: Path, run, tmp_path, capsys, after_progress: bool = False) -> str:
    _, records = run
    return bad_cli(["diagnose", "--model", "tiny-random:0", *ARGS, "--rollouts", str(_steps_dir(tmp_path, records)),
                    "--checkpoints", str(ckpts_dir)], capsys, after_progress=after_progress)


@pytest.mark.parametrize("damage,says", [
    ("link", "is a link: give the checkpoint directory itself"),
    ("double", "are both step 10: keep one"),
    ("no-step", "is named like a checkpoint but has no step number"),
    ("digits", "a step of 20 digits"),
    ("other-model", "are different models (hidden_size"),
    ("no-config", "has no readable config.json"),
])
def test_a_bad_checkpoints_directory_is_one_line(run, tmp_path, capsys, damage, says):
    ckpts, _ = run
    d = _copy(ckpts, tmp_path)
    if damage == "link":
        (d / "checkpoint-10").rename(tmp_path / "elsewhere")
        (d / "checkpoint-10").symlink_to(tmp_path / "elsewhere")
    elif damage == "double":
        shutil.copytree(d / "checkpoint-10", d / "step-10")
    elif damage == "no-step":
        shutil.copytree(d / "checkpoint-10", d / "checkpoint--1")
    elif damage == "digits":
        (d / "checkpoint-20").rename(d / ("checkpoint-" + "9" * 20))
    elif damage == "other-model":
        config = json.loads((d / "checkpoint-10" / "config.json").read_text())
        config["hidden_size"] *= 2
        (d / "checkpoint-10" / "config.json").write_text(json.dumps(config))
    elif damage == "no-config":
        (d / "checkpoint-10" / "config.json").unlink()
    line = _bad(d, run, tmp_path, capsys)
    assert says in line, line


def test_a_checkpoint_missing_tensors_is_refused_not_initialised(run, tmp_path, capsys):
    """transformers fills a tensor the weights file lacks at random; the checkpoint is refused instead."""
    from safetensors.torch import save_file

    ckpts, _ = run
    d = _copy(ckpts, tmp_path)
    save_file({"unrelated": torch.zeros(1)}, str(d / "checkpoint-10" / "model.safetensors"))
    line = _bad(d, run, tmp_path, capsys, after_progress=True)  # found when the candidates load
    assert "its weights lack" in line and "which would be initialised at random: give a complete checkpoint" in line


def test_the_canary_is_one_log_prob_per_token_after_the_first_and_moves_with_the_weights(run):
    """read_canary: one finite log-prob <= 0 per token after each sequence's first; the same engine reads the same
    numbers twice (teacher-forced, no sampling); an engine at step 10's weights reads them nats away from step 0's
    (the fixture's checkpoints are that far apart), which is what lets a stale engine show."""
    ckpts, _ = run
    at = {s: LocalEngine(load_model(str(ckpts / f"checkpoint-{s}")).model, torch.bfloat16) for s in (0, 10)}
    probe = default_probe(load_model("tiny-random:0").tokenizer)
    first = read_canary(at[0], probe)
    assert [len(x) for x in first] == [31] * 4  # the documented probe: 4 x 32 tokens, a log-prob after the first
    assert all(math.isfinite(v) and v <= 0 for x in first for v in x)
    assert read_canary(at[0], probe) == first
    moved = torch.tensor([abs(a - b) for x, y in zip(first, read_canary(at[10], probe)) for a, b in zip(x, y)])
    assert moved.median() > 0.5


def test_a_flat_canary_says_the_engine_held_the_synced_weights(run, tmp_path):
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records, canary=ckpts.parent / "canary"), "--checkpoints",
                    str(ckpts))
    probe = [r["canary"] for r in _rows(d)]
    assert [c["state"] for c in probe] == ["flat"] * 3 and all(c["tokens"] > 0 for c in probe)
    assert all(r["weights"]["verdict"] == "matched" for r in _rows(d))  # the probe is kept out of the run's records
    assert any(x.startswith("the canary stayed flat over 3 syncs") for x in d["answer"]["reasons"])


def test_an_engine_never_updated_after_a_sync_is_engine_state(run, tmp_path):
    """The sleep-mode fault: the engine kept step 0's weights. Its probe, scored by steps 10's and 20's own
    checkpoints, jumps at those syncs, and the answer names engine state there."""
    ckpts, records = run
    d = _postmortem(tmp_path, _steps_dir(tmp_path, records, canary=ckpts.parent / "stale"), "--checkpoints",
                    str(ckpts))
    probe = [r["canary"] for r in _rows(d)]
    assert [c["state"] for c in probe] == ["flat", "jump", "jump"]
    assert probe[1]["beta_abs_median"] > CANARY_MARGIN * probe[0]["level"]
    said = [x for x in d["answer"]["reasons"] if x.startswith("engine state:")]
    assert len(said) == 1 and "at step 10 (" in said[0] and "step 20 (" in said[0]


def test_one_step_from_the_command_line_uses_its_checkpoint(run, tmp_path, capsys):
    """--rollouts-step N is typed as a whole number (it was taken as text from its None default and refused); with
    --checkpoints the step is measured against the checkpoint that sampled it; a step the records do not hold is one
    line listing the steps they do."""
    ckpts, records = run
    steps = _steps_dir(tmp_path, records)
    d = _postmortem(tmp_path, steps, "--checkpoints", str(ckpts), "--rollouts-step", "10")
    assert [(r["step"], r["weights"]["verdict"], r["checkpoint"]) for r in _rows(d)] == [
        (10, "matched", str(ckpts / "checkpoint-10"))]
    capsys.readouterr()
    line = bad_cli(["diagnose", "--model", "tiny-random:0", *ARGS, "--rollouts", str(steps), "--rollouts-step", "7"],
                   capsys)
    assert line.endswith("holds no record of that step; its steps: 0, 10, 20")


def test_the_input_is_split_by_step_once(run, tmp_path):
    """Each step's diagnose reads a file of its own records (split once), not the whole input again: every run
    record lands in its step's file, the canary's in none, the header kept."""
    from phantomclip.diagnose.postmortem import split_by_step

    ckpts, records = run
    steps = _steps_dir(tmp_path, records, canary=ckpts.parent / "canary")
    (tmp_path / "parts").mkdir()
    files, tokens = split_by_step(str(steps), list(STEPS), tmp_path / "parts")
    for step in STEPS:
        header, located = read_rollouts(files[step])
        got = [x.record for x in located]
        assert [r.completion_ids for r in got] == [json.loads(x)["completion_ids"] for x in records[step][1:]]
        assert {r.step for r in got} == {step} and tokens[step] == sum(len(r.completion_ids) for r in got)
        assert not any(r.canary for r in got) and header.engine.dtype == "bfloat16"


def test_a_long_input_is_split_holding_a_bounded_number_of_records(run, tmp_path, monkeypatch):
    """split_by_step never holds more than SPLIT_RECORDS records (here 4): each step's records reach its files in
    pieces of at most 4, in the input's order, whatever the run's length."""
    from phantomclip.diagnose import postmortem

    ckpts, records = run
    steps = _steps_dir(tmp_path, records)
    monkeypatch.setattr(postmortem, "SPLIT_RECORDS", 4)
    (tmp_path / "parts").mkdir()
    files, _ = postmortem.split_by_step(str(steps), list(STEPS), tmp_path / "parts")
    for step in STEPS:
        parts = sorted(Path(files[step]).iterdir())
        sizes = [len(p.read_text().splitlines()) - 1 for p in parts]  # records a piece, its header line off
        assert len(parts) > 1 and max(sizes) <= 4 and sum(sizes) == len(records[step]) - 1
        got = [x.record.completion_ids for x in read_rollouts(files[step])[1]]
        assert got == [json.loads(x)["completion_ids"] for x in records[step][1:]]


def test_evaluation_dumps_are_named_and_never_merged_into_a_step(run, tmp_path):
    """slime writes eval_{id} dumps (other sampling) beside the training rollouts with the same id: they are left out
    of the steps (step 10's figures are those without them) and named in a note."""
    ckpts, records = run
    steps = _steps_dir(tmp_path, records)
    clean = _postmortem(tmp_path, steps, "--checkpoints", str(ckpts))
    lines = records[0]  # step 0's tokens, relabelled step 10: records another checkpoint sampled
    (steps / "eval_10.jsonl").write_text("\n".join([lines[0], *[json.dumps(dict(json.loads(x), step=10))
                                                                for x in lines[1:]]]) + "\n")
    (tmp_path / "b").mkdir()
    d = _postmortem(tmp_path / "b", steps, "--checkpoints", str(ckpts))
    assert [r["beta_abs_mean"] for r in _rows(d)] == [r["beta_abs_mean"] for r in _rows(clean)]
    assert any(n.startswith("left out 1 evaluation dump(s) (eval_10.jsonl)") for n in d["engine"]["notes"])


def test_the_rest_of_a_post_mortem_is_estimated_from_its_first_step():
    """Hand-worked: the first step took 12 s for 40 tokens; the other three hold 10, 20 and 90 tokens. A fixed cost
    per step gives 3 x 12 = 36 s; a cost per token 12 x 120 / 40 = 36 s as well: one figure. With 400 tokens left
    (10 steps of 40) against one 4-token first step: fixed 10 x 12 = 120 s, per token 12 x 400 / 4 = 1200 s = 20 min:
    a range, said in minutes."""
    from phantomclip.diagnose.postmortem import estimate_line, remaining_seconds

    assert remaining_seconds(12.0, 40, [10, 20, 90]) == (36.0, 36.0)
    assert remaining_seconds(12.0, 4, [40] * 10) == (120.0, 1200.0)
    line = estimate_line(3, 12.0, 40, [10, 20, 90])
    assert "step 3 took 12.0 s for 40 completion tokens" in line and "the other 3 steps (120 tokens) about 36 s" in line
    assert "between 2 min and 20 min more" in estimate_line(3, 12.0, 4, [40] * 10)
