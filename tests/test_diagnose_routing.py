"""diagnose on a mixture-of-experts model: the route table (`routing`), its exact split, the --fail-if gates on it,
the printed lines, and dense / unsupported models."""

import json
import math

import pytest
import torch

from phantomclip.cli import main as cli
from phantomclip.diagnose.config import DiagnoseConfig
from phantomclip.diagnose.gates import EXIT_GATE
from phantomclip.diagnose.job import run_diagnose
from phantomclip.routing import routes as routing
from phantomclip.routing.figures import route_split
from phantomclip.routing.text import routing_lines


@pytest.fixture(scope="module")
def moe_result():
    return run_diagnose(DiagnoseConfig(model="tiny-moe:0", n=4, max_tokens=8, batch_size=2, trainer=["fp32", "bf16"],
                                       batch_invariance=False))


def test_route_table_keys_and_the_split_agree_with_the_recipes_beta(moe_result):
    r = moe_result["routing"]
    assert set(r) == {"engine", "fp32", "bf16"}  # bf16 is the shadow and a trainer recipe: scored once
    e = r["engine"]
    assert (e["layers"], e["experts"], e["k"], e["source"]) == (2, 8, 2, "local engine decode")
    # 4 sequences in 2 batches; ids are uint8: k · layers bytes per routed grid position
    assert e["route_bytes"] % (2 * 2) == 0 and e["positions"] > 0
    fp32 = r["fp32"]
    assert len(fp32["layers"]) == 2 and 0 <= fp32["flip_rate"] <= fp32["any_flip_share"] <= 1
    # β in the route table is the recipe's β on the same tokens: the same mean |β| up to the float64 vs float32
    # reduction (a few ulp of the mean), the same count of tokens
    assert fp32["tokens"] == moe_result["recipes"]["fp32"]["tokens"]
    assert math.isclose(fp32["beta"]["abs_mean"], moe_result["recipes"]["fp32"]["beta_abs_mean"], rel_tol=1e-6)
    assert "beta_route" in fp32 and "beta_route" not in r["bf16"]  # the split for the first trainer recipe only


def test_replayed_forward_makes_the_split_exact_per_token():
    """route_phase's parts, per token: β_route + β_rest == β bit for bit, from the measured tensors."""
    from phantomclip.diagnose import job as diagnose

    cfg = DiagnoseConfig(model="tiny-moe:1", n=2, max_tokens=8, trainer=["fp32"], batch_invariance=False)
    prep, sampled, scored, ref = diagnose.measure(cfg)
    assert sampled.routes is not None and scored["fp32"].routes is not None
    from phantomclip.precision.recipes import apply_recipe, get_recipe

    model = apply_recipe(prep.lm.model, get_recipe("fp32"), matmul=prep.matmul)
    replayed = routing.replayed_logprobs(model, get_recipe("fp32"), sampled.packed, sampled.routes, 1.0)[0]
    split = route_split(scored["fp32"].logp, replayed, ref.logp_engine)
    m = sampled.mask
    assert torch.equal((split["beta_route"] + split["beta_rest"])[m], split["beta"][m])
    # the replaying forward routes exactly as the engine did at every position it routed
    with routing.replay(model, sampled.routes[0], routing.full_layout(m.shape[1])), routing.capture(model) as rec:
        p = sampled.packed[0]
        from phantomclip.precision.scoring import score

        score(model, get_recipe("fp32"), p["input_ids"], p["attention_mask"], p["completion_mask"])
    got = rec.routes(routing.full_layout(m.shape[1]), *p["input_ids"].shape)
    eng = sampled.routes[0]
    assert torch.equal(got.ids[:, eng.valid], eng.ids[:, eng.valid])


def test_route_lines_name_each_recipe_and_the_replay_flags(moe_result):
    lines = routing_lines(moe_result)
    text = "\n".join(lines)
    assert lines[0].startswith("expert routing (2 MoE layers, top-2 of 8 experts")
    assert "  fp32: " in text and "  bf16: " in text and "fp32 β = β_route + β_rest" in text
    for flags in routing.REPLAY_FLAGS.values():
        assert flags in text


def test_fail_if_reads_route_figures_and_refuses_them_on_a_dense_model(tmp_path, capsys):
    out = tmp_path / "moe.json"
    code = cli.main(["diagnose", "--model", "tiny-moe:0", "--n", "2", "--max-tokens", "8", "--trainer", "fp32",
                     "--no-batch-invariance", "--json", str(out), "--fail-if", "routing.fp32.flip_rate>1",
                     "--fail-if", "routing.fp32.beta_route.outside_trust_region>=0"])
    err = capsys.readouterr().err
    assert code == EXIT_GATE and "gate failed: routing.fp32.beta_route.outside_trust_region" in err
    assert "flip_rate" not in err.split("gate failed")[-1]  # a flip rate above 1 cannot be
    assert "routing" in json.loads(out.read_text())
    code = cli.main(["diagnose", "--model", "tiny-random:0", "--n", "2", "--max-tokens", "8", "--trainer", "fp32",
                     "--no-batch-invariance", "--fail-if", "routing.fp32.flip_rate>0.1"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and "Traceback" not in err and len(errors) == 1 and "routing.fp32.flip_rate" in errors[0]


def test_no_routing_skips_the_table_and_unsupported_families_are_one_line(monkeypatch):
    cfg = DiagnoseConfig(model="tiny-moe:0", n=2, max_tokens=6, trainer=["fp32"], routing=False,
                         batch_invariance=False)
    assert "routing" not in run_diagnose(cfg)
    monkeypatch.delitem(routing.ADAPTERS, "Qwen3MoeTopKRouter")
    with pytest.raises(routing.RoutingError, match="the routes of Qwen3MoeSparseMoeBlock cannot be captured"):
        run_diagnose(DiagnoseConfig(model="tiny-moe:0", n=2, max_tokens=6, trainer=["fp32"]))


def test_the_route_split_of_identical_routes_is_zero_with_a_scorer_whose_two_formulas_differ(monkeypatch):
    """diagnose's route phase replaying the trainer's own routes: β_route is 0 on every token and no token is
    'touched'. The scorer is altered so that its two head formulas (log-softmax then gather with the entropy,
    gather − logsumexp without) differ by 2^-10 instead of rounding: a route phase whose two forwards went through
    different formulas reads 2^-10 on every token (route_touched_share 1); before the fix the rounding alone made it
    read 76.6% on the docs' example."""
    from dataclasses import replace

    from phantomclip.diagnose import job as diagnose
    from phantomclip.precision import scoring

    honest = scoring.logprobs_from_logits

    def altered(logits, targets, with_entropy=True):
        logp, entropy = honest(logits, targets, with_entropy)
        return (logp if with_entropy else logp + 2.0**-10), entropy

    monkeypatch.setattr(scoring, "logprobs_from_logits", altered)
    cfg = DiagnoseConfig(model="tiny-moe:1", n=4, max_tokens=8, batch_size=2, trainer=["fp32"],
                         batch_invariance=False)
    prep, sampled, scored, ref = diagnose.measure(cfg)
    own = scored["fp32"].routes
    # the trainer's routes as the engine's, valid where the engine routed (the last column never is: nothing was
    # decoded after it)
    as_engine = [replace(o, valid=e.valid) for o, e in zip(own, sampled.routes)]
    table, _ = diagnose.route_phase(cfg, prep, replace(sampled, routes=as_engine), scored, ref)  # (figures, β_rest)
    assert table["fp32"]["tokens"] > 0
    assert table["fp32"]["route_touched_share"] == 0.0
    assert table["fp32"]["beta_route"]["abs_mean"] == 0.0
