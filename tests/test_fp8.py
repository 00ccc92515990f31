"""FP8 quantisers (precision/fp8.py): bit for bit against torch's own float8 casts, hand-worked edge cases, the GEMMs
against float64 references and torch._scaled_mm, and the recipes on a model (which layers, shared scales, engine =
shadow)."""

import pytest
import torch
import torch.nn.functional as F

from phantomclip.engines.local import LocalEngine
from phantomclip.precision import fp8, fp8_layers
from phantomclip.precision.recipes import QuantError, RecipeError, apply_recipe, get_recipe, lm_head, without_quant
from phantomclip.precision.scoring import score

E4M3 = torch.float8_e4m3fn


def all_e4m3_values() -> torch.Tensor:
    """The 256 E4M3 bit patterns as fp32 (NaN patterns included)."""
    return torch.arange(256, dtype=torch.uint8).view(E4M3).float()


# ------------------------------------------------------------------------------------------- the cast


def test_every_e4m3_value_round_trips_bit_for_bit():
    v = all_e4m3_values()
    finite = torch.isfinite(v)
    back = fp8.to_e4m3(v[finite])
    assert torch.equal(back.view(torch.uint8), v[finite].to(E4M3).view(torch.uint8))
    assert torch.equal(back.float(), v[finite])
    assert v[finite].abs().max().item() == fp8.E4M3_MAX == torch.finfo(E4M3).max


def test_cast_equals_torch_cast_inside_the_range():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(100_000, generator=g) * s for s in (1e-3, 1.0, 30.0, 150.0)]).clamp(-448, 448)
    assert torch.equal(fp8.to_e4m3(x).view(torch.uint8), x.to(E4M3).view(torch.uint8))


def test_hand_worked_roundings():
    # E4M3 has 3 stored mantissa bits: spacing 1/8 in [1, 2), 32 in [256, 448]; the smallest subnormal is 2^-9.
    cases = {
        1.0625: 1.0,  # halfway between 1 and 1.125: ties to the even mantissa (000)
        1.1875: 1.25,  # halfway between 1.125 and 1.25: ties to even (010)
        1.07: 1.125,  # nearer 1.125
        2.0**-10: 0.0,  # half the smallest subnormal: ties to even, which is zero
        1.5 * 2.0**-9: 2.0**-8,  # halfway between 1 and 2 subnormal steps: ties to 2 (even)
        3 * 2.0**-9: 3 * 2.0**-9,  # a subnormal is exact
        2.0**-6: 2.0**-6,  # the smallest normal
        440.0: 448.0,  # between 416 and 448: nearer 448
        460.0: 448.0,  # above the largest value: saturates
        1e6: 448.0,
        float("inf"): 448.0,  # __NV_SATFINITE: even infinity saturates
        -500.0: -448.0,
        -0.0: -0.0,
    }
    x = torch.tensor(list(cases))
    got = fp8.to_e4m3(x).float()
    assert got.tolist() == list(cases.values())
    assert torch.isnan(fp8.to_e4m3(torch.tensor([float("nan")])).float()).all()


# ------------------------------------------------------------------------------------------ quantisers


def test_per_tensor_scale_hand_worked():
    # amax 896 -> scale 2 -> q = x / 2, exact: the dequantised tensor is x again
    x = torch.tensor([1.0, -2.0, 896.0, 3.0])
    q, s = fp8.quant_tensor(x)
    assert s.item() == 2.0 and q.float().tolist() == [0.5, -1.0, 448.0, 1.5]
    # an all-zero tensor: scale 0, zeros out, no NaN (vLLM: 0 * inf = NaN, clamped to 448, times scale 0 = 0)
    q0, s0 = fp8.quant_tensor(torch.zeros(4, 4))
    assert s0.item() == 0.0 and torch.equal(q0.float() * s0, torch.zeros(4, 4))
    # a merged layer's amax sets the scale of each part
    q1, s1 = fp8.quant_tensor(torch.tensor([1.0]), amax=torch.tensor(448.0))
    assert s1.item() == 1.0 and q1.float().item() == 1.0


def test_per_token_scale_and_the_zero_row():
    x = torch.tensor([[0.0, 0.0, 0.0], [1.0, -4.0, 2.0]])
    q, s = fp8.quant_rows(x)
    assert s[0, 0].item() == pytest.approx(fp8.MIN_SCALING_FACTOR) and torch.equal(q[0].float(), torch.zeros(3))
    assert s[1, 0].item() == pytest.approx(4.0 / 448.0)
    # x / scale, then the cast: -4 -> -448 exactly, 1 -> 112, 2 -> 224
    assert q[1].float().tolist() == [112.0, -448.0, 224.0]
    assert not torch.isnan(q.float()).any()


