"""train on a mixture-of-experts model: the routing part of β logged every step, and `--intervention r3` (rollout
routing replay) in the trainer's forwards; refused in one line on a dense model."""

import pytest

from phantomclip.cli import main as cli
from phantomclip.training.config import TrainConfig
from phantomclip.training.trainer import train

MOE = dict(model="tiny-moe:0", max_tokens=6, prompts_per_step=2, group_size=2, lr=3e-3)
ROUTE_KEYS = {"route/flip_rate", "route/any_flip_share", "route/beta_route_abs_mean",
              "route/beta_route_outside_trust_region", "route/log_ratio_rest_abs_mean", "route/touched_share",
              "time/route_s"}


@pytest.mark.parametrize("intervention", ["none", "r3"])
def test_every_moe_step_logs_the_route_split_and_r3_leaves_only_beta_rest(intervention):
    """At the first step (θ_old = θ_t, α = 0) under r3 the loss forward chooses the engine's experts, so its β is
    exactly the rest after β_route (the step's own forward and the route figures' replayed forward are the same
    computation at the same weights): the logged means agree to float64 rounding of a mean of ~20 values (1e-15
    relative). Without replay β keeps β_route as well."""
    rows = train(TrainConfig(**MOE, steps=1, intervention=intervention)).metrics
    r = rows[0]
    assert ROUTE_KEYS <= set(r)
    assert 0 <= r["route/flip_rate"] <= r["route/any_flip_share"] <= 1
    if intervention == "r3":
        assert r["mismatch/beta_abs_mean"] == pytest.approx(r["route/log_ratio_rest_abs_mean"], rel=1e-12)
    elif r["route/beta_route_abs_mean"] > 0:
        assert r["mismatch/beta_abs_mean"] != pytest.approx(r["route/log_ratio_rest_abs_mean"], rel=1e-12)


def test_r3_on_a_dense_model_is_one_line(tmp_path, capsys):
    code = cli.main(["train", "--model", "tiny-random:0", "--steps", "1", "--max-tokens", "4",
                     "--intervention", "r3", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert "--intervention r3 needs a mixture-of-experts model; LlamaForCausalLM is dense" in lines[-1]


def _two_forward_step(step_fn, batch, ctx):
    """The route figures as first built: both forwards (own routes, the engine's replayed) run no-grad before the
    step, the loss forward apart (a third forward of the batch). The reference routed_step must equal."""
    from phantomclip.routing import train as routing_train

    cfg, P = ctx.cfg, batch.rollout.prompt_width
    figures = routing_train.step_route_figures(ctx.policy, batch.packed, batch.routes, P, cfg.group_size,
                                               cfg.temperature, (ctx.plan.eps_low, ctx.plan.eps_high))
    with routing_train.replaying([ctx.policy.layout, ctx.shadow, ctx.plain_shadow], batch.routes, P, cfg.group_size,
                                 ctx.plan.routes == "engine"):
        out = step_fn(batch, ctx)
    out.row.update(figures)
    return out


@pytest.mark.parametrize("intervention", ["none", "r3"])
def test_figures_from_the_loss_forward_equal_two_extra_forwards(tmp_path, monkeypatch, intervention):
    """routed_step takes one of the split's two forwards from the loss's own (its log-probs with grad are those of
    the no-grad forward bit for bit, and so are its routes): every logged figure but the clocks, and every token
    record (tokens, α, β parts), equal the reference's exactly, over 2 steps (the second at weights the first
    changed)."""
    import json

    from phantomclip.training import trainer

    def run(name):
        train(TrainConfig(**MOE, steps=2, intervention=intervention), out=tmp_path / name)
        read = lambda f: [json.loads(line) for line in (tmp_path / name / f).read_text().splitlines()]  # noqa: E731
        rows = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read("metrics.jsonl")]
        return rows, read("tokens.jsonl"), read("samples.jsonl")

    new = run("one-extra")
    monkeypatch.setattr(trainer, "routed_step", _two_forward_step)
    old = run("two-extra")
    assert len(new[0]) == 2 and "route/beta_route_abs_mean" in new[0][0]
    assert new == old  # NaN-free here: json writes NaN as NaN, which != NaN, so a NaN would fail this loudly


@pytest.fixture(scope="module")
def moe_batch():
    """tiny-moe:0, and a packed batch of 2 groups of 2 rows (6 tokens) sampled by the bf16 local engine with its
    routes."""
    import torch

    from phantomclip.engines.local import LocalEngine, SamplingParams
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts, encode_prompts
    from phantomclip.routing import routes as routing

    lm = load_model("tiny-moe:0")
    prompts = [p for p in encode_prompts(lm.tokenizer, bundled_prompts()[:2]) for _ in range(2)]
    rollout, routes = routing.generate_with_routes(LocalEngine(lm.model, torch.bfloat16), prompts,
                                                   SamplingParams(max_tokens=6, seed=0))
    return lm, rollout.pack(lm.tokenizer.pad_token_id), rollout.prompt_width, routes


@pytest.mark.parametrize("recipe", ["fp32", "bf16", "fp16"])
def test_the_loss_forward_gives_the_no_grad_forwards_log_probs_and_routes(moe_batch, recipe):
    """What routed_step relies on, per trainer recipe: the forward with grad (recorded by _loss_forward) and the
    no-grad forward (_forward) of the same batch give the same log-probs and the same expert choices, bit for bit
    (the same kernels on the same shapes; autograd only records). Also under replay of the engine's routes."""
    import torch

    from phantomclip.precision.recipes import get_recipe
    from phantomclip.precision.scoring import TrainerForward
    from phantomclip.routing import train as routing_train

    lm, packed, P, routes = moe_batch
    policy = TrainerForward(lm.model, get_recipe(recipe), "auto")
    for replay in (False, True):
        other = routing_train._forward(policy, packed, routes, P, 2, 1.0, replay=replay)
        with routing_train._loss_forward(policy, packed, P, 2, 1.0, capture=not replay) as loss, \
                routing_train.replaying([policy.layout], routes, P, 2, replay):
            logp = policy.logprobs(packed, P, 2, temperature=1.0)  # [B, L], with grad, as the loss
        assert logp.requires_grad and "logprobs" not in vars(policy)  # the wrapper is gone after the block
        assert torch.equal(loss.logp, other.logp), (recipe, replay)
        if not replay:  # both recorded 2 router calls (prompts, completions) in each of the 2 layers
            calls = [(a.ids, b.ids) for la, lb in zip(loss.routes.calls, other.routes.calls) for a, b in zip(la, lb)]
            assert len(calls) == 4 and all(torch.equal(a, b) for a, b in calls), recipe
