"""slime's `--save-debug-train-data` dumps (format 2, slime/observability/train_data_utils.py `_build_dump_payload`
@624b824) read as rollout records with the trainer's own log-probs (rollouts/slime_dumps.py `read_train_data`), and
the figures diagnose adds for them: β as the user's trainer computed it, and its gap to our re-score
(diagnose/recorded.py `recorded_trainer`, the JSON's recorded_trainer).
"""

import json
import math

import pytest
import torch

from conftest import bad_cli, eps, forward_terms, logit_bound
from phantomclip.cli.main import main
from phantomclip.rollouts.readers import read_rollouts
from test_rollouts import TINY

OFFSETS = (0.0, 0.05, -0.3, 0.25, -0.01)
"""their trainer's log-prob minus the engine's, by token index mod 5: -0.3 and 0.25 lie outside the trust region
[log 0.8, log 1.2] = [-0.223, 0.182] by more than float32 rounding, the others inside it."""
TOOL = (1, slice(2, 5))
"""(sample, response tokens) of a tool's output: loss_masks 0, rollout_log_probs 0.0 placeholders (slime
Sample.add_response_tokens), a trainer log-prob all the same (slime computes it; the loss mask leaves it out)."""


@pytest.fixture(scope="module")
def rows(tiny, tiny_prompts):
    """Six records sampled from tiny-random:0 at temperature 0.8 (seeded, 10 tokens, no truncation), each token's
    engine log-prob its fp32 log-prob at that temperature rounded to bf16's 8 bits, as an engine's gap. The prompts
    are cut to 24 tokens, so the six decode as one batch without padding."""
    model, gen, P = tiny.model.float().eval(), torch.Generator().manual_seed(0), 24
    ids = torch.tensor([prompt[:P] for prompt in tiny_prompts[:6]])  # [6, P]
    with torch.no_grad():
        for _ in range(10):
            probs = torch.softmax(model(ids).logits[:, -1] / 0.8, -1)  # [6, V]
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)  # [6, P + t + 1]
        lp = torch.log_softmax(model(ids).logits[:, P - 1 : -1].float() / 0.8, -1)  # [6, 10, V]
    logp = lp.gather(-1, ids[:, P:, None])[..., 0].bfloat16().float().clamp(max=0)  # [6, 10]
    return [{"prompt_ids": row[:P].tolist(), "completion_ids": row[P:].tolist(), "logp_engine": lp_row.tolist()}
            for row, lp_row in zip(ids, logp)]


def _theirs(r: dict) -> list[float]:
    """Their trainer's log-probs of one record: the engine's plus OFFSETS, at most 0."""
    return [min(lp + OFFSETS[t % len(OFFSETS)], 0.0) for t, lp in enumerate(r["logp_engine"])]


def _payload(rows: list[dict], rollout_id: int = 7) -> dict:
    """A format-2 train dump as `_build_dump_payload` returns it for one DP shard of these samples: per sample the
    trainer's columns (slime/ray/rollout.py `_convert_samples_to_train_data`, tensorised by
    `tensorize_rollout_data_for_training`: tokens int64, loss_masks int32, rollout_log_probs float32; log_probs the
    trainer's float32, response_lengths / total_lengths ints), its data_parallel_rank, sample_index and
    rollout_position; the layout under dp_shards; raw_reward once at the top."""
    samples = []
    for i, r in enumerate(rows):
        n = len(r["completion_ids"])
        mask, engine = torch.ones(n, dtype=torch.int32), torch.tensor(r["logp_engine"], dtype=torch.float32)
        if i == TOOL[0]:
            mask[TOOL[1]], engine[TOOL[1]] = 0, 0.0
        samples.append({"data_parallel_rank": 0, "sample_index": i, "rollout_position": i,
                        "tokens": torch.tensor(r["prompt_ids"] + r["completion_ids"], dtype=torch.long),
                        "response_lengths": n, "rewards": 1.0, "truncated": 0, "loss_masks": mask, "rollout_ids": i,
                        "rollout_mask_sums": torch.tensor(float(mask.sum())), "rollout_log_probs": engine,
                        "total_lengths": len(r["prompt_ids"]) + n, "log_probs": torch.tensor(_theirs(r)),
                        "advantages": torch.full((n,), 0.5), "returns": torch.full((n,), 0.5)})
    layout = {"rank": 0, "data_parallel_rank": 0, "sample_indices": list(range(len(rows))),
              "partition": list(range(len(rows))), "micro_batch_indices": [[list(range(len(rows)))]],
              "num_microbatches": [1], "global_batch_sizes": [len(rows)]}
    return {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": samples, "dp_shards": [layout],
            "raw_reward": [1.0] * len(rows)}