def test_groups_and_blocks_hand_worked():
    x = torch.zeros(2, 256)
    x[1, 128:] = torch.linspace(-8, 8, 128)
    q, s = fp8.quant_groups(x)  # [2, 256], [2, 2]
    assert s.shape == (2, 2) and s[0, 0].item() == pytest.approx(fp8.GROUP_EPS / 448)
    assert s[1, 1].item() == pytest.approx(8 / 448) and q.float()[1, -1].item() == 448.0
    assert torch.equal(q.float()[0], torch.zeros(256))  # zero groups: zeros, no NaN
    w = torch.zeros(256, 128)
    w[128:] = 2.0
    qb, sb = fp8.quant_blocks(w)  # an all-zero block and a constant one
    assert sb.shape == (2, 1) and sb[0, 0].item() == pytest.approx(1e-4 / 448) and sb[1, 0].item() == pytest.approx(
        2 / 448)
    assert torch.equal(qb.float()[:128], torch.zeros(128, 128)) and (qb.float()[128:] == 448).all()


def test_kv_cache_round_trip_is_elementwise_and_idempotent():
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(2, 3, 5, 8, generator=g) * 100).bfloat16()
    once = fp8.dequant_kv(k)
    assert once.dtype == torch.bfloat16
    assert torch.equal(once, fp8.dequant_kv(once))  # a cache read twice is the same cache
    assert torch.equal(once.float(), k.float().clamp(-448, 448).to(E4M3).float())  # scale 1: torch's cast
    assert torch.equal(fp8.dequant_kv(k[:, :1]), once[:, :1])  # no scale across tokens


# ----------------------------------------------------------------------------------------------- GEMMs


