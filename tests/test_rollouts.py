"""Rollout records (rollouts/record.py, rollouts/batches.py, rollouts/readers.py, diagnose/recorded.py): `diagnose
--rollouts` on what an engine recorded gives the figures `diagnose` gives on the same tokens, bit for bit; every
malformed record is one line naming the file, the line and the field; slime/miles dumps load without running code; a
post-mortem across steps.
"""

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

from conftest import bad_cli, eps
from phantomclip.cli.main import main

TINY = ["--model", "tiny-random:0"]
RECIPES = ["--trainer", "fp32,bf16"]


def _diagnose(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["diagnose", *TINY, *RECIPES, "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A diagnose run of the local engine at temperature 0.8 (no truncation: its two log-prob columns are the same
    numbers) and the rollout file it saved: (result, path)."""
    tmp = tmp_path_factory.mktemp("saved")
    path = tmp / "r.jsonl"
    result = _diagnose(tmp, "sampled", "--n", "6", "--max-tokens", "10", "--temperature", "0.8", "--batch-size", "4",
                       "--save-rollouts", str(path))
    return result, path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_recorded_tokens_give_the_sampled_run_figures_bit_for_bit(saved, tmp_path):
    """The file diagnose saved, read back: the same tokens scored in the same batches at the recorded temperature and
    truncation, so every recipe's per-token β, the kernel part and the engine columns are equal to the bit."""
    sampled, path = saved
    header = _lines(path)[0]
    assert header["logprobs"] == "processed" and header["sampling"] == {"temperature": 0.8, "top_p": 1.0,
                                                                        "top_k": 0, "min_p": 0.0}
    recorded = _diagnose(tmp_path, "recorded", "--rollouts", str(path), "--batch-size", "4")
    for key in ("logp_engine", "logp_engine_processed", "beta_kernel"):
        assert recorded["tokens"][key] == sampled["tokens"][key], key
    for recipe in ("fp32", "bf16"):
        assert recorded["tokens"]["per_recipe"][recipe] == sampled["tokens"]["per_recipe"][recipe]
        assert recorded["recipes"][recipe]["beta_abs_mean"] == sampled["recipes"][recipe]["beta_abs_mean"]
    assert recorded["config"]["temperature"] == 0.8  # the file's, not the flags' default
    e = recorded["engine"]
    assert (e["kind"], e["name"], e["logprobs"], e["sequences"]) == ("recorded", "phantomclip-local", "processed", 6)
    assert recorded["answer"]["contract"]["engine_label"].startswith("bf16 phantomclip-local")


def test_truncated_records_rebuild_the_column_they_lack(tmp_path):
    """At top-p 0.9 an engine reports one column (here processed, renormalised over the kept tokens): read back, that
    column is the file's bit for bit and the full-vocabulary one is rebuilt from the shadow's kept mass,
    logp_engine = processed + log S (both rounded to 6 decimals in the JSON: 1e-6 apart at most)."""
    path = tmp_path / "p.jsonl"
    _diagnose(tmp_path, "s", "--n", "4", "--max-tokens", "8", "--top-p", "0.9", "--save-rollouts", str(path))
    d = _diagnose(tmp_path, "r", "--rollouts", str(path))
    flat = [v for r in _records(path) for v in r["logp_engine"]]
    assert d["tokens"]["logp_engine_processed"] == [round(v, 6) for v in flat]
    assert d["engine"]["rebuilt_column"] == "logp_engine"
    log_kept = d["tokens"]["per_recipe"]["bf16"]["log_kept"]  # the bf16 shadow's log S per token
    for raw, processed, s in zip(d["tokens"]["logp_engine"], d["tokens"]["logp_engine_processed"], log_kept):
        assert abs(raw - (processed + s)) <= 1.5e-6


def test_beta_against_an_independent_forward(saved, tmp_path, tiny):
    """fp32 β per token = a plain fp32 forward's log-prob (log-softmax of logits / T, no truncation) minus the file's
    full-vocabulary column, computed here without phantomclip's scoring. Bound: two fp32 forwards of the same tokens
    in other shapes (padded batch vs one row) differ by about eps32 * |logit| * sqrt(terms); the log-softmax adds
    the same order (scale: the logit bound over T)."""
    from conftest import forward_terms, logit_bound

    _, path = saved
    recorded = _diagnose(tmp_path, "recorded", "--rollouts", str(path))
    rows = _lines(path)[1:]
    beta = recorded["tokens"]["per_recipe"]["fp32"]["beta"]
    model = tiny.model.float().eval()
    mine = []
    with torch.no_grad():
        for r, lp_engine in zip(rows, _full_columns(recorded, rows)):
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])  # [1, L]
            logits = model(ids).logits[0].float() / 0.8  # [L, V]
            P = len(r["prompt_ids"])
            lp = torch.log_softmax(logits[P - 1 : -1], -1).gather(-1, torch.tensor(r["completion_ids"])[:, None])
            mine += (lp[:, 0].double() - torch.tensor(lp_engine, dtype=torch.float64)).tolist()
    context = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    scale = logit_bound(model) / 0.8
    # β was rounded to 6 decimals in the JSON: half a unit of the 6th decimal beside the fp32 bound
    got = torch.tensor(beta, dtype=torch.float64)
    bound = 2 * eps(torch.float32) * scale * math.sqrt(forward_terms(model.config, context)) + 5e-7
    assert (got - torch.tensor(mine)).abs().max().item() <= bound


