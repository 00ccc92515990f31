"""routing/routes.py: route capture and replay on MoE routers, the flip rate, and the exact split of β into β_route and
the rest."""

import pytest
import torch
from torch import nn

from phantomclip.engines.local import LocalEngine, SamplingParams
from phantomclip.models.load import load_model
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.precision.scoring import TrainerForward, score
from phantomclip.routing import routes as routing
from phantomclip.routing.figures import flips, route_split, route_stats


@pytest.fixture(scope="module")
def moe():
    return load_model("tiny-moe:0")


def _batch(B=4, T=24, seed=0):
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))  # [B, T] byte tokens
    return ids, torch.ones_like(ids)


def _routes_of(model, recipe, ids, att):
    """(scores, routes) of one full forward (routing.full_layout)."""
    with routing.capture(model) as rec:
        sc = score(model, get_recipe(recipe), ids, att)
    return sc, rec.routes(routing.full_layout(ids.shape[1]), *ids.shape)


# ------------------------------------------------------------------------------- the adapters, family by family


def _router(family: str):
    """A router of each family at 4 experts, top-2, hidden 16, with N(0, 1) weights (and bias)."""
    from transformers import GptOssConfig, GraniteMoeConfig, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    kinds = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter, "num_experts"),
             "olmoe": (OlmoeConfig, OlmoeTopKRouter, "num_experts"),
             "mixtral": (MixtralConfig, MixtralTopKRouter, "num_local_experts"),
             "granitemoe": (GraniteMoeConfig, GraniteMoeTopKRouter, "num_local_experts"),
             "gpt_oss": (GptOssConfig, GptOssTopKRouter, "num_local_experts")}
    config_cls, router_cls, key = kinds[family]
    router = router_cls(config_cls(hidden_size=16, num_experts_per_tok=2, **{key: 4}))
    with torch.no_grad():
        for p in router.parameters():
            p.normal_(generator=torch.Generator().manual_seed(3))
    return router


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mixtral", "granitemoe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_family_replays_its_own_routes_bit_for_bit(family, dtype):
    """The adapter's weights at the router's own ids are the router's own weights, bit for bit, in fp32 and bf16;
    replaying other ids gives those ids and the family's weights for them."""
    router = _router(family).to(dtype)
    assert routing.ADAPTERS[type(router).__name__].family == family
    h = torch.randn(32, 16, generator=torch.Generator().manual_seed(4)).to(dtype)  # [N, H]
    logits, weights, ids = router(h)
    adapter = routing.ADAPTERS[type(router).__name__]
    assert torch.equal(adapter.weights(router, logits, ids, h), weights)
    other = (ids + 1) % 4  # [N, 2]: another pair of distinct experts
    w = adapter.weights(router, logits, other, h)
    assert w.dtype == weights.dtype and w.shape == other.shape
    if getattr(router, "norm_topk_prob", True):  # Qwen3-MoE and OLMoE renormalise only when the config says so
        # normalised over the k: the sum is 1 to the weights' own rounding (2 terms, 2 eps of the dtype)
        assert torch.allclose(w.float().sum(-1), torch.ones(32), atol=2 * torch.finfo(dtype).eps)


# ------------------------------------------------------------------------------- a crafted layer, worked by hand