def _rollout_dump(rows: list[dict]) -> dict:
    """The same samples as --save-debug-rollout-data writes them (Sample.to_dict())."""
    return {"rollout_id": 7, "samples": [
        {"tokens": r["prompt_ids"] + r["completion_ids"], "response_length": len(r["completion_ids"]),
         "rollout_log_probs": r["logp_engine"], "loss_mask": [1] * len(r["completion_ids"]), "status": "completed"}
        for r in rows]}


def _kept(payload: dict, column: str) -> list[float]:
    """A per-token column on the loss-mask-1 tokens, flat in sample order, as float64."""
    return [float(v) for s in payload["samples"] for v, m in zip(s[column].tolist(), s["loss_masks"].tolist()) if m]


def test_a_train_dump_reads_as_records_with_the_trainers_log_probs(rows, tmp_path):
    payload = _payload(rows)
    torch.save(payload, tmp_path / "train_7_0.pt")
    header, records = read_rollouts(str(tmp_path / "train_7_0.pt"))
    records = [located.record for located in records]
    assert header.source == "slime --save-debug-train-data" and header.logprobs == "tempered"
    assert len(records) == len(rows)
    for r, row, s in zip(records, rows, payload["samples"]):
        assert (r.prompt_ids, r.completion_ids, r.step) == (row["prompt_ids"], row["completion_ids"], 7)
        assert r.logp_trainer_recorded == s["log_probs"].tolist()  # the float32 values, exactly
        assert r.logp_engine == s["rollout_log_probs"].tolist()
    assert records[TOOL[0]].loss_mask[TOOL[1]] == [0, 0, 0] and records[0].loss_mask is None


def test_the_recorded_beta_and_the_gap_to_our_rescore(rows, tmp_path, tiny, capsys):
    """β as their trainer computed it is theirs − the engine's on the loss-mask tokens, by hand in float64 (both
    columns float32, so each difference is exact; the means differ from a sequential sum by the summation order
    only: N · eps64 · max|β|). The gap to our fp32 re-score equals theirs − an independent fp32 scoring of each
    record alone (phantomclip.precision.scoring), within two fp32 forwards in other shapes: eps32 · |logit| ·
    sqrt(forward terms), with a factor 4 of margin, over temperature 0.8."""
    from phantomclip.precision.recipes import apply_recipe, get_recipe
    from phantomclip.precision.scoring import score

    payload = _payload(rows)
    dump = tmp_path / "train_7_0.pt"
    torch.save(payload, dump)
    out = tmp_path / "out.json"
    assert main(["diagnose", *TINY, "--trainer", "fp32,bf16", "--rollouts", str(dump), "--temperature", "0.8",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    got = res["recorded_trainer"]

    theirs, engine = _kept(payload, "log_probs"), _kept(payload, "rollout_log_probs")
    beta = [a - b for a, b in zip(theirs, engine)]
    n = len(beta)
    assert got["beta"]["tokens"] == n == got["tokens_of_run"] == res["engine"]["tokens"]
    tol = n * eps(torch.float64) * max(abs(b) for b in beta)
    assert math.isclose(got["beta"]["beta_abs_mean"], sum(abs(b) for b in beta) / n, rel_tol=0, abs_tol=tol)
    assert math.isclose(got["beta"]["beta_mean"], sum(beta) / n, rel_tol=0, abs_tol=tol)
    assert got["beta"]["beta_abs_max"] == max(abs(b) for b in beta)
    outside = sum(b < math.log(0.8) or b > math.log(1.2) for b in beta)
    assert 0 < outside < n and got["beta"]["outside_trust_region"] == outside / n

    model = apply_recipe(tiny.model, get_recipe("fp32"))
    ours = []
    for i, r in enumerate(rows):
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])  # [1, L]
        comp = torch.zeros_like(ids, dtype=torch.bool)
        comp[0, len(r["prompt_ids"]):] = True
        lp = score(model, get_recipe("fp32"), ids, torch.ones_like(ids), comp, temperature=0.8).logp[0, comp[0]]
        keep = payload["samples"][i]["loss_masks"].bool()
        ours += lp[keep].double().tolist()
    delta = [a - b for a, b in zip(theirs, ours)]
    context = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    bound = 4 * eps(torch.float32) * logit_bound(tiny.model) / 0.8 * math.sqrt(forward_terms(tiny.model.config,
                                                                                              context))
    gap = got["gap"]["fp32"]
    assert gap["tokens"] == n
    assert abs(gap["abs_mean"] - sum(abs(d) for d in delta) / n) <= bound
    assert abs(gap["abs_max"] - max(abs(d) for d in delta)) <= bound
    assert min(abs(d) for d in delta) < 0.2 < max(abs(d) for d in delta)  # the offsets are in the gap, not noise
    assert set(got["gap"]) == {"fp32", "bf16"}

    assert "β as your trainer computed it (its log-probs − the engine's): mean |β| " in printed
    assert "fp32 re-scored here: mean |β|" in printed and "your trainer − this re-score: mean |Δ|" in printed
    # the answer says both shares, and which one its status rests on when they fall on different sides of a bound
    ans = res["answer"]
    said = [r for r in ans["reasons"] if r.startswith("your trainer's own log-probs (recorded with the tokens) put ")]
    mine = res["recipes"]["fp32"]["outside_trust_region"]
    assert len(said) == 1 and f"{100 * outside / n:.2f}% of tokens outside" in said[0]
    assert f"against {100 * mine:.2f}% for the fp32 re-score here" in said[0]
    theirs_word = "will stall" if outside / n >= 0.10 else "at risk"  # 0 < outside: never ok
    assert (f"on theirs alone the status would be {theirs_word.upper()}" in said[0]) == (ans["status"] != theirs_word)