def _full_columns(result: dict, rows: list[dict]) -> list[list[float]]:
    """The full-vocabulary engine column per record, as the result rebuilt it (the file holds processed ones)."""
    flat, out, i = result["tokens"]["logp_engine"], [], 0
    for r in rows:
        out.append(flat[i : i + len(r["completion_ids"])])
        i += len(r["completion_ids"])
    return out


def test_raw_log_probs_at_another_temperature_are_measured_at_temperature_1(saved, tmp_path):
    """'raw' log-probs (vLLM's default) are of the temperature-1 distribution, whatever the sampling: the run says
    so and measures at temperature 1 without truncation."""
    _, path = saved
    rows = _lines(path)
    rows[0]["logprobs"] = "raw"
    raw = _write(tmp_path / "raw.jsonl", rows)
    out = tmp_path / "raw.json"
    assert main(["diagnose", *TINY, "--trainer", "fp32", "--rollouts", str(raw), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert (d["config"]["temperature"], d["config"]["top_p"]) == (1.0, 1.0)
    assert any("measured at temperature 1, not the sampling's 0.8" in n for n in d["engine"]["notes"])


def _records(path: Path) -> list[dict]:
    return _lines(path)[1:]


# (how to spoil a record, the line's fragment): every one refused naming the file, line 3 (the header is line 1)
SPOILED = [
    (lambda r: r.update(completion_ids=[400] + r["completion_ids"][1:]), "completion_ids[0] = 400 is outside the "
                                                                         "model's vocabulary"),
    (lambda r: r.update(completion_ids=r["completion_ids"][:3], logp_engine=r["logp_engine"][:2]),
     "logp_engine has 2 values for 3 completion tokens"),
    (lambda r: r["logp_engine"].__setitem__(2, 0.25), "logp_engine[2] = 0.25 is not a log-prob (<= 0)"),
    (lambda r: r["logp_engine"].__setitem__(3, None), "logp_engine[3] = None is not a number"),
    (lambda r: r.update(prompt_ids=[]), "prompt_ids must be a list of at least 1 token id"),
    (lambda r: r.update(prompt_ids=[1, -2]), "prompt_ids[1] = -2 is not a token id"),
    (lambda r: r.update(colour="red"), "unknown field(s) colour"),
    (lambda r: r.pop("logp_engine"), "missing logp_engine"),
    (lambda r: r.update(advantage="high"), "advantage = 'high' is not a number"),
    (lambda r: r.update(step=-1), "step = -1 is not a whole number >= 0"),
    (lambda r: r.update(routed_experts=[[[0, 1]]]), "routed_experts is given but the model has no MoE layers"),
    (lambda r: r.update(sampling={"temperature": 0.5}), "differ from"),
    (lambda r: r.update(sampling={"temperature": 1e-320}), "sampling.temperature = 9.99989e-321 is greedy decoding "
                                                           "(vLLM samples greedily below a temperature of 1e-05)"),
    (lambda r: r.update(sampling={"temperature": float("inf")}), "sampling.temperature = inf: give the finite"),
]


@pytest.mark.parametrize("spoil, fragment", SPOILED)
def test_a_malformed_record_is_one_line_naming_file_line_and_field(saved, tmp_path, capsys, spoil, fragment):
    _, path = saved
    rows = _lines(path)
    spoil(rows[2])
    bad = _write(tmp_path / "bad.jsonl", rows)
    line = bad_cli(["diagnose", *TINY, "--trainer", "fp32", "--rollouts", str(bad)], capsys, after_progress=True)
    assert f"{bad}:3: " in line and fragment in line, line


def test_processed_log_probs_without_sampling_are_refused(saved, tmp_path, capsys):
    """Their distribution depends on the sampling: refused, unless the run's settings are typed; a typed setting that
    contradicts the file is refused too."""
    _, path = saved
    rows = _lines(path)
    rows[0].pop("sampling")
    bare = _write(tmp_path / "bare.jsonl", rows)
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(bare)], capsys)
    assert "processed log-probs without their sampling settings: give the run's --temperature" in line
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(path), "--temperature", "0.7"], capsys)
    assert f"--temperature 0.7: {path} records temperature 0.8" in line


