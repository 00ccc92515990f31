import pytest
import torch
import torch.nn.functional as F

from conftest import MATMULS, assert_close_eps, eps, report
from phantomclip.precision.recipes import (
    DEFAULT_TRAINERS,
    RECIPES,
    RecipeError,
    apply_recipe,
    forward_context,
    get_recipe,
    use_emulated_matmul,
)
from phantomclip.precision.scoring import score


def _param_dtypes(model):
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("matmul", ["native", "emulated"])
def test_recipes_really_run_in_their_dtypes(tiny, matmul):
    master = tiny.model
    assert _param_dtypes(apply_recipe(master, get_recipe("fp32"), matmul)) == {torch.float32}
    assert _param_dtypes(apply_recipe(master, get_recipe("bf16"), matmul)) == {torch.bfloat16}
    assert _param_dtypes(apply_recipe(master, get_recipe("fp16"), matmul)) == {torch.float16}
    assert _param_dtypes(apply_recipe(master, get_recipe("bf16-autocast"), matmul)) == {torch.float32}
    head = apply_recipe(master, get_recipe("fp32-head"), matmul)
    assert head.lm_head.weight.dtype == torch.float32 and head.model.norm.weight.dtype == torch.float32
    assert head.model.embed_tokens.weight.dtype == torch.bfloat16
    assert head.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    # the tied head was given its own copy, holding the exact fp32 master values
    assert head.lm_head.weight is not head.model.embed_tokens.weight
    assert torch.equal(head.lm_head.weight, master.lm_head.weight)
    assert master.lm_head.weight.dtype == torch.float32  # the master is never modified