def _operands(M=8, K=256, N=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    return x, w


def _bound(terms: torch.Tensor, K: int) -> torch.Tensor:
    """fp32 summation of K terms: |error| <= K * 2^-24 * Σ|terms| (the standard recursive-sum bound) plus the two
    scale products' roundings."""
    return (K + 2) * 2.0**-24 * terms


def test_scaled_product_against_float64():
    x, w = _operands()
    xq, sx = fp8.quant_rows(x)
    wq, sw = fp8.quant_tensor(w)
    got = fp8.scaled_product(xq, sx, wq, sw)
    ref = (xq.double() @ wq.double().T) * sx.double() * sw.double()  # [M, N]
    terms = (xq.double().abs() @ wq.double().abs().T) * sx.double() * sw.double()
    assert ((got.double() - ref).abs() <= _bound(terms, x.shape[1])).all()


def test_scaled_product_against_torch_scaled_mm():
    x, w = _operands()
    xq, sx = fp8.quant_rows(x)
    wq, sw = fp8.quant_rows(w)  # per channel: torch's row-wise scaling takes [M, 1] and [1, N]
    try:
        theirs = torch._scaled_mm(xq, wq.T, scale_a=sx, scale_b=sw.T, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:  # builds without a CPU kernel
        pytest.skip(f"torch._scaled_mm does not run on this CPU: {e}")
    ours = fp8.scaled_product(xq, sx, wq, sw.T)
    terms = (xq.double().abs() @ wq.double().abs().T) * sx.double() * sw.double().T
    assert ((ours.double() - theirs.double()).abs() <= 2 * _bound(terms, x.shape[1])).all()


def test_block_product_against_float64():
    x, w = _operands(K=256, N=256)
    xq, sx = fp8.quant_groups(x)  # [M, 256], [M, 2]
    wq, sw = fp8.quant_blocks(w)  # [256, 256], [2, 2]
    got = fp8.block_product(xq, sx, wq, sw)
    xd = xq.double() * sx.double().repeat_interleave(128, 1)  # dequantised [M, K]
    wd = wq.double() * sw.double().repeat_interleave(128, 0).repeat_interleave(128, 1)  # [N, K]
    ref, terms = xd @ wd.T, xd.abs() @ wd.abs().T
    assert ((got.double() - ref).abs() <= _bound(terms, 256)).all()


# -------------------------------------------------------------------------------------- recipes on a model


def test_recipe_names_compose_and_refuse(tiny):
    r = get_recipe("bf16+fp8-w8a8+fp8-kv")
    assert r.quant == ("fp8-w8a8", "fp8-kv") and r.weight_dtype == torch.bfloat16 and r.name == "bf16+fp8-w8a8+fp8-kv"
    assert without_quant(r) == get_recipe("bf16")
    assert get_recipe("fp32+fp8-w8a16").weight_dtype == torch.float32
    with pytest.raises(RecipeError, match="unknown FP8"):
        get_recipe("bf16+fp8-nope")
    with pytest.raises(RecipeError, match="pick one"):
        get_recipe("bf16+fp8-w8a8+fp8-block")


def test_block_recipe_refuses_a_shape_naming_recipe_and_layer(tiny):
    # tiny-random's hidden size is 64: not a multiple of the 128 block
    with pytest.raises(QuantError, match=r"recipe bf16\+fp8-block: layer model\.layers\.0\.self_attn\.q_proj"):
        apply_recipe(tiny.model, get_recipe("bf16+fp8-block"))


def test_which_layers_are_quantised_and_merged_scales(tiny):
    model = apply_recipe(tiny.model, get_recipe("bf16+fp8-w8a8"))
    assert not fp8_layers.is_fp8(lm_head(model))  # the head stays bf16
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(fp8_layers.is_fp8(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.down_proj))
    x = torch.randn(3, 64).bfloat16()
    for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        m(x if m is not mlp.down_proj else torch.randn(3, 128).bfloat16())
    # q, k and v are one Linear in vLLM: one per-tensor scale, from the amax of all three
    amax = max(m.weight.float().abs().max() for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert m._pc_fp8_w[1].item() == (amax / 448).item()
    assert mlp.gate_proj._pc_fp8_w[1].item() == mlp.up_proj._pc_fp8_w[1].item()


def test_linear_forward_is_the_emulated_gemm(tiny):
    model = apply_recipe(tiny.model, get_recipe("bf16+fp8-w8a8"))
    lin = model.model.layers[1].mlp.down_proj
    x = torch.randn(2, 5, 128).bfloat16()
    got = lin(x)  # [2, 5, 64] bf16
    wq, sw = fp8.quant_tensor(lin.weight)
    xq, sx = fp8.quant_rows(x.reshape(-1, 128))
    want = (sx * (sw * fp8.product(xq, wq, lin._pc_fp8_packed))).bfloat16().reshape(2, 5, 64)  # its own kernel
    plain = (sx * (sw * F.linear(xq.float(), wq.float()))).bfloat16().reshape(2, 5, 64)  # F.linear: another order
    assert ((plain.float() - want.float()).abs() <= torch.finfo(torch.bfloat16).eps * want.float().abs()).all()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_merged_group_quantises_its_input_once(tiny, monkeypatch):
    """q/k/v and gate/up read one input: it is quantised once per group (4 quantisations a layer: q/k/v, o, gate/up,
    down), each member's output bit for bit its own fp8_linear on that input, and an input changed in place between
    two members is quantised again, not taken stale."""
    model = apply_recipe(tiny.model, get_recipe("bf16+fp8-w8a8"))
    calls = []
    real = fp8_layers.token_quant
    monkeypatch.setattr(fp8_layers, "token_quant", lambda x: calls.append(1) or real(x))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 4 * len(model.model.layers)
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64).bfloat16()
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        alone = fp8_layers.fp8_linear(x, m._pc_fp8_spec, *m._pc_fp8_w, m.bias, torch.bfloat16, packed=m._pc_fp8_packed)
        assert torch.equal(m(x), alone)
    calls.clear()
    attn.q_proj(x)
    x.mul_(2)  # changed in place: k_proj must not take q_proj's quantisation of the old values
    out = attn.k_proj(x)
    m = attn.k_proj
    assert len(calls) == 2 and torch.equal(out, fp8_layers.fp8_linear(x, m._pc_fp8_spec, *m._pc_fp8_w, m.bias,
                                                               torch.bfloat16, packed=m._pc_fp8_packed))


@pytest.mark.parametrize("name", ["bf16+fp8-w8a8", "bf16+fp8-w8a8-channel", "bf16+fp8-w8a16", "bf16+fp8-w8a8+fp8-kv"])
@pytest.mark.parametrize("packed", [False, True])
def test_engine_and_shadow_quantise_bit_for_bit(tiny, name, packed):
    """The engine (LocalEngine: static decode, its E4M3 images laid out for oneDNN like the scorer's) and the shadow
    (apply_recipe, scoring) hold the same E4M3 weights and scales bit for bit, quantise the same input to the same
    E4M3 values and multiply in the same order: their Linears' outputs are equal bit for bit. An engine told not to
    pack (packed=False) multiplies with F.linear: another fp32 summation order, at most K * 2^-24 * Σ|terms| before the
    bf16 rounding, so at most one bf16 spacing of an output."""
    recipe = get_recipe(name)
    engine = LocalEngine(tiny.model, recipe=recipe, packed=None if packed else False)
    if packed and not engine.packed:
        pytest.skip("no oneDNN packed linear on this machine (decode.can_pack)")
    shadow = apply_recipe(tiny.model, recipe)
    checked = 0
    for (n, a), b in zip(engine.model.named_modules(), shadow.modules()):
        if fp8_layers.is_fp8(a):
            inp = torch.randn(4, a.weight.shape[1]).bfloat16()
            out_a, out_b = a(inp), b(inp)
            assert torch.equal(a._pc_fp8_w[0].view(torch.uint8), b._pc_fp8_w[0].view(torch.uint8)), n
            assert torch.equal(a._pc_fp8_w[1], b._pc_fp8_w[1]), n
            if packed or not b._pc_fp8_pack:  # the same kernel on both sides
                assert torch.equal(out_a, out_b), n
            else:  # the unpacked engine's F.linear against the scorer's oneDNN: fp32 summation order only
                spacing = torch.finfo(torch.bfloat16).eps * out_b.float().abs()  # >= one bf16 ulp of each output
                assert ((out_a.float() - out_b.float()).abs() <= spacing).all(), n
            checked += 1
    assert checked == 14  # 7 Linears in each of the 2 layers; the head is not quantised


def test_engine_rescore_and_weight_sync_follow_the_quantiser(tiny, tiny_prompts):
    from phantomclip.engines.local import SamplingParams

    recipe = get_recipe("bf16+fp8-w8a8+fp8-kv")
    engine = LocalEngine(tiny.model, recipe=recipe)
    params = SamplingParams(max_tokens=6, seed=3)
    out = engine.generate(tiny_prompts[:4], params)
    again = engine.rescore(out, params)
    assert again.logp_engine == out.logp_engine  # the engine's own decode path, bit for bit
    plain = LocalEngine(tiny.model, recipe=get_recipe("bf16")).rescore(out, params)
    assert plain.logp_engine != out.logp_engine  # FP8 moved the log-probs
    master = apply_recipe(tiny.model, get_recipe("fp32"))
    with torch.no_grad():
        for p in master.parameters():
            p.mul_(1.5)
    engine.load_weights(master)  # the quantised weights are refreshed from the synced ones
    lin = engine.model.model.layers[0].mlp.down_proj
    lin(torch.randn(1, 128).bfloat16())
    assert torch.equal(lin._pc_fp8_w[0].float(), fp8.quant_tensor(lin.weight)[0].float())


def test_weight_only_on_exactly_representable_weights_changes_nothing(tiny, tiny_prompts):
    """Weights that are E4M3 values with amax 448 per merged layer quantise to themselves (scale 1): weight-only FP8
    then computes exactly what the bf16 recipe's emulated kernel computes, so β_quant = 0 token for token."""
    master = apply_recipe(tiny.model, get_recipe("fp32"))
    model = apply_recipe(master, get_recipe("bf16+fp8-w8a16"))
    with torch.no_grad():
        for mod in fp8_layers.quantised_linears(master, {id(lm_head(master))}).values():
            w = mod.weight * (400.0 / mod.weight.abs().max())
            mod.weight.copy_(fp8.to_e4m3(w).float())
            mod.weight[0, 0] = 448.0  # every part of a merged layer reaches 448: its scale is 1
    plain = apply_recipe(master, get_recipe("bf16"), matmul="emulated")
    quant = apply_recipe(master, get_recipe("bf16+fp8-w8a16"), matmul="emulated")
    for m in quant.modules():  # F.linear, as the emulated bf16 kernel: the same product, so the same sums
        if fp8_layers.is_fp8(m):
            m._pc_fp8_pack = False
    ids = torch.tensor([p + [5, 6, 7] for p in tiny_prompts[:3] if len(p) == len(tiny_prompts[0])] or [[1, 2, 3, 4]])
    attn = torch.ones_like(ids)
    a = score(plain, get_recipe("bf16"), ids, attn).logp
    b = score(quant, get_recipe("bf16+fp8-w8a16"), ids, attn).logp
    assert torch.equal(a, b)
    del model


def test_block_weights_follow_vllm_0_32s_reciprocal_of_the_scale():
    """vLLM 0.32's per_block_cast_to_fp8 computes sf = amax / 448 and q = (x * (1 / sf)).to(fp8); the older rule was
    x * (448 / amax). In fp32, amax = 0.7572267651557922 and x = 0.5679200887680054 give x * (1 / sf) = 336 exactly,
    a tie between the E4M3 neighbours 320 and 352 (spacing 32 in [256, 512)), which goes to the even mantissa 320
    (1.25 * 256, mantissa 010); x * (448 / amax) = 336.00003, which rounds to 352. The block rule gives 320."""
    amax, x = 0.7572267651557922, 0.5679200887680054
    w = torch.zeros(128, 128)
    w[0, 0], w[0, 1] = amax, x
    q, s = fp8.quant_blocks(w)
    sf = torch.tensor(amax) / 448.0  # fp32, as vLLM
    assert s[0, 0].item() == sf.item()
    assert (torch.tensor(x) * (1.0 / sf)).item() == 336.0 and q.float()[0, 1].item() == 320.0
    assert fp8.to_e4m3(torch.tensor(x) * (448.0 / torch.tensor(amax))).float().item() == 352.0  # the older rule


def test_weight_only_scale_is_rounded_to_the_models_dtype_as_marlin_does(tiny):
    """Marlin (vLLM's W8A16 kernel) takes the weight scale as layer.weight_scale.to(orig_dtype): a bf16 engine's
    scale is bf16(amax / 448), not the fp32 amax / 448 of the W8A8 path; the E4M3 values are the same."""
    model = apply_recipe(tiny.model, get_recipe("bf16+fp8-w8a16"))
    lin = model.model.layers[0].mlp.down_proj
    lin(torch.randn(2, lin.weight.shape[1]).bfloat16())
    wq, sw = lin._pc_fp8_w
    q32, s32 = fp8.quant_tensor(lin.weight.detach())
    assert torch.equal(wq.view(torch.uint8), q32.view(torch.uint8))
    assert sw.item() == s32.bfloat16().float().item() and sw.item() != s32.item()  # this weight's scale rounds


def test_fp8_linear_recipes_refuse_a_model_with_fused_experts():
    """tiny-moe holds each MoE layer's experts as 3-D tensors (transformers 5): an FP8 Linear recipe would leave them
    in bf16 while vLLM quantises them, so it is refused in one line naming the tensor; the FP8 KV cache alone runs."""
    from phantomclip.models.load import load_model

    moe = load_model("tiny-moe:0")
    with pytest.raises(QuantError, match=r"recipe bf16\+fp8-w8a8: model\.layers\.0\.mlp\.experts\.\w+ holds an MoE "
                                         r"layer's experts as one \(8, \d+, \d+\) tensor"):
        apply_recipe(moe.model, get_recipe("bf16+fp8-w8a8"))
    apply_recipe(moe.model, get_recipe("bf16+fp8-kv"))


def test_the_fp8_query_option_quantises_the_query_in_scoring_and_decode(tiny, tiny_prompts):
    """fp8-kvq (an FP8-query attention backend: FlashAttention 3, FlashInfer) quantises the query as well as the
    cache, in scoring and in the engine's decode: the log-probs of the same tokens differ from fp8-kv's on both paths
    (the query's E4M3 rounding), and fp8-kv and fp8-kvq together are refused."""
    from phantomclip.engines.local import Rollout, SamplingParams

    ids = torch.tensor([tiny_prompts[0] + [5, 6, 7, 8]])
    attn = torch.ones_like(ids)
    kv = score(apply_recipe(tiny.model, get_recipe("bf16+fp8-kv")), get_recipe("bf16+fp8-kv"), ids, attn).logp
    kvq = score(apply_recipe(tiny.model, get_recipe("bf16+fp8-kvq")), get_recipe("bf16+fp8-kvq"), ids, attn).logp
    assert not torch.equal(kv, kvq)
    given = Rollout(prompt_ids=[tiny_prompts[0]], completion_ids=[[5, 6, 7, 8]], logp_engine=[],
                    logp_engine_processed=[])
    reads = {}
    for name in ("bf16+fp8-kv", "bf16+fp8-kvq"):
        engine = LocalEngine(tiny.model, recipe=get_recipe(name))
        assert engine.model._pc_fp8_q == name.endswith("kvq")
        reads[name] = engine.rescore(given, SamplingParams(max_tokens=4)).logp_engine[0]
    assert len(reads["bf16+fp8-kvq"]) == 4 and reads["bf16+fp8-kv"] != reads["bf16+fp8-kvq"]
    with pytest.raises(RecipeError, match="fp8-kv and fp8-kvq: an engine's attention quantises the query or not"):
        get_recipe("bf16+fp8-kv+fp8-kvq")