def test_records_of_another_checkpoint_are_refused_with_the_figure(saved, tmp_path, capsys):
    """tiny-random:1 did not sample tiny-random:0's tokens: the median |β| against its shadow is far above any
    precision gap, and the line says it and what it suggests."""
    _, path = saved
    line = bad_cli(["diagnose", "--model", "tiny-random:1", "--trainer", "fp32", "--rollouts", str(path)], capsys,
                   after_progress=True)
    assert "median |β|" in line and "not sampled from this checkpoint" in line
    median = float(line.split("median |β| ")[1].split()[0])
    assert median > 0.5


@pytest.mark.parametrize("text, fragment", [
    ('{"prompt_ids": [1, 2]', "is not JSON"),
    ('{"phantomclip_rollouts": 9}', "this phantomclip reads version 1"),
    ('{"phantomclip_rollouts": 1, "logprobs": "logits"}', "logprobs = 'logits': use raw, tempered, processed"),
    ('{"phantomclip_rollouts": 1}', "holds no record: nothing to measure"),
])
def test_a_malformed_file_is_one_line(tmp_path, capsys, text, fragment):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text + "\n")
    assert fragment in bad_cli(["diagnose", *TINY, "--rollouts", str(bad)], capsys, after_progress=True)


def test_options_that_sample_are_refused_beside_rollouts(saved, capsys):
    _, path = saved
    for extra in (["--engine", "vllm"], ["--drift", "1"], ["--prompts", str(path)]):
        line = bad_cli(["diagnose", *TINY, "--rollouts", str(path), *extra], capsys)
        assert f"{' '.join(extra[:1] if extra[0] != '--engine' else extra)} with --rollouts" in line


# ------------------------------------------------------------------------------------------------ slime


def _slime_dump(rows: list[dict], routes: list | None = None) -> dict:
    """slime's --save-debug-rollout-data object (slime/observability/rollout_data_utils.py @624b824): tokens = prompt
    + response, rollout_log_probs one per response token, routes [len(tokens) - 1, layers, k] as an int32 tensor."""
    samples = []
    for i, r in enumerate(rows):
        tokens = r["prompt_ids"] + r["completion_ids"]
        samples.append({"tokens": tokens, "response_length": len(r["completion_ids"]),
                        "rollout_log_probs": r["logp_engine"], "loss_mask": [1] * len(r["completion_ids"]),
                        "weight_versions": ["7"], "status": "completed", "reward": -1.0,
                        "rollout_routed_experts": None if routes is None else routes[i]})
    return {"rollout_id": 7, "samples": samples}


