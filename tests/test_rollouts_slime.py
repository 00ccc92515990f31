"""slime's dumps as slime writes them (rollouts/slime_dumps.py, checked against THUDM/slime @624b824): numpy scalars
read as data while a pickle that would run code is refused; multi-turn samples scored on their loss_mask = 1 tokens;
top-p dumps scored over the recorded nucleus, as slime's trainer scores them; `--save-debug-train-data` (format 2)
read with the trainer's own log-probs.
"""

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import bad_cli, eps
from phantomclip.rollouts.slime_dumps import load_dump
from test_rollouts import TINY, _diagnose  # the same diagnose runs as the rollout tests'


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The local engine's tokens at temperature 0.8 without truncation, saved as a rollout file: (result, records)."""
    tmp = tmp_path_factory.mktemp("saved")
    path = tmp / "r.jsonl"
    result = _diagnose(tmp, "sampled", "--n", "6", "--max-tokens", "10", "--temperature", "0.8", "--batch-size", "4",
                       "--save-rollouts", str(path))
    return result, [json.loads(line) for line in path.read_text().splitlines()[1:]]


def _sample(r: dict, **extra) -> dict:
    """One record as slime's Sample.to_dict() (slime/utils/types.py @624b824): tokens = prompt + response, one
    rollout log-prob and one loss-mask entry per response token, status a string, the reward a number."""
    return {"tokens": r["prompt_ids"] + r["completion_ids"], "response_length": len(r["completion_ids"]),
            "rollout_log_probs": list(r["logp_engine"]), "loss_mask": [1] * len(r["completion_ids"]),
            "weight_versions": ["7"], "status": "completed", "reward": -1.0, **extra}


# ------------------------------------------------------------------------------------------------ numpy scalars


def test_numpy_scalars_load_as_data(tmp_path):
    """A real torch.save of numpy scalars and an array (what a reward function returns) loads as those values."""
    path = tmp_path / "np.pt"
    torch.save({"rollout_id": np.int64(3), "samples": [{"reward": np.float32(0.5), "ok": np.bool_(True),
                                                         "n": np.int64(7), "a": np.arange(3, dtype=np.int32)}]}, path)
    data = load_dump(str(path))
    s = data["samples"][0]
    assert data["rollout_id"] == 3 and s["reward"] == np.float32(0.5) and s["ok"] is np.True_ and s["n"] == 7
    assert s["a"].tolist() == [0, 1, 2]


def test_a_slime_dump_with_numpy_scalars_reads(saved, tmp_path):
    """slime samples whose reward and response_length are numpy scalars read as the plain dump's records."""
    result, rows = saved
    plain, numpy = tmp_path / "plain.pt", tmp_path / "numpy.pt"
    torch.save({"rollout_id": 7, "samples": [_sample(r) for r in rows]}, plain)
    torch.save({"rollout_id": np.int64(7), "samples": [_sample(r, reward=np.float32(1.0),
                response_length=np.int64(len(r["completion_ids"]))) for r in rows]}, numpy)
    a = _diagnose(tmp_path, "plain", "--rollouts", str(plain), "--temperature", "0.8")
    b = _diagnose(tmp_path, "numpy", "--rollouts", str(numpy), "--temperature", "0.8")
    assert a["tokens"]["per_recipe"] == b["tokens"]["per_recipe"]


class _Payload:
    """A pickled object whose loading would run code (what weights_only must refuse)."""

    def __reduce__(self):
        return (Path.touch, (Path("/tmp/phantomclip-pwned-slime"),))


@pytest.mark.parametrize("protocol, named", [(2, "getattr"), (pickle.DEFAULT_PROTOCOL, "an object")])
def test_a_pickle_that_would_run_code_is_still_refused(tmp_path, capsys, protocol, named):
    """Beside allowed numpy scalars, a payload that would call Path.touch is refused and never runs; at torch's own
    pickle protocol (2) torch names the global (getattr, which fetches Path.touch), at protocol 4 it stops at the
    opcode, unnamed."""
    Path("/tmp/phantomclip-pwned-slime").unlink(missing_ok=True)
    dump = tmp_path / "evil.pt"
    torch.save({"rollout_id": 0, "samples": [{"reward": np.float32(1.0)}, _Payload()]}, dump,
               pickle_protocol=protocol)
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(dump)], capsys)
    assert f"evil.pt: refused: it pickles {named}" in line and "could run code" in line, line
    assert not Path("/tmp/phantomclip-pwned-slime").exists()


