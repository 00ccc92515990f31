"""`phantomclip trace --run DIR` (trace/growth.py): how β grows along a run, from the snapshots `train --keep-snapshots`
kept. On tiny-random: a 4-step run with snapshots every 2 gives every figure, and each change of mean |β| splits
into mix + within + interaction exactly."""

import json
import math

import pytest
import torch

from conftest import bad_cli
from phantomclip.cli.main import main
from phantomclip.precision.recipes import cpu_description
from phantomclip.precision.scoring import LOGIT_STATS

RUN = ["train", "--model", "tiny-random:30", "--steps", "4", "--group-size", "4", "--max-tokens", "8", "--lr", "3e-3",
       "--keep-snapshots", "2"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("growth") / "run"
    assert main([*RUN, "--out", str(out)]) == 0
    return out


def test_every_snapshot_measured_and_the_decomposition_adds_up(run_dir, tmp_path, capsys):
    assert main(["trace", "--run", str(run_dir), "--json", str(tmp_path / "g.json")]) == 0
    result = json.loads((tmp_path / "g.json").read_text())
    rows = {r["step"]: r for r in result["snapshots"]}
    assert sorted(rows) == [0, 2, 4] and result["reference_step"] == 0
    assert "own" in rows[0] and "own" in rows[2] and "own" not in rows[4]  # no batch was sampled with θ_4
    assert rows[0]["weights"]["relative_drift"] == 0 and 0 < rows[2]["weights"]["relative_drift"]
    # step 0's own tokens are the reference tokens, measured with the same weights: the same figures exactly
    assert rows[0]["own"] == {k: v for k, v in rows[0]["reference"].items() if k != "depth"}
    for row in rows.values():
        for which in ("reference", "own"):
            if which not in row:
                continue
            r, d = row[which], row[which]["change_since_first"]
            # float64 sums of 8 bucket terms of size <= 1: the identity holds to ~1e-16; 1e-12 leaves room
            assert abs(d["mix"] + d["within"] + d["interaction"] - d["change"]) < 1e-12, d
            assert abs(r["beta_abs_mean"] - d["mean_b"]) < 1e-12 and abs(sum(r["bucket_share"]) - 1) < 1e-12
            # logit statistics (checked by hand in test_scoring): finite, and the logits spread
            assert r["logit_std_mean"] > 0 and all(math.isfinite(r[f"{n}_mean"]) for n in LOGIT_STATS), r
    assert rows[2]["reference"]["change_since_first"]["change"] != 0  # the network moved under fixed tokens
    # along the depth, on the reference tokens: the embedding, each of the 2 layers' residual stream, the ends
    depth = rows[2]["reference"]["depth"]
    assert [d["site"] for d in depth] == ["embed", "layers.0.residual", "layers.1.residual", "final_norm", "logits"]
    assert all(d["rel_error"] > 0 and d["ref_max_abs"] > 0 for d in depth)  # bf16 engine against the fp32 trainer
    assert "depth" not in rows[2]["own"]
    assert "how β grows along" in capsys.readouterr().out


def test_explicit_cpu_gives_the_default_figures(run_dir, tmp_path, capsys):
    """`trace --run --device cpu` (the setting reaches the model, the rescoring engine and the hooked forwards) gives
    the default's figures exactly on a machine where `auto` is the CPU, and records where it ran."""
    if torch.cuda.is_available():
        pytest.skip("auto is CUDA on this machine")
    results = {}
    for device in ("auto", "cpu"):
        out = tmp_path / f"{device}.json"
        assert main(["trace", "--run", str(run_dir), "--device", device, "--json", str(out)]) == 0
        results[device] = json.loads(out.read_text())
    capsys.readouterr()
    assert results["auto"] == results["cpu"] and results["cpu"]["device"]["device"] == "cpu"
    assert results["cpu"]["cpu"] == cpu_description("auto")  # the machine, as diagnose records it


def test_bad_runs_are_one_line(run_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    assert main(["train", "--model", "tiny-random", "--steps", "1", "--group-size", "2", "--max-tokens", "4",
                 "--out", str(plain)]) == 0
    capsys.readouterr()
    assert "holds no weight snapshots: train it with --keep-snapshots N" in bad_cli(["trace", "--run", str(plain)],
                                                                                     capsys)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign"
    (foreign / "snapshots").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        (foreign / name).write_bytes((run_dir / name).read_bytes())
    (foreign / "snapshots" / "step-000000.tokens.json").write_bytes(
        (run_dir / "snapshots" / "step-000000.tokens.json").read_bytes())
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(foreign / "snapshots" / "step-000000.safetensors"))
    assert "holds weights of another model than tiny-random:30" in bad_cli(["trace", "--run", str(foreign)], capsys,
                                                                          after_progress=True)
    # a truncated snapshot is skipped with a warning naming it; the others are measured
    cut = tmp_path / "cut"
    import shutil

    shutil.copytree(run_dir, cut)
    (cut / "snapshots" / "step-000002.safetensors").write_bytes(b"\x00" * 10)
    assert main(["trace", "--run", str(cut), "--json", str(tmp_path / "c.json")]) == 0
    assert "step-000002.safetensors: cannot be read" in capsys.readouterr().err
    assert [r["step"] for r in json.loads((tmp_path / "c.json").read_text())["snapshots"]] == [0, 4]


def test_both_sides_of_beta_precision_go_through_one_head_formula(monkeypatch):
    """measure_tokens' β_precision = trainer − shadow: with a scorer whose two head formulas differ by 2^-10 (entropy
    on: log-softmax then gather; off: gather − logsumexp), a bf16 trainer against a bf16 engine reads 0 on every
    token (the same recipe, the same layout of the same weights); the shadow scored without the entropy read 2^-10."""
    from phantomclip.models.load import load_model
    from phantomclip.precision import scoring
    from phantomclip.trace.growth import measure_tokens

    honest = scoring.logprobs_from_logits

    def altered(logits, targets, with_entropy=True):
        logp, entropy = honest(logits, targets, with_entropy)
        return (logp if with_entropy else logp + 2.0**-10), entropy

    monkeypatch.setattr(scoring, "logprobs_from_logits", altered)
    tokens = {"prompt_ids": [[1, 5, 7], [2, 9]], "completion_ids": [[3, 4, 8, 6], [11, 12]]}
    config = {"plan": {"engine_recipe": "bf16", "trainer_recipe": "bf16"}, "temperature": 1.0}
    out = measure_tokens(load_model("tiny-random:0").model, tokens, config, matmul="emulated")
    assert torch.equal(out["beta_precision"], torch.zeros(6, dtype=torch.float64))  # the 6 completion tokens