def test_a_slime_dump_reads_as_its_records(saved, tmp_path):
    """The same tokens and log-probs as a slime dump ('tempered': SGLang's log-probs after temperature, over the full
    vocabulary) give the JSONL's figures; slime records no sampling, so the run's temperature is typed."""
    _, path = saved
    jsonl = _lines(path)
    jsonl[0]["logprobs"] = "tempered"  # at top-p 1 the local engine's processed column is exactly that
    as_jsonl = _write(tmp_path / "t.jsonl", jsonl)
    dump = tmp_path / "7.pt"
    torch.save(_slime_dump(jsonl[1:]), dump)
    a = _diagnose(tmp_path, "jsonl", "--rollouts", str(as_jsonl))
    b = _diagnose(tmp_path, "slime", "--rollouts", str(dump), "--temperature", "0.8")
    assert a["tokens"]["per_recipe"] == b["tokens"]["per_recipe"]
    assert b["engine"]["source"].startswith("slime") and b["engine"]["logprobs"] == "tempered"
    assert any("measured at the flags' temperature 0.8" in n for n in b["engine"]["notes"])
    # the file came from slime: the answer quotes slime's own figure against slime's CI bar (<= 0.1)
    value = b["recipes"]["fp32"]["frameworks"]["slime"]["train_rollout_logprob_abs_diff"]
    verdict = "within" if value <= 0.1 else "over"
    assert f"slime train_rollout_logprob_abs_diff = {value:.4g}: {verdict} its bar <= 0.1" in b["answer"]["reasons"]


class _Payload:
    """A pickled object whose loading would run code (what weights_only must refuse)."""

    def __reduce__(self):
        return (Path.touch, (Path("/tmp/phantomclip-pwned"),))


def test_a_torch_file_that_would_run_code_is_refused(tmp_path, capsys):
    Path("/tmp/phantomclip-pwned").unlink(missing_ok=True)
    dump = tmp_path / "evil.pt"
    torch.save({"rollout_id": 0, "samples": [_Payload()]}, dump, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(dump)], capsys)
    assert "refused: it pickles" in line and "could run code" in line
    assert not Path("/tmp/phantomclip-pwned").exists()


def test_a_slime_loss_mask_of_another_length_is_refused(saved, tmp_path, capsys):
    """slime holds loss_mask to one entry per response token (Sample._validate_response_metadata_lengths @624b824);
    multi-turn samples themselves are measured (tests/test_rollouts_slime.py)."""
    _, path = saved
    dump = _slime_dump(_records(path))
    dump["samples"][1]["loss_mask"].append(0)
    torch.save(dump, tmp_path / "7.pt")
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(tmp_path / "7.pt"), "--temperature", "0.8"], capsys,
                   after_progress=True)
    assert "7.pt sample 1: loss_mask must be one 0 or 1 per completion token" in line, line


# ------------------------------------------------------------------------------------------------ MoE, steps