# ------------------------------------------------------------------------------------------------ multi-turn


def test_a_multi_turn_sample_is_scored_on_its_loss_mask_1_tokens(saved, tmp_path):
    """Sample 1 with tokens 2-4 of its response a tool's output (loss_mask 0, rollout_log_probs 0.0 placeholders, as
    slime's Sample.add_response_tokens writes them): those tokens stay in the context and leave every figure; the
    other tokens give the single-turn run's β. Expected, by hand: the single-turn per-token β without those three
    tokens, and mean |β| over the rest. Both runs score every row in one head chunk of the same hidden states, so the
    kept tokens' β may differ only where the head's matmul sees fewer rows (other blocking): within the 1e-6 rounding
    of the per-token arrays plus a few fp32 ulps of |β| (< 1), and bf16's ulp for the bf16 recipe."""
    _, rows = saved
    single, multi = tmp_path / "single.pt", tmp_path / "multi.pt"
    torch.save({"rollout_id": 7, "samples": [_sample(r) for r in rows]}, single)
    samples = [_sample(r) for r in rows]
    samples[1]["loss_mask"][2:5] = [0, 0, 0]
    samples[1]["rollout_log_probs"][2:5] = [0.0, 0.0, 0.0]
    torch.save({"rollout_id": 7, "samples": samples}, multi)
    a = _diagnose(tmp_path, "single", "--rollouts", str(single), "--temperature", "0.8")
    b = _diagnose(tmp_path, "multi", "--rollouts", str(multi), "--temperature", "0.8")
    dropped = [i for i, (s, p) in enumerate(zip(a["tokens"]["sequence"], a["tokens"]["position"]))
               if s == 1 and p in (2, 3, 4)]
    assert len(dropped) == 3
    for recipe, tol in (("fp32", 1e-6 + 8 * eps(torch.float32)), ("bf16", 1e-6 + eps(torch.bfloat16))):
        expected = [v for i, v in enumerate(a["tokens"]["per_recipe"][recipe]["beta"]) if i not in dropped]
        got = b["tokens"]["per_recipe"][recipe]["beta"]
        assert len(got) == len(expected) == len(a["tokens"]["per_recipe"][recipe]["beta"]) - 3
        assert max(abs(x - y) for x, y in zip(got, expected)) <= tol, recipe
        mean_abs = sum(abs(v) for v in expected) / len(expected)
        assert math.isclose(b["recipes"][recipe]["beta_abs_mean"], mean_abs, rel_tol=0, abs_tol=tol), recipe
    assert (1, 2) not in set(zip(b["tokens"]["sequence"], b["tokens"]["position"]))


# ------------------------------------------------------------------------------------------------ top-p