def test_beside_its_rollout_dump_a_train_dump_counts_each_sample_once(rows, tmp_path):
    """A directory with both dumps of one rollout: the rollout-data dump is left out (noted), the train dump's
    samples are measured once (its loss-mask-1 tokens, by count), with the trainer's figures; the rollout-data dump
    alone has none."""
    payload = _payload(rows)
    torch.save(payload, tmp_path / "train_7_0.pt")
    torch.save(_rollout_dump(rows), tmp_path / "rollout_7.pt")
    both, alone = tmp_path / "both.json", tmp_path / "alone.json"
    for path, out in ((tmp_path, both), (tmp_path / "rollout_7.pt", alone)):
        assert main(["diagnose", *TINY, "--trainer", "fp32", "--rollouts", str(path), "--temperature", "0.8",
                     "--json", str(out)]) == 0
    res = json.loads(both.read_text())
    n = len(_kept(payload, "log_probs"))
    assert res["engine"]["tokens"] == res["recorded_trainer"]["beta"]["tokens"] == n
    assert any("left out 1 --save-debug-rollout-data dump(s)" in note for note in res["engine"]["notes"])
    assert "recorded_trainer" not in json.loads(alone.read_text())


def _bad(payload: dict, tmp_path, capsys) -> str:
    torch.save(payload, tmp_path / "train_7_0.pt")
    return bad_cli(["diagnose", *TINY, "--rollouts", str(tmp_path / "train_7_0.pt"), "--temperature", "0.8"], capsys)


def test_a_train_dump_of_another_format_version_is_refused(rows, tmp_path, capsys):
    line = _bad({**_payload(rows[:2]), "format_version": 1}, tmp_path, capsys)
    assert "train_7_0.pt: a --save-debug-train-data dump with format_version 1: phantomclip reads format 2" in line
    payload = _payload(rows[:2])
    del payload["format_version"]
    line = _bad(payload, tmp_path, capsys)
    assert "train_7_0.pt: a --save-debug-train-data dump with no format_version" in line, line
    miles = {"rollout_id": 7, "rank": 0, "rollout_data": {"tokens": [torch.arange(5)]}, "cp_rank": 0, "cp_size": 1}
    line = _bad(miles, tmp_path, capsys)  # miles @31f1ca9 miles/utils/train_dump_utils.py
    assert "train_7_0.pt: a per-rank --save-debug-train-data file without format_version" in line, line


def test_a_sample_whose_log_probs_are_not_one_per_response_token_is_refused(rows, tmp_path, capsys):
    payload = _payload(rows[:2])
    payload["samples"][1]["log_probs"] = payload["samples"][1]["log_probs"][:3]  # one context-parallel shard's
    line = _bad(payload, tmp_path, capsys)
    n = len(rows[1]["completion_ids"])
    assert (f"train_7_0.pt sample 1: log_probs (3 values) are not one per response token (response_lengths {n}, "
            f"loss_masks {n} values)") in line, line


def test_a_train_dump_without_the_engines_log_probs_is_refused(rows, tmp_path, capsys):
    payload = _payload(rows[:2])
    for s in payload["samples"]:
        del s["rollout_log_probs"]
    line = _bad(payload, tmp_path, capsys)
    assert "train_7_0.pt sample 0: has no rollout_log_probs" in line and "Sample.rollout_log_probs" in line, line


@pytest.mark.parametrize("value, said", [
    ([-0.1], "logp_trainer_recorded has 1 values for 3 completion tokens"),
    ([-0.1, float("nan"), -0.2], "logp_trainer_recorded[1] = nan is not finite: record the trainer's log-prob"),
])
def test_a_record_with_bad_trainer_log_probs_is_refused(tmp_path, capsys, value, said):
    """The JSON Lines field is checked as logp_engine is (rollouts.record.check_logprobs)."""
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "logp_engine": [-0.1, -0.2, -0.3],
                                "logp_trainer_recorded": value}) + "\n")
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(path)], capsys)
    assert f"r.jsonl:1: {said}" in line, line