def test_recorded_routes_are_replayed(tmp_path):
    """tiny-moe: the local engine's routes saved with its tokens and replayed from the file give the sampled run's
    β_route per recipe and its route table, bit for bit."""
    path = tmp_path / "moe.jsonl"
    moe = ["diagnose", "--model", "tiny-moe", *RECIPES, "--n", "4", "--max-tokens", "8"]
    assert main([*moe, "--save-rollouts", str(path), "--json", str(tmp_path / "a.json")]) == 0
    assert main(["diagnose", "--model", "tiny-moe", *RECIPES, "--rollouts", str(path), "--json",
                 str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    rows = _records(path)
    assert all(len(r["routed_experts"]) == len(r["prompt_ids"]) + len(r["completion_ids"]) - 1 for r in rows)
    for recipe in ("fp32", "bf16"):
        assert a["routing"][recipe] == b["routing"][recipe]
    assert b["routing"]["engine"]["source"] == "recorded with the tokens"


def test_a_post_mortem_has_one_row_per_step(saved, tmp_path):
    """Three steps of the same records, the middle one's advantages flipped: every row has the step's figures; the
    phantom share follows each token's advantage (A > 0 clips above 1 + ε_high, A < 0 below 1 − ε_low) and is
    worked here from the per-token β of the single-file run."""
    sampled, path = saved
    rows = _lines(path)
    steps = tmp_path / "steps"
    steps.mkdir()
    for step, sign in ((0, 1.0), (5, -1.0), (10, 1.0)):
        recs = [dict(r, step=step, advantage=sign * (1.0 if i % 2 else -1.0)) for i, r in enumerate(rows[1:])]
        _write(steps / f"step-{step}.jsonl", [rows[0], *recs])
    d = _diagnose(tmp_path, "pm", "--rollouts", str(steps), "--epsilon", "0.05")
    got = d["postmortem"]["steps"]
    assert [r["step"] for r in got] == [0, 5, 10]  # the same tokens each step: --model sampled them all
    assert all((r["lag"], r["weights"]["verdict"]) == (0, "matched") for r in got)
    beta = d["tokens"]["per_recipe"]["fp32"]["beta"]
    seq = d["tokens"]["sequence"]
    for row, sign in zip(got, (1.0, -1.0, 1.0)):
        adv = [sign * (1.0 if s % 2 else -1.0) for s in seq]
        clipped = [(a > 0 and b > math.log1p(0.05)) or (a < 0 and b < math.log1p(-0.05)) for a, b in zip(adv, beta)]
        assert row["phantom_share_at_alpha0"] == pytest.approx(sum(clipped) / len(clipped), abs=1e-12)
        assert row["beta_abs_mean"] == d["recipes"]["fp32"]["beta_abs_mean"]
    assert got[0]["phantom_share_at_alpha0"] != got[1]["phantom_share_at_alpha0"]


def test_a_post_mortem_measures_each_step_against_its_checkpoint(saved, tmp_path, tiny, capsys):
    """checkpoint-0 holds the model that sampled every step: step 0 is its own, step 3 (its own checkpoint not given)
    matches it too, so both are β alone (lag 0). Renamed checkpoint-2, the records of step 0 precede every
    checkpoint: --model stands for the run's initial weights (TRL saves no checkpoint-0)."""
    _, path = saved
    rows = _lines(path)
    steps = tmp_path / "steps"
    steps.mkdir()
    for step in (0, 3):
        _write(steps / f"step-{step}.jsonl", [rows[0], *[dict(r, step=step) for r in rows[1:]]])
    ckpts = tmp_path / "ckpts"
    tiny.model.save_pretrained(ckpts / "checkpoint-0")
    tiny.tokenizer.save_pretrained(ckpts / "checkpoint-0")
    d = _diagnose(tmp_path, "pm", "--rollouts", str(steps), "--checkpoints", str(ckpts))
    assert [(r["step"], r["lag"], r["weights"]["sampled_by"]) for r in d["postmortem"]["steps"]] == [(0, 0, 0),
                                                                                                    (3, 0, 0)]
    assert any(x.startswith("step 3: its own checkpoint is not given; step 0's weights match its records")
               for x in d["answer"]["reasons"])
    (ckpts / "checkpoint-0").rename(ckpts / "checkpoint-2")
    d = _diagnose(tmp_path, "pm2", "--rollouts", str(steps), "--checkpoints", str(ckpts))
    # the two candidates hold the same weights: both match each step (ambiguous), each step keeps its expected one
    assert [(r["checkpoint"], r["weights"]["verdict"]) for r in d["postmortem"]["steps"]] == [
        ("tiny-random:0", "ambiguous"), (str(ckpts / "checkpoint-2"), "ambiguous")]


def test_pack_records_keeps_to_batches_and_columns(saved, tiny):
    """The records as Rollouts: batches of batch_size in file order; the measured column in its place and, without
    truncation, the other the same numbers (S = 1; with truncation it is NaN, rebuilt later from the shadow's kept
    mass: test_truncated_records_rebuild_the_column_they_lack)."""
    from phantomclip.rollouts.batches import ModelShape, pack_records
    from phantomclip.rollouts.readers import read_rollouts

    _, path = saved
    header, records = read_rollouts(str(path))
    vocab = tiny.model.get_input_embeddings().weight.shape[0]
    b = pack_records(records, header, ModelShape(vocab=vocab, context=10_000), batch_size=4)
    assert [len(r.prompt_ids) for r in b.rollouts] == [4, 2] and b.logprobs == "processed"
    first = _records(path)[0]
    assert b.rollouts[0].logp_engine_processed[0] == first["logp_engine"]
    assert b.rollouts[0].logp_engine[0] == first["logp_engine"]


# ------------------------------------------------------------------------------------------------ a real GPU's record


H200 = Path(__file__).parent / "data" / "rollouts-h200-tiny-bf16.jsonl"
"""8 completions of tiny-random:0 (the same weights on every machine: built from a seed on the CPU) sampled in bf16
by phantomclip's local engine on an NVIDIA H200 (CUDA 13.0, torch 2.11, its Hugging Face decode path: cuBLAS),
recorded with `diagnose --device cuda --save-rollouts` on 2026-12-04 (results/gpu/)."""


def test_a_gpu_engines_record_is_measured_on_this_cpu(tmp_path, tiny):
    """The H200's bf16 decode against this CPU's bf16 forward of the same weights: a kernel gap a CPU stand-in cannot
    show (the local engine on a CPU decodes with the trainer's own kernels). Hand-checked here: fp32 β per token is a
    plain fp32 forward on this CPU minus the H200's recorded log-prob (the fp32 bound of two forwards, as above), and
    the engine is named as recorded."""
    from conftest import forward_terms, logit_bound

    d = _diagnose(tmp_path, "h200", "--rollouts", str(H200))
    assert d["engine"]["device"] == "NVIDIA H200"
    assert "recorded on NVIDIA H200" in d["answer"]["contract"]["engine_label"]
    rows = _records(H200)
    model = tiny.model.float().eval()
    mine = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])  # [1, L]
            P = len(r["prompt_ids"])
            lp = torch.log_softmax(model(ids).logits[0, P - 1 : -1].float(), -1)  # [C, V]
            got = lp.gather(-1, torch.tensor(r["completion_ids"])[:, None])[:, 0].double()  # [C]
            mine += (got - torch.tensor(r["logp_engine"], dtype=torch.float64)).tolist()
    context = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    bound = 2 * eps(torch.float32) * logit_bound(model) * math.sqrt(forward_terms(model.config, context)) + 5e-7
    beta = torch.tensor(d["tokens"]["per_recipe"]["fp32"]["beta"], dtype=torch.float64)
    assert (beta - torch.tensor(mine)).abs().max().item() <= bound
    kernel = torch.tensor(d["tokens"]["beta_kernel"])
    assert (kernel != 0).float().mean().item() > 0.5  # most tokens: the GPU's bf16 is not this CPU's