def test_rope_frequencies_stay_fp32(tiny):
    # from_pretrained(dtype=bf16) and vLLM keep inv_freq in fp32; a bf16 inv_freq adds a position-dependent error.
    for name in ("bf16", "fp16", "fp32-head"):
        model = apply_recipe(tiny.model, get_recipe(name))
        bufs = {n: b for n, b in model.named_buffers() if "inv_freq" in n}
        assert bufs and all(b.dtype == torch.float32 for b in bufs.values()), name
        assert torch.equal(bufs["model.rotary_emb.inv_freq"], tiny.model.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("matmul", MATMULS)
def test_forward_outputs_have_the_recipe_dtype(tiny, matmul):
    ids = torch.tensor([[5, 6, 7, 8]])
    seen = {}
    for name in ("fp32", "bf16", "fp16", "bf16-autocast", "fp32-head"):
        recipe = get_recipe(name)
        model = apply_recipe(tiny.model, recipe, matmul)
        with torch.no_grad(), forward_context(recipe):
            hidden = model.model(input_ids=ids).last_hidden_state
            seen[name] = (hidden.dtype, model.lm_head(hidden).dtype)
    assert seen["fp32"] == (torch.float32, torch.float32)
    assert seen["bf16"] == (torch.bfloat16, torch.bfloat16)
    assert seen["fp16"] == (torch.float16, torch.float16)
    assert seen["bf16-autocast"][1] == torch.bfloat16  # autocast: fp32 weights, bf16 matmul outputs
    assert seen["fp32-head"] == (torch.float32, torch.float32)  # fp32 final norm and head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_linear_matches_native_kernel(dtype):
    # Products of two bf16/fp16 numbers are exact in fp32, so emulation differs from a native kernel (fp32
    # accumulation, one rounding of the output) only by the order of the K fp32 additions: 2 eps_fp32 * sqrt(K)
    # * sum_k |x_k w_k| between the two fp32 sums. Where that straddles a rounding boundary of the low dtype, the
    # outputs differ by one ulp of it, <= eps_low * |y|: on few outputs. Together, per output:
    # |Δy| <= eps_low * |y| + 2 eps_fp32 * sqrt(K) * (|x| @ |W|^T + |b|).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(dtype)
    lin = torch.nn.Linear(256, 512, bias=True).to(dtype)
    native = F.linear(x, lin.weight, lin.bias).float()
    out = use_emulated_matmul(lin)(x)
    assert out.dtype == dtype  # the emulated kernel still hands back the low-precision dtype
    emulated = out.float()
    terms = x.float().abs() @ lin.weight.float().abs().T + lin.bias.float().abs()  # [64, 512]: sum_k |x_k w_k| + |b|
    bound = eps(dtype) * native.abs() + 2 * eps(torch.float32) * 256**0.5 * terms
    assert ((native - emulated).abs() <= bound).all(), report("native vs emulated", native, emulated)
    assert (native != emulated).float().mean().item() < 0.02


def test_emulated_scoring_close_to_native_compared_to_the_gap(tiny, tiny_prompts):
    ids = torch.tensor([tiny_prompts[0]])
    attn = torch.ones_like(ids)
    r32, r16 = get_recipe("fp32"), get_recipe("bf16")
    lp32 = score(apply_recipe(tiny.model, r32), r32, ids, attn).logp
    native = score(apply_recipe(tiny.model, r16, "native"), r16, ids, attn).logp
    emulated = score(apply_recipe(tiny.model, r16, "emulated"), r16, ids, attn).logp
    gap = (native - lp32).abs().mean().item()
    kernel = (native - emulated).abs().mean().item()
    assert gap > 1e-3, report("bf16 vs fp32", native, lp32)
    assert kernel < gap / 3, f"emulation error {kernel:.2e} vs precision gap {gap:.2e}"
    # Per token: the two kernels round the same fp32-accumulated products, so they differ only where an output's
    # two summation orders straddle a bf16 rounding boundary, and that one-ulp flip carries into the logits as a
    # relative change of about eps_bf16: |Δ log p| <= 2 eps_bf16 * max|z| (z_t and logsumexp), as for the
    # shared-prompt scores in test_trainer.py. (Measured: bit-identical on AVX-512-BF16, AVX2 and SSE kernels.)
    with torch.no_grad():
        z = tiny.model(input_ids=ids).logits[0].float()  # [T, V]
    scale = torch.cat([torch.zeros(1), z[:-1].abs().amax(-1)])  # [T]: the distribution scoring token t
    assert_close_eps(native[0], emulated[0], torch.bfloat16, scale, name="native vs emulated bf16 scores")


def test_emulated_weight_cache_follows_in_place_updates():
    lin = use_emulated_matmul(torch.nn.Linear(4, 2, bias=False).to(torch.bfloat16))
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    before = lin(x).clone()
    with torch.no_grad():
        lin.weight.add_(1.0)
    after = lin(x).float()
    # after = before + 4 up to bf16 roundings of half an ulp each (<= eps/2 relative): the 4 updated weights
    # (w + 1 stored in bf16), the output before and the output after. A stale cache would be off by 4.
    w = lin.weight.float()
    bound = eps(torch.bfloat16) / 2 * (w.abs().sum(-1) + after.abs() + before.float().abs())
    expected = before.float() + 4
    assert ((after - expected).abs() <= bound).all(), report("after vs before + 4", after, expected)


def test_unknown_recipe_lists_valid_names():
    with pytest.raises(RecipeError, match="fp32, bf16, fp16, bf16-autocast, fp32-head, bf16-autocast-fp32-head, "
                                          "fp16-autocast"):
        get_recipe("int4")
    assert set(RECIPES) == {"fp32", "bf16", "fp16", "bf16-autocast", "fp32-head", "bf16-autocast-fp32-head",
                            "fp16-autocast"}
    assert DEFAULT_TRAINERS == ("fp32", "bf16", "fp16", "bf16-autocast", "fp32-head")  # diagnose's default five


@pytest.mark.parametrize("matmul", ["native", "emulated"])
def test_bf16_autocast_with_an_fp32_head_is_what_trl_runs(tiny, matmul):
    """TRL's `bf16: true` with `cast_lm_head_to_fp32: true` (trl 1.16 trl/trainer/grpo_trainer.py
    _cast_lm_head_to_fp32, trainer/utils.py add_fused_lm_head): fp32 weights (TRL loads in fp32), the body under bf16
    autocast, then the head's matmul on the hidden state cast to fp32, with autocast off. Worked by hand: the body is
    bf16-autocast's to the bit (same fp32 weights, same autocast), and the logits are F.linear(h.float(), W_head) in
    fp32, bit for bit, where bf16-autocast's head rounds them to bf16."""
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    autocast, recipe = get_recipe("bf16-autocast"), get_recipe("bf16-autocast-fp32-head")
    plain, head32 = apply_recipe(tiny.model, autocast, matmul), apply_recipe(tiny.model, recipe, matmul)
    with torch.no_grad(), forward_context(recipe):
        h_plain, h = plain.model(input_ids=ids).last_hidden_state, head32.model(input_ids=ids).last_hidden_state
        z_plain, z = plain.lm_head(h_plain), head32.lm_head(h)  # [1, T, V] each
    assert torch.equal(h, h_plain)
    with torch.no_grad():
        expected = F.linear(h.float(), tiny.model.lm_head.weight)  # [1, T, V] fp32, no autocast
    assert z.dtype == torch.float32 and z_plain.dtype == torch.bfloat16
    assert torch.equal(z, expected)
    assert not torch.equal(z, z_plain.float())  # the fp32 head is another figure than the bf16 one
    assert _param_dtypes(head32) == {torch.float32}  # TRL's weights stay fp32 under autocast


def test_exact_weights_keep_the_arithmetic_and_drop_the_weight_rounding(tiny):
    # An emulated bf16 Linear rounds x, the weight and the output; with exact_weights the weight is the fp32 master.
    recipe = get_recipe("bf16")
    model = apply_recipe(tiny.model, recipe, "emulated", exact_weights=True)
    master, lin = tiny.model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.up_proj
    x = torch.randn(3, master.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [3, H]
    with torch.no_grad():
        out = lin(x)  # [3, I] bf16
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), master.weight).to(torch.bfloat16))  # unrounded fp32 weight
    rounded = F.linear(x.float(), master.weight.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert not torch.equal(out, rounded)  # the option changes something
    assert lin.weight.dtype == torch.bfloat16  # the stored weights are still the recipe's
    with pytest.raises(RecipeError, match="exact_weights needs matmul='emulated'"):
        apply_recipe(tiny.model, recipe, "native", exact_weights=True)