def _nucleus_dump(rows: list[dict], model, drop_target: tuple[int, int]) -> tuple[dict, list[float], list[float]]:
    """A slime top-p dump built by hand: each token's nucleus is the top-p 0.7 set of an independent fp32 forward at
    temperature 0.8 (sorted, kept while the mass before a token is under 0.7: a nucleus other than the trainer's own
    top-p 0.9 would keep, as an engine's kernels give it another one), flattened as slime's ragged
    rollout_top_p_token_ids / _offsets; the engine's log-prob is that forward's log-prob renormalised over the
    nucleus plus the engine's own gap g (the saved full-vocabulary engine column minus the forward's), so slime's
    trainer-side β of an exact fp32 trainer is −g. At `drop_target` (row, token) the sampled token is left out of its
    nucleus: slime's trainer counts it anyway. Returns (dump, −g per token, log S per token), flat."""
    samples, minus_g, log_s = [], [], []
    with torch.no_grad():
        for b, r in enumerate(rows):
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])  # [1, L]
            P, target = len(r["prompt_ids"]), torch.tensor(r["completion_ids"])  # [n]
            lp_all = torch.log_softmax(model(ids).logits[0, P - 1 : -1].float() / 0.8, -1)  # [n, V]
            flat, offsets, processed = [], [0], []
            for t in range(len(target)):
                order = lp_all[t].argsort(descending=True)  # [V]
                p = lp_all[t, order].exp()
                kept = order[(p.cumsum(0) - p) < 0.7].tolist()
                if (b, t) == drop_target and int(target[t]) in kept and len(kept) > 1:
                    kept.remove(int(target[t]))
                counted = sorted(set(kept) | {int(target[t])})
                s = torch.logsumexp(lp_all[t, counted], 0).item()  # log S over the nucleus and the sampled token
                g = r["logp_engine"][t] - lp_all[t, target[t]].item()
                processed.append(min(lp_all[t, target[t]].item() - s + g, 0.0))
                minus_g.append(lp_all[t, target[t]].item() - s - processed[-1])
                log_s.append(s)
                flat += kept
                offsets.append(len(flat))
            samples.append(_sample(r, rollout_log_probs=processed, rollout_top_p_token_ids=torch.tensor(
                flat, dtype=torch.int32), rollout_top_p_token_offsets=torch.tensor(offsets, dtype=torch.int32)))
    return {"rollout_id": 7, "samples": samples}, minus_g, log_s


def test_a_top_p_dump_is_scored_over_its_recorded_nucleus(saved, tmp_path, tiny):
    """fp32 trainer, slime's way: log p(target) − logsumexp over the recorded nucleus (and the target) − the engine's
    log-prob, per token, equals the hand-built −g. Read from the JSON as logp − log_kept − logp_engine_processed
    (logp = beta + the rebuilt full column). Bound, as for an independent forward: two fp32 forwards in other shapes
    differ by about eps32 · |logit| · sqrt(terms), plus the JSON's 6-decimal rounding of three numbers. The same dump
    read without its nucleus (SGLang's tempered full-vocabulary reading) is off by log S itself."""
    from conftest import forward_terms, logit_bound

    _, rows = saved
    model = tiny.model.float().eval()
    dump, minus_g, log_s = _nucleus_dump(rows, model, drop_target=(2, 1))
    s2 = dump["samples"][2]
    outside = s2["rollout_top_p_token_ids"][s2["rollout_top_p_token_offsets"][1]:s2["rollout_top_p_token_offsets"][2]]
    assert rows[2]["completion_ids"][1] not in outside.tolist()  # the force-kept token is tested
    torch.save(dump, tmp_path / "7.pt")
    res = _diagnose(tmp_path, "nucleus", "--rollouts", str(tmp_path / "7.pt"), "--temperature", "0.8",
                    "--top-p", "0.9")
    assert res["engine"]["logprobs"] == "processed"
    tok, fp32 = res["tokens"], res["tokens"]["per_recipe"]["fp32"]
    logp = torch.tensor(fp32["beta"], dtype=torch.float64) + torch.tensor(tok["logp_engine"], dtype=torch.float64)
    slime_beta = logp - torch.tensor(fp32["log_kept"], dtype=torch.float64) - torch.tensor(
        tok["logp_engine_processed"], dtype=torch.float64)
    context = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    bound = 4 * eps(torch.float32) * logit_bound(model) / 0.8 * math.sqrt(forward_terms(model.config, context)) + 2e-6
    assert (slime_beta - torch.tensor(minus_g, dtype=torch.float64)).abs().max().item() <= bound
    assert max(abs(a - b) for a, b in zip(fp32["log_kept"], log_s)) <= bound

    for s in dump["samples"]:  # the nucleus dropped: read as 'tempered', full vocabulary
        del s["rollout_top_p_token_ids"], s["rollout_top_p_token_offsets"]
    torch.save(dump, tmp_path / "full.pt")
    full = _diagnose(tmp_path, "full", "--rollouts", str(tmp_path / "full.pt"), "--temperature", "0.8")
    assert full["engine"]["logprobs"] == "tempered"
    off = [b - m for b, m in zip(full["tokens"]["per_recipe"]["fp32"]["beta"], minus_g)]
    assert max(abs(o - s) for o, s in zip(off, log_s)) <= bound  # β_full = −g + log S: off by the kept mass
    assert min(log_s) < -10 * bound