VLLM_CPU = Path(__file__).parent / "data" / "rollouts-vllmcpu-smollm2-bf16.jsonl"
"""8 completions of 24 tokens of the bundled model sampled by vLLM-cpu 0.32.0 in bf16 (raw log-probs) and written by
`record_vllm` from vLLM's own RequestOutputs: scripts/record_vllm_fixture.py, 2026-12-04, 2-core AMD EPYC."""


def test_a_real_engines_record_of_the_bundled_model(tmp_path):
    """vLLM-cpu's record read back without vLLM: the engine named as recorded, fp32 β per token equal to a plain fp32
    forward of the bundled model minus vLLM's log-probs (within the fp32 bound of two forwards: eps32 * |logit| *
    sqrt(terms), |logit| bounded by the head's norm), and a kernel gap on nearly every token (vLLM's bf16 kernels
    are not this forward's, unlike the local engine's)."""
    from conftest import forward_terms, logit_bound
    from phantomclip.models.load import load_model

    out = tmp_path / "v.json"
    assert main(["diagnose", "--trainer", "fp32", "--no-batch-invariance", "--rollouts", str(VLLM_CPU),
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["answer"]["contract"]["engine_label"] == "bf16 vllm-cpu 0.32.0 engine, recorded on cpu by vllm"
    lm = load_model("smollm2-135m")
    rows = _records(VLLM_CPU)
    mine = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])  # [1, L]
            P = len(r["prompt_ids"])
            lp = torch.log_softmax(lm.model(ids).logits[0, P - 1 : -1].float(), -1)  # [C, V]
            got = lp.gather(-1, torch.tensor(r["completion_ids"])[:, None])[:, 0].double()  # [C]
            mine += (got - torch.tensor(r["logp_engine"], dtype=torch.float64)).tolist()
    context = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    bound = 2 * eps(torch.float32) * logit_bound(lm.model) * math.sqrt(forward_terms(lm.model.config, context))
    beta = torch.tensor(d["tokens"]["per_recipe"]["fp32"]["beta"], dtype=torch.float64)
    assert (beta - torch.tensor(mine)).abs().max().item() <= bound + 5e-7
    assert (torch.tensor(d["tokens"]["beta_kernel"]) != 0).float().mean().item() > 0.9


