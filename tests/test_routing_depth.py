"""routing/depth.py: where expert-routing flips start along the depth (trace on an MoE model)."""

import math

import torch

from phantomclip.models.load import load_model
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.routing.depth import route_depth, trace_routing


def _packed(T=32, B=4):
    ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(2))  # [B, T] byte tokens
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_a_recipe_against_itself_flips_nothing():
    lm = load_model("tiny-moe:0")
    fp32 = get_recipe("fp32")
    r = route_depth(apply_recipe(lm.model, fp32), fp32, apply_recipe(lm.model, fp32), fp32, _packed())
    assert r["positions"] == 128 and r["flip_rate"] == 0 and r["any_flip_share"] == 0
    for row in r["layers"]:
        assert row["flip_rate"] == row["first_flip_share"] == row["local_flip_rate"] == 0
        assert math.isnan(row["flips_local_share"])  # no flips to share out


def test_bf16_flips_start_somewhere_and_split_into_local_and_carried_in():
    """Every position with a flip has exactly one first flipped layer, so the first-flip shares add up to the
    any-flip share (two means over the same 128 positions: equal to float64 rounding of a sum of 2 terms)."""
    lm = load_model("tiny-moe:0")
    bf16, fp32 = get_recipe("bf16"), get_recipe("fp32")
    r = route_depth(apply_recipe(lm.model, bf16), bf16, apply_recipe(lm.model, fp32), fp32, _packed())
    assert r["any_flip_share"] > 0
    assert math.isclose(sum(row["first_flip_share"] for row in r["layers"]), r["any_flip_share"], rel_tol=1e-12)
    assert r["layers"][0]["first_flip_share"] == r["layers"][0]["flip_rate"]  # nothing is above layer 0
    for row in r["layers"]:
        assert row["first_flip_share"] <= row["flip_rate"]
        assert math.isnan(row["flips_local_share"]) or 0 <= row["flips_local_share"] <= 1


def test_dense_models_have_no_route_depth(tiny):
    fp32 = get_recipe("fp32")
    assert trace_routing(tiny.model, fp32, tiny.model, fp32, _packed()) == {}