def _crafted_router(delta: float):
    """Qwen3-MoE router, 4 experts, top-2, hidden 2: logits (3·h0, h1, (1 + delta)·h1, −3·h0)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=2, num_experts=4, num_experts_per_tok=2))
    with torch.no_grad():
        router.weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 1.0 + delta], [-3.0, 0.0]]))
    return router


def test_flip_rate_and_margin_on_a_crafted_layer_worked_by_hand():
    """Experts 1 and 2 forced to a near tie (logits h1 and (1 ± 1/64)·h1), so the sign of the perturbation decides:
      token (1, 1):   logits (3, 1, 1 ± δ, −3)  top-2 {0, 2} at +δ, {0, 1} at −δ        flip, margin δ
      token (1, −1):  logits (3, −1, −1 ∓ δ, −3) top-2 {0, 1} at +δ, {0, 2} at −δ      flip, margin δ
      token (1, 5):   logits (3, 5, 5 ± 5δ, −3)  {1, 2} either way         no flip, margin 5 − 3 = 2 at +δ
      token (−1, −1): logits (−3, −1, −1 ∓ δ, 3) {3, 1} at +δ, {3, 2} at −δ            flip, margin δ
    flip rate 3/4; with δ = 1/64 every logit and margin is exact in fp32."""
    delta = 1 / 64
    h = torch.tensor([[1.0, 1.0], [1.0, -1.0], [1.0, 5.0], [-1.0, -1.0]])  # [4 tokens, 2]
    got = []
    for d in (delta, -delta):
        router = _crafted_router(d)
        with routing.capture(router) as rec:
            router(h)
        got.append(rec.routes(routing.full_layout(4), 1, 4))  # the 4 tokens as one row
    plus, minus = got
    assert plus.ids.dtype == torch.uint8
    assert plus.ids[0, 0].sort(-1).values.tolist() == [[0, 2], [0, 1], [1, 2], [1, 3]]
    assert flips(plus, minus)[0, 0].tolist() == [True, True, False, True]
    assert plus.margin[0, 0].tolist() == [delta, delta, 2.0, delta]
    stats = route_stats(plus, minus, torch.ones(1, 4, dtype=torch.bool))
    assert stats["positions"] == 4 and stats["flip_rate"] == 0.75 and stats["any_flip_share"] == 0.75
    assert stats["layers"][0]["margin_flipped_median"] == delta


def test_a_router_forced_to_ties_flips_between_fp32_and_bf16():
    """Experts 1 and 2 one fp32 spacing apart at 1 + 2^-12: bf16 rounds both rows to 1 (8 significant bits), so its
    router sees an exact tie (margin 0) where fp32 sees 2^-12 · |h1| and picks expert 2 for h1 > 0: the two forwards
    choose different pairs wherever bf16's tie-break takes expert 1."""
    router = _crafted_router(2.0**-12)
    h = torch.tensor([[1.0, 1.0], [1.0, 0.5], [1.0, 0.25], [1.0, 2.0]])  # [4, 2]: h1 > 0, exact in bf16
    with routing.capture(router) as rec32:
        router(h)
    router16 = router.to(torch.bfloat16)
    with routing.capture(router16) as rec16:
        router16(h.bfloat16())
    a, b = (r.routes(routing.full_layout(4), 1, 4) for r in (rec32, rec16))
    assert torch.equal(b.margin[0, 0], torch.zeros(4))  # an exact tie in bf16
    assert a.margin[0, 0].tolist() == [2.0**-12 * x for x in (1.0, 0.5, 0.25, 2.0)]
    assert a.ids[0, 0].sort(-1).values.tolist() == [[0, 2]] * 4
    # torch.topk takes the lower index of a tie on this CPU; whichever it takes, the sets differ from fp32's where
    # it took expert 1
    took_one = (b.ids[0, 0] == 1).any(-1)  # [4]
    assert torch.equal(flips(a, b)[0, 0], took_one) and bool(took_one.any())


# ------------------------------------------------------------------------------- whole models


def test_identical_routes_give_beta_route_zero_exactly(moe):
    ids, att = _batch()
    sc, own = _routes_of(moe.model, "fp32", ids, att)
    with routing.replay(moe.model, own, routing.full_layout(ids.shape[1])):
        again = score(moe.model, get_recipe("fp32"), ids, att)
    split = route_split(sc.logp, again.logp, sc.logp)
    assert torch.equal(split["beta_route"], torch.zeros_like(split["beta_route"]))