@pytest.mark.parametrize("shares, word", [((0.01, 0.03), "a clear rise"), ((0.03, 0.01), "a clear fall"),
                                          ((0.02, 0.02), "no detectable change"),
                                          ((0.02, 0.025), "no detectable change")])
def test_the_post_mortem_sentence_says_the_direction_its_numbers_show(shares, word):
    """The first-to-last sentence reads the two shares it quotes by the 95% interval of their difference (1000 tokens
    a step: 10 against 30 tokens is a clear rise, 20 against 25 is not), and says when later steps were measured
    against an earlier checkpoint."""
    from phantomclip.diagnose.postmortem_text import change_sentence

    rows = [{"step": s, "tokens": 1000, "outside_trust_region": v, "lag": lag}
            for s, v, lag in ((0, shares[0], 0), (4, shares[1], 0))]
    said = change_sentence(rows)
    assert said.startswith(f"the share outside the trust region went from {100 * shares[0]:.2f}% "
                           f"({round(1000 * shares[0])} of 1000 tokens) at step 0 to {100 * shares[1]:.2f}% "
                           f"({round(1000 * shares[1])} of 1000) at step 4: {word} (difference ")
    assert "2 steps, 2000 tokens)" in said
    rows[1].update(lag=4, contains_alpha=True)
    assert change_sentence(rows).endswith("; step 4 measured against other weights than those that sampled them: "
                                          "their figures hold the policy's change too)")


def test_a_recorded_fp8_engine_splits_off_beta_quant(tmp_path, capsys):
    """An FP8 engine's record names its quantisers in vLLM's own words (fp8-w8a8-channel -> quantization
    fp8_per_channel, fp8-kv -> kv_cache_dtype fp8); read back, they select the same emulated quantisers, so the
    shadow carries them and β_quant is split off as in the sampled run, per token. A quantisation phantomclip does
    not emulate is one line."""
    path = tmp_path / "fp8.jsonl"
    a = _diagnose(tmp_path, "a", "--n", "4", "--max-tokens", "8", "--engine-quant", "fp8-w8a8-channel,fp8-kv",
                  "--save-rollouts", str(path))
    rows = _lines(path)
    assert (rows[0]["engine"]["quantization"], rows[0]["engine"]["kv_cache_dtype"]) == ("fp8_per_channel", "fp8")
    d = _diagnose(tmp_path, "b", "--rollouts", str(path))
    assert d["config"]["engine_quant"] == "fp8-w8a8-channel,fp8-kv"
    assert d["shadow"]["recipe"] == a["shadow"]["recipe"] == "bf16+fp8-w8a8-channel+fp8-kv"
    assert d["tokens"]["beta_quant"] == a["tokens"]["beta_quant"]
    rows[0]["engine"]["quantization"] = "awq"
    capsys.readouterr()
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(_write(tmp_path / "awq.jsonl", rows))], capsys)
    assert "engine.quantization 'awq' is not one phantomclip emulates" in line