def test_a_top_p_dump_without_the_runs_top_p_is_refused(saved, tmp_path, capsys, tiny):
    _, rows = saved
    dump, _, _ = _nucleus_dump(rows[:2], tiny.model.float().eval(), drop_target=(-1, -1))
    torch.save(dump, tmp_path / "7.pt")
    line = bad_cli(["diagnose", *TINY, "--rollouts", str(tmp_path / "7.pt"), "--temperature", "0.8"], capsys)
    assert "7.pt: its records carry the engine's top-p nucleus" in line and "--rollout-top-p" in line, line


def test_which_weights_scores_a_top_p_dump_over_its_nucleus(saved, tmp_path, tiny):
    """The post-mortem's matching (which_weights.candidate_logps) reads a top-p dump as the main path does: the
    engine-dtype shadow's log-probs renormalised over the recorded nucleus, against the engine's processed column.
    Its median |β| equals the one the main diagnose computes for the same recipe (the same scoring: to the JSON's
    6-decimal rounding of the three numbers each token's β is rebuilt from), and is far from the full-vocabulary
    reading's, which is off by log S (the nucleus's mass) on every token."""
    from phantomclip.diagnose.config import DiagnoseConfig
    from phantomclip.diagnose.job import settled
    from phantomclip.diagnose.which_weights import candidate_logps, median_abs, sample_by_step
    from phantomclip.maths.metrics import quantile_or_nan

    _, rows = saved
    dump, _, _ = _nucleus_dump(rows, tiny.model.float().eval(), drop_target=(-1, -1))
    torch.save(dump, tmp_path / "7.pt")
    res = _diagnose(tmp_path, "nucleus", "--rollouts", str(tmp_path / "7.pt"), "--temperature", "0.8",
                    "--top-p", "0.9", "--no-batch-invariance")
    cfg = settled(DiagnoseConfig(model="tiny-random:0", rollouts=str(tmp_path / "7.pt"), temperature=0.8, top_p=0.9,
                                 typed_flags=["temperature", "top_p"]))  # as the command line types them
    shadow = cfg.engine_recipe().name
    tok, main = res["tokens"], res["tokens"]["per_recipe"][shadow]
    beta_main = [b + e - k - p for b, e, k, p in zip(main["beta"], tok["logp_engine"], main["log_kept"],
                                                     tok["logp_engine_processed"])]
    header, samples = sample_by_step(cfg.rollouts, [7], 64)
    logp_engine, logp_shadow, mask = candidate_logps(cfg, cfg.model, header, samples)[7]
    median_ww = median_abs(logp_engine, logp_shadow, mask)
    assert int(mask.sum()) == len(beta_main)
    median_main = quantile_or_nan(torch.tensor(beta_main, dtype=torch.float64).abs(), 0.5)
    assert abs(median_ww - median_main) <= 4 * 5e-7  # four numbers rounded to 6 decimals in the JSON
    for sample in dump["samples"]:  # the nucleus dropped: read as 'tempered', the whole vocabulary
        del sample["rollout_top_p_token_ids"], sample["rollout_top_p_token_offsets"]
    torch.save(dump, tmp_path / "full.pt")
    whole = settled(DiagnoseConfig(model="tiny-random:0", rollouts=str(tmp_path / "full.pt"), temperature=0.8,
                                   typed_flags=["temperature"]))
    header, samples = sample_by_step(whole.rollouts, [7], 64)
    assert median_ww < 0.5 * median_abs(*candidate_logps(whole, whole.model, header, samples)[7])  # off by log S
