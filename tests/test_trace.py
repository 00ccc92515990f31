import math

import pytest
import torch
from torch import nn

from conftest import assert_close_eps, bad_cli, eps, logit_bound, report
from phantomclip.precision.recipes import cpu_description
from phantomclip.trace.job import (
    TraceConfig,
    TraceError,
    first_order_logprob_change,
    run_trace,
    trace_sites,
)

TINY = dict(model="tiny-random:0", n=4, max_tokens=8)


def test_sites_cover_every_decoder_layer(tiny):
    names = [n for n, _, _ in trace_sites(tiny.model)]
    layers = tiny.model.config.num_hidden_layers  # 2
    assert sum(n.endswith(".residual") for n in names) == layers
    assert sum(n.endswith(".self_attn") for n in names) == layers and sum(n.endswith(".mlp") for n in names) == layers
    assert names[0] == "embed" and names[-2:] == ["final_norm", "logits"]
    assert len(names) == 1 + 5 * layers + 2  # embed; 2 norms, attention, MLP, residual per layer; final norm, logits


def test_fp32_against_fp32_is_exactly_zero_everywhere():
    r = run_trace(TraceConfig(**TINY, recipe="fp32", against="fp32", what_if=False))
    assert r["tokens"] > 0
    nonzero = [s for s in r["sites"] if s["rel_error"] or s["max_abs_error"]]
    assert not nonzero, nonzero
    assert r["beta"]["beta_abs_mean"] == 0
    assert all(s["ref_rms"] > 0 for s in r["sites"])


def test_first_order_identity_in_float64():
    g = torch.Generator().manual_seed(0)
    z_ref = torch.randn(50, 300, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 300, (50,), generator=g)
    dz = 1e-4 * torch.randn(50, 300, generator=g, dtype=torch.float64)
    fo = first_order_logprob_change(z_ref + dz, z_ref, targets)
    # Not a rounding bound but Taylor's: logsumexp(z_ref + dz) = logsumexp(z_ref) + Σ p dz + Var_p(dz) / 2 + R3,
    # |R3| <= (2 max|dz|)^3 / 6, so exact - first order = -Var_p(dz) / 2 up to 2 max|dz|^3 (~1e-11 here, against
    # Var / 2 ~ 1e-8), plus float64 rounding of the two log-softmaxes: 2 eps_fp64 * max|z| * sqrt(V).
    p = torch.softmax(z_ref, -1)
    var = (p * dz**2).sum(-1) - (p * dz).sum(-1) ** 2  # [50]
    m = dz.abs().amax(-1)  # [50]
    rounding = 2 * eps(torch.float64) * z_ref.abs().amax(-1) * 300**0.5
    rem = fo["exact"] - fo["first_order"]
    assert ((rem + var / 2).abs() <= 2 * m**3 + rounding).all(), report("remainder vs -Var/2", rem, -var / 2)
    assert rem.abs().max() > 1e3 * rounding.max()  # the second-order term is resolved, far above rounding
    assert fo["exact"].abs().max() > 1e-5  # the check is not vacuous
    # A common shift changes no probability: both are float64 rounding alone (2 eps_fp64 * max|z| * sqrt(V))
    shift = first_order_logprob_change(z_ref + 0.5, z_ref, targets)
    scale = z_ref.abs().amax(-1)
    assert_close_eps(shift["exact"], 0.0, torch.float64, scale, terms=300, name="exact change under a shift")
    assert_close_eps(shift["first_order"], 0.0, torch.float64, scale, terms=300, name="first order under a shift")