def test_replay_reproduces_the_engines_decode_routes_bit_for_bit(moe):
    """The bf16 engine's routes, captured in its decode loop (prefill then a token a step), replayed into the fp32
    trainer's one-pass forward and into its grouped forward (a prompt once per group): the replaying forwards route
    exactly as the engine did at every position the engine routed, and the β split adds up exactly."""
    tok = moe.tokenizer
    prompts = [tok.encode("ab"), tok.encode("hello")] * 2  # groups of 2 equal prompts after sorting below
    prompts = [prompts[0], prompts[0], prompts[1], prompts[1]]
    engine = LocalEngine(moe.model, torch.bfloat16)
    params = SamplingParams(max_tokens=12, seed=3)
    rollout, eng = routing.generate_with_routes(engine, prompts, params)
    packed = rollout.pack(tok.pad_token_id)
    B, T = packed["input_ids"].shape
    P = rollout.prompt_width
    assert eng.valid.shape == (B, T) and bool(eng.valid[:, : T - 1].all()) and not bool(eng.valid[:, T - 1].any())
    # one-pass scoring (diagnose)
    fp32 = get_recipe("fp32")
    with routing.capture(moe.model) as rec:
        own = score(moe.model, fp32, packed["input_ids"], packed["attention_mask"], packed["completion_mask"])
    own_routes = rec.routes(routing.full_layout(T), B, T)
    with routing.replay(moe.model, eng, routing.full_layout(T)), routing.capture(moe.model) as rec:
        rep = score(moe.model, fp32, packed["input_ids"], packed["attention_mask"], packed["completion_mask"])
    got = rec.routes(routing.full_layout(T), B, T)
    assert torch.equal(got.ids[:, eng.valid], eng.ids[:, eng.valid])
    split = route_split(own.logp, rep.logp, packed["logp_engine"])
    assert torch.equal(split["beta_route"] + split["beta_rest"], split["beta"])  # exact in float64
    # β_route is non-zero exactly where a flip feeds a scored token: at a real position (a left-padding position is
    # masked out of attention, so its route, which bf16 and fp32 may choose differently on their garbage, reaches no
    # token; on an AMX CPU they do differ there)
    reach = packed["attention_mask"].bool() & eng.valid  # [B, T]
    flipped = flips(own_routes, eng)[:, reach].any()
    assert bool((split["beta_route"] != 0).any()) == bool(flipped)
    # the trainer's grouped forward (train): the prompt once per group of 2
    with routing.replay(moe.model, eng, routing.grouped_layout(P, T, 2)), routing.capture(moe.model) as rec:
        TrainerForward(moe.model, fp32, "auto").logprobs(packed, P, 2, grad=False)
    got = rec.routes(routing.grouped_layout(P, T, 2), B, T)
    assert torch.equal(got.ids[:, eng.valid], eng.ids[:, eng.valid])


def test_engine_routes_under_bf16_flip_some_fp32_decisions(moe):
    """The mechanism on random weights: bf16 against fp32 routes, one-pass forwards on 4 x 24 random bytes. Some
    decisions flip (the tiny MoE's routers were scaled so that they do, models.TINY_MOE_ROUTER_STD), not most."""
    ids, att = _batch()
    bf16 = apply_recipe(moe.model, get_recipe("bf16"), matmul="auto")
    _, a = _routes_of(moe.model, "fp32", ids, att)
    _, b = _routes_of(bf16, "bf16", ids, att)
    stats = route_stats(a, b, att.bool())
    assert 0 < stats["flip_rate"] < 0.2 and stats["positions"] == 96
    assert stats["layers"][0]["margin_p50"] > stats["layers"][0]["margin_flipped_median"]  # flips sit at small margins


def test_dense_and_unsupported_models_are_one_line(tiny):
    with pytest.raises(routing.RoutingError, match="needs a mixture-of-experts model; LlamaForCausalLM is dense"):
        routing.require_moe(tiny.model, "route capture")

    class ToyMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.experts = nn.Linear(4, 2), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"num_local_experts": 2})()
            self.block = ToyMoeBlock()

    with pytest.raises(routing.RoutingError, match="the routes of ToyMoeBlock cannot be captured"):
        routing.routers(Toy())


def test_route_memory_is_k_small_ints_per_token_and_layer():
    """A 30B-A3B-sized route set (48 layers, k = 8 of 128 experts) at 8K tokens: 48 · 8192 · 8 bytes of uint8 ids
    = 3,145,728 bytes (3.0 MiB); with fp32 weights 4 bytes more per id (15.0 MiB in all)."""
    assert routing.id_dtype(128) == torch.uint8 and routing.id_dtype(257) == torch.int16
    r = routing.Routes(ids=torch.zeros(48, 1, 8192, 8, dtype=routing.id_dtype(128)),
                       weights=torch.zeros(48, 1, 8192, 8), margin=torch.zeros(48, 1, 8192),
                       valid=torch.ones(1, 8192, dtype=torch.bool))
    assert r.nbytes(with_weights=False) == 3_145_728 and r.nbytes() == 5 * 3_145_728
