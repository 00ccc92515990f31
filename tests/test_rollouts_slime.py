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
from phantomclip.cli.main import main
from phantomclip.rollouts.slime_dumps import load_dump

TINY = ["--model", "tiny-random:0"]
RECIPES = ["--trainer", "fp32,bf16"]


def _diagnose(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["diagnose", *TINY, *RECIPES, "--json", str(out), *args]) == 0
    return json.loads(out.read_text())


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