def test_parquet_files_read_as_their_records(saved, tmp_path):
    """The same records as Parquet, read in row batches: phantomclip's columns with the header in the file's
    metadata, and miles' dashboard columns (tokens, response_length, rollout_log_probs: 'tempered' log-probs, as its
    torch dumps) give the JSONL's figures per token."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    _, path = saved
    header, *rows = _lines(path)
    own = tmp_path / "own.parquet"
    table = pa.Table.from_pylist(rows).replace_schema_metadata({"phantomclip_rollouts": json.dumps(header)})
    pq.write_table(table, own, row_group_size=2)
    a = _diagnose(tmp_path, "jsonl", "--rollouts", str(path))
    b = _diagnose(tmp_path, "parquet", "--rollouts", str(own))
    assert a["tokens"]["per_recipe"] == b["tokens"]["per_recipe"]
    miles = tmp_path / "rollout_3.parquet"
    pq.write_table(pa.Table.from_pylist([{"tokens": r["prompt_ids"] + r["completion_ids"],
                                          "response_length": len(r["completion_ids"]),
                                          "rollout_log_probs": r["logp_engine"]} for r in rows]), miles)
    c = _diagnose(tmp_path, "miles", "--rollouts", str(miles), "--temperature", "0.8")
    assert c["engine"]["logprobs"] == "tempered" and c["tokens"]["per_recipe"] == a["tokens"]["per_recipe"]


def test_the_answer_names_each_stand_in_it_measured_against():
    """The local engine (its own recipe's gap zero by construction) and vLLM's CPU build (a real engine, not the
    user's GPU one) each add their two lines to the answer; a recorded engine adds neither."""
    from phantomclip.answer.decide import STAND_IN, VLLM_CPU_STAND_IN, answer

    def result(kind: str, device: str) -> dict:
        rec = {"tokens": 100, "nonfinite": 0, "beta_abs_mean": 0.04, "outside_trust_region": 0.0}
        return {"recipes": {"fp32": rec}, "engine": {"kind": kind, "dtype": "bf16", "nonfinite_logprobs": 0},
                "device": {"name": device}, "shadow": {"recipe": "bf16"}, "config": {"answer_in": ""},
                "trust_region": {"epsilon_low": 0.2, "epsilon_high": 0.2}}

    assert all(line in answer(result("local", "cpu"))["reasons"] for line in STAND_IN)
    assert all(line in answer(result("vllm", "cpu"))["reasons"] for line in VLLM_CPU_STAND_IN)
    on_gpu, recorded = answer(result("vllm", "NVIDIA H200"))["reasons"], answer(result("recorded", "cpu"))["reasons"]
    assert not set(STAND_IN + VLLM_CPU_STAND_IN) & set(on_gpu + recorded)


def test_the_article_draws_a_post_mortem(saved, tmp_path):
    """A post-mortem JSON given to `report --from` becomes the article's step-by-step figure: the share outside per
    step, the note being the first-to-last test's short form, and the engine's recorded name reaching the page as
    text (a hostile name is escaped, in the caption and in Plotly)."""
    from phantomclip.report import collect, render
    from phantomclip.report.growth_panel import fig_postmortem

    _, path = saved
    rows = _lines(path)
    rows[0]["engine"]["name"] = "<b>evil</b>"
    steps = tmp_path / "steps"
    steps.mkdir()
    for step in (0, 2):
        _write(steps / f"step-{step}.jsonl", [rows[0], *[dict(r, step=step) for r in rows[1:]]])
    d = _diagnose(tmp_path, "pm", "--rollouts", str(steps))
    fig = fig_postmortem([d])
    assert fig["data"][0]["x"] == [0, 2] and fig["layout"]["annotations"][0]["text"].startswith(
        "no detectable change, step 0 to 2 (+0.00 pp")
    page = render(collect([str(tmp_path / "pm.json")]))
    assert "Your run, step by step" in page and "<b>evil</b>" not in page and "&lt;b&gt;evil" in page


def test_a_headers_words_are_printed_as_text(saved, tmp_path, capsys):
    """Header text reaches the terminal as text: rich markup ('[/]' once ended in a MarkupError traceback after the
    whole measurement, '[link=...]' made a link, '[v2]' vanished), escape sequences (ESC[2J, an OSC title) and a
    newline that would forge a line of output are shown escaped, not obeyed."""
    _, path = saved
    rows = _lines(path)
    rows[0]["engine"]["name"] = "trl [v2] [/]\nverdict: OK, no gap"
    rows[0]["source"] = "verl run [/data/run1] \x1b[2J \x1b]0;title\x07 [link=https://example.com]docs[/link]"
    capsys.readouterr()
    assert main(["diagnose", *TINY, *RECIPES, "--rollouts", str(_write(tmp_path / "h.jsonl", rows))]) == 0
    out = capsys.readouterr()
    printed = out.out + out.err
    assert "\x1b" not in printed and "\x07" not in printed
    assert "trl [v2] [/]\\x0averdict: OK, no gap" in " ".join(printed.split())
    assert not any(line.startswith("verdict: OK") for line in printed.splitlines())
    assert "[link=https://example.com]docs[/link]" in " ".join(printed.split())