def test_bf16_trace_finds_the_gap_and_the_weights_compute_split_adds_up():
    r = run_trace(TraceConfig(**TINY, recipe="bf16", what_if=False))
    assert r["cpu"] == cpu_description(TraceConfig().matmul)  # the machine recorded as diagnose records it
    rel = {s["site"]: s["rel_error"] for s in r["sites"]}
    # bf16 rounding of the embedding rows: to nearest, so each value moves by at most half an ulp, <= eps_bf16 / 2
    # relative, and so does the RMS (uniform rounding errors give about 2^-9)
    assert 0 < rel["embed"] <= eps(torch.bfloat16) / 2
    assert rel["logits"] > rel["embed"]  # the error grows along depth
    assert r["beta"]["beta_abs_mean"] > 0.01
    assert r["first_order"]["explained_share"] > 0.8  # the first-order term carries most of β
    sp = r["split"]
    # Weights-only and compute-only are independent rounding errors: their RMS add in quadrature to the whole's
    # within 20% (measured 0.89 on this batch); they do not add token by token.
    assert 0.8 < sp["quadrature_ratio"] < 1.2, sp
    assert sp["weights_only"]["beta_abs_mean"] > 0 and sp["compute_only"]["beta_abs_mean"] > 0


def test_what_if_keeping_everything_in_fp32_removes_beta(tiny):
    r = run_trace(TraceConfig(**TINY, recipe="bf16", sub_batch=4))
    rows = {",".join(w["keep_fp32"]): w for w in r["what_if"]}
    assert rows["all"]["beta_abs_mean"] == 0 and rows["all"]["outside_trust_region"] == 0
    # The same β by two paths: float64 log-softmax of the traced logits vs scoring's fp32 logsumexp. Per token the
    # two fp32 log-softmaxes in β round by eps_fp32 * (max|z| + sqrt(V)) each; the mean over N tokens of such
    # independent errors: 2 eps_fp32 * (max|z| + sqrt(V)) / sqrt(N), max|z| bounded from the weights.
    n = r["tokens"]
    scale = (logit_bound(tiny.model) + tiny.model.config.vocab_size**0.5) / n
    assert_close_eps(rows["(none)"]["beta_abs_mean"], r["beta"]["beta_abs_mean"], torch.float32, scale, terms=n,
                     name="mean |β| by two paths")
    # tied head: a new fp32 copy, 320 x 64 = 20,480 values x 4 bytes
    assert rows["lm_head"]["extra_mib"] == pytest.approx(320 * 64 * 4 / 2**20)
    assert math.isnan(rows["attention-softmax"]["gain_per_mib"])  # no parameters: gain per MiB undefined


def test_bad_trace_input(capsys):
    with pytest.raises(TraceError, match="valid names: lm_head, norm, final-norm, attention-softmax, all"):
        TraceConfig(keep_fp32="lm_head,bogus").validate()
    assert "unknown module bogus" in bad_cli(["trace", "--keep-fp32", "bogus"], capsys)
    assert "unknown recipe 'int8'" in bad_cli(["trace", "--recipe", "int8"], capsys)

    class Body(nn.Module):
        pass

    class Odd(nn.Module):
        base_model_prefix = "body"

        def __init__(self):
            super().__init__()
            self.body = Body()

    with pytest.raises(TraceError, match="cannot find the decoder layers of Odd.*module tree root is Odd"):
        trace_sites(Odd())


def test_fp8_trace_ranks_the_parts_of_the_quantisation():
    """trace --recipe bf16+fp8-w8a8+fp8-kv --against bf16: β is the quantisers' alone; keeping each part (weights,
    activations, KV cache, each Linear kind, each layer) in bf16 is a row, ranked by the gain in mean |β|; the first
    row is the whole recipe, whose mean |β| is the depth trace's (there from float64 log-softmax of the full logits,
    here from the fp32 scorer: equal to fp32 rounding of mean |β| ~ 1, a few 1e-7)."""
    r = run_trace(TraceConfig(**TINY, recipe="bf16+fp8-w8a8+fp8-kv", against="bf16"))
    rows = {row["keep"]: row for row in r["quant_what_if"]}
    whole = rows["(nothing: the whole FP8 recipe)"]
    assert whole["beta_abs_mean"] == pytest.approx(r["beta"]["beta_abs_mean"], rel=1e-5) and whole["gain"] == 0
    assert r["beta"]["beta_abs_mean"] > 0
    assert {"KV cache", "activations (FP8 weights only)", "weights (per-token FP8 activations only)", "every q_proj",
            "every down_proj", "layer 0", "layer 1"} <= set(rows)
    # the noise first: the whole recipe in three fp32 summation orders (the kernel's: the depth trace's mean |β|)
    noise = r["quant_order_noise"]
    means = [o["beta_abs_mean"] for o in noise["orders"].values()]
    assert list(noise["orders"]) == ["kernel", "linear", "halves"]
    assert noise["orders"]["kernel"]["beta_abs_mean"] == whole["beta_abs_mean"]
    assert noise["noise"] == max(means) - min(means) and -1 <= noise["token_correlation"] <= 1
    # the floor: the orders' spread or the largest loss of a row (keeping a part in bf16 should not move away from
    # bf16: a row that does shows what noise alone does), whichever is larger
    ranked = r["quant_what_if"][1:]
    assert noise["floor"] == max(noise["noise"], max([-row["gain"] for row in ranked if row["gain"] < 0], default=0))
    # rows that beat the floor first, by gain; then the rows within it, by gain
    assert all(row["within_noise"] == (abs(row["gain"]) <= noise["floor"]) for row in ranked)
    flags = [row["within_noise"] for row in ranked]
    assert flags == sorted(flags)
    for part in (False, True):
        gains = [row["gain"] for row in ranked if row["within_noise"] is part]
        assert gains == sorted(gains, reverse=True)
    assert r["recipe"] == "bf16+fp8-w8a8+fp8-kv" and r["against"] == "bf16"


def test_the_what_if_ranks_past_its_noise_floor():
    """rank_what_if by hand: orders' spread 0.0085; the rows' gains +0.061, +0.025, +0.010, -0.020: the largest loss
    (0.020) is the floor, so +0.061 and +0.025 are ranked first, +0.010 and -0.020 are within the noise."""
    from phantomclip.trace.job import rank_what_if

    rows = [{"keep": "whole", "gain": 0.0}, *({"keep": k, "gain": g} for k, g in
                                               (("a", 0.010), ("b", 0.061), ("c", -0.020), ("d", 0.025)))]
    out = rank_what_if(rows, {"noise": 0.0085})
    assert [r["keep"] for r in out["quant_what_if"]] == ["whole", "b", "d", "a", "c"]
    assert [r["within_noise"] for r in out["quant_what_if"][1:]] == [False, False, True, True]
    assert out["quant_order_noise"]["floor"] == 0.020 and out["quant_order_noise"]["floor_from"] != "orders"
    calm = rank_what_if([{"keep": "whole", "gain": 0.0}, {"keep": "x", "gain": 0.005}], {"noise": 0.0085})
    assert calm["quant_order_noise"]["floor"] == 0.0085 and calm["quant_what_if"][1]["within_noise"]


def test_the_sum_orders_are_one_set_of_products_summed_three_ways():
    """fp8_layers.set_sum_order changes only the order of the fp32 additions: on E4M3 values whose products and sums are
    exact in fp32 (small integers), the three orders give identical outputs; on general values they differ by fp32
    rounding only, at most K · 2^-24 · Σ|terms| per output (a sum's error bound), here K = 64."""
    from phantomclip.models.load import load_model
    from phantomclip.precision import fp8, fp8_layers
    from phantomclip.precision.recipes import apply_recipe, get_recipe

    model = apply_recipe(load_model("tiny-random:0").model, get_recipe("bf16+fp8-w8a8"))
    lin = model.model.layers[0].self_attn.o_proj
    x = torch.randn(5, lin.weight.shape[1]).bfloat16()
    outs = {}
    for order in fp8.SUM_ORDERS:
        fp8_layers.set_sum_order(model, order)
        outs[order] = lin(x).float()
    wq, sw = lin._pc_fp8_w
    xq, sx = fp8_layers.token_quant(x)
    bound = lin.weight.shape[1] * 2.0**-24 * ((xq.abs() @ wq.float().abs().T) * sw * sx)  # [5, N]
    spacing = torch.finfo(torch.bfloat16).eps * outs["kernel"].abs()  # the bf16 output's rounding on top
    for order in ("linear", "halves"):
        assert ((outs[order] - outs["kernel"]).abs() <= bound + spacing).all(), order
