"""decode.StaticDecoder against the Hugging Face forward of the same model, per family and dtype, and the engine's
choice of path (decode.supports).

The reference is the model's own forward over the whole padded sequence (prefill of every position at once, HF's
attention and mask). The decoder runs the prompt as one prefill and then one token a step against its preallocated
cache, so every reduction of the forward is reordered: they agree to the rounding of reordered sums
(`assert_close_eps`), not bit for bit.
"""

import pytest
import torch

from conftest import assert_close_eps, eps, forward_terms, report
from phantomclip.engines import decode
from phantomclip.engines.local import LocalEngine, SamplingParams, left_pad
from phantomclip.precision.recipes import apply_recipe, engine_recipe, get_recipe
from phantomclip.precision.scoring import position_ids_from_mask

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 8], [300, 2, 64, 64]]
"""Three prompts of other lengths, so that two of them are left-padded (padding slots must be masked out)."""
STEPS = 10


def tiny_family(model_type: str) -> torch.nn.Module:
    """A 2-layer random model of `model_type` (hidden 64, 4 query heads on 2 key/value heads, head_dim 16), init std
    0.3 so its distributions are as peaked as a real model's. qwen2 has q/k/v biases, qwen3 per-head q/k norms."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    cfg = configs[model_type](vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                              initializer_range=0.3, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if model_type == "qwen2":  # biases start at zero: make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.data.normal_(0, 0.3)
    return model.eval()


def decode_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """StaticDecoder's logits [B, STEPS, V] of the completion slots: the left-padded prompts as one prefill, then
    tokens [B, STEPS] one at a time; row b's logits at step s predict tokens[b, s]."""
    ids, attn = left_pad(PROMPTS, 0)  # [B, P]
    B, P = ids.shape
    attn = torch.cat([attn, torch.ones(B, STEPS, dtype=torch.long)], 1)  # [B, P + STEPS]
    pos = position_ids_from_mask(attn)  # [B, P + STEPS]
    dec = decode.StaticDecoder(model, B, P + STEPS)
    out = [dec(ids, pos[:, :P], attn[:, :P])]
    for s in range(STEPS - 1):
        out.append(dec(tokens[:, s : s + 1], pos[:, P + s : P + s + 1], attn[:, : P + s + 1]))
    return torch.stack(out, 1).float()  # [B, STEPS, V]


def reference_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own forward over prompt + tokens at once, logits [B, STEPS, V] of the same slots."""
    ids, attn = left_pad(PROMPTS, 0)
    P = ids.shape[1]
    ids, attn = torch.cat([ids, tokens], 1), torch.cat([attn, torch.ones_like(tokens)], 1)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    return z[:, P - 1 : P - 1 + STEPS].float()  # [B, STEPS, V]


@pytest.mark.parametrize("model_type", decode.FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decoder_matches_the_models_own_forward(model_type, dtype):
    master = tiny_family(model_type)
    model = apply_recipe(master, engine_recipe(dtype))
    assert decode.supports(model, engine_recipe(dtype))
    tokens = torch.randint(0, 320, (len(PROMPTS), STEPS), generator=torch.Generator().manual_seed(1))
    ours, ref = decode_logits(model, tokens), reference_logits(model, tokens)
    # The same forward with every reduction reordered (cached decode against prefill, packed-GQA attention against
    # HF's): each rounding is eps(dtype)/2 of what it produces, the logits' size max|z| per position, and the
    # rounding events on the path to one logit are forward_terms of this config; factor 2 for two computations.
    # In bf16 every stage also rounds its output, and the reordered sums reach the logits the same way.
    scale = ref.abs().amax(-1, keepdim=True)  # [B, STEPS, 1]
    context = max(len(p) for p in PROMPTS) + STEPS
    assert_close_eps(ours, ref, dtype, scale, terms=forward_terms(master.config, context),
                     name=f"{model_type} {dtype} static decode vs HF forward")


def test_static_decoder_runs_the_recipes_fp32_modules(tiny):
    """fp32-head keeps the final norm and the head in fp32 behind casting hooks; the decoder calls those modules, so
    it computes what the recipe's own forward computes (bf16 body, fp32 head)."""
    recipe = get_recipe("fp32-head")
    model = apply_recipe(tiny.model, recipe)
    assert decode.supports(model, recipe)
    tokens = torch.randint(0, 320, (len(PROMPTS), STEPS), generator=torch.Generator().manual_seed(2))
    ours, ref = decode_logits(model, tokens), reference_logits(model, tokens)
    scale = ref.abs().amax(-1, keepdim=True)
    context = max(len(p) for p in PROMPTS) + STEPS
    # the body computes in bf16, so its reordered sums round at bf16's eps (as in the bf16 case above)
    assert_close_eps(ours, ref, torch.bfloat16, scale, terms=forward_terms(tiny.model.config, context),
                     name="fp32-head static decode vs the recipe's forward")
    plain = decode_logits(apply_recipe(tiny.model, engine_recipe(torch.bfloat16)), tokens)
    assert not torch.equal(ours, plain)  # the fp32 head did run: a bf16 head rounds the logits otherwise


def test_engine_takes_the_static_path_where_supported_and_hf_elsewhere(tiny):
    assert LocalEngine(tiny.model, torch.bfloat16).describe()["decode"] == "static"  # tiny-random is a Llama
    autocast = get_recipe("bf16-autocast")
    assert not decode.supports(apply_recipe(tiny.model, autocast), autocast)  # autocast casts inside the forward
    from transformers import MistralConfig, MistralForCausalLM

    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    engine = LocalEngine(mistral, torch.float32)
    assert engine.describe()["decode"] == "hf"  # another family keeps the model's own forward
    ro = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, seed=0))
    assert len(ro.completion_ids[0]) == 4
    with pytest.raises(ValueError, match="static decode path does not support 'mistral'"):
        LocalEngine(mistral, torch.float32, static_decode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_and_hf_engine_paths_report_the_same_logprobs(tiny, tiny_prompts, dtype):
    """The engine on either path, the same sampled tokens teacher-forced: the log-probs agree to reordered
    rounding, and sampling stays `sample_next_token` (the same seed gives the same tokens where logits agree)."""
    params = SamplingParams(max_tokens=16, seed=5)
    static = LocalEngine(tiny.model, dtype)
    hf = LocalEngine(tiny.model, dtype, static_decode=False)
    ro = static.generate(tiny_prompts, params)
    again = hf.rescore(ro, params)
    a = torch.tensor([x for row in ro.logp_engine for x in row])
    b = torch.tensor([x for row in again.logp_engine for x in row])
    # log-probs of size |log p| <= max|z| + log V; use the tokens' own |log p| plus the log-softmax's log V as the
    # scale of the rounding, with the same forward_terms as above.
    context = max(len(p) for p in tiny_prompts) + 16
    scale = a.abs() + torch.log(torch.tensor(320.0))
    assert_close_eps(a, b, dtype, scale, terms=forward_terms(tiny.model.config, context),
                     name=f"{dtype} engine, static vs HF path")


@pytest.mark.skipif(not decode.can_pack(torch.float32), reason="oneDNN's packed linear needs an x86 CPU with mkldnn")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear_at_any_rows_and_follows_a_sync(dtype):
    """The packed forward against F.linear on the same weights, at 1, 16 and 384 rows (the layout is tuned for 16):
    in fp32 another kernel (oneDNN against MKL), so they agree to the rounding of a reordered sum of K products,
    scale |x||w| summed over K, i.e. 2 eps sqrt(K) * max|x| max|w| per output; in bf16 both are oneDNN's kernel and
    the output is rounded once to bf16, so they may differ by at most one bf16 rounding of the output (factor 1 on
    |out|). After an in-place weight update (what a sync does) the packed forward follows the new weight."""
    if not decode.can_pack(dtype):
        pytest.skip(f"no native {dtype} kernel on this CPU")
    K, N = 96, 80
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(K, N).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(N, K, generator=g))
        linear.bias.copy_(torch.randn(N, generator=g))
    plain = torch.nn.Linear(K, N).to(dtype)
    plain.load_state_dict(linear.state_dict())
    assert decode.pack_linears(linear) == 1
    for step in range(2):
        for rows in (1, 16, 384):
            x = torch.randn(rows, K, generator=g).to(dtype)
            with torch.no_grad():
                got, want = linear(x), plain(x)
            if dtype == torch.float32:
                scale = x.abs().max() * linear.weight.abs().max()  # a product's size; K of them summed
                assert_close_eps(got, want, dtype, scale, terms=K, name=f"packed vs F.linear, {rows} rows")
            else:
                assert_close_eps(got, want, dtype, want.float().abs(), factor=1.0, name=f"bf16, {rows} rows")
        with torch.no_grad():  # a weight sync: in place, both sides
            new = torch.randn(N, K, generator=g).to(dtype)
            linear.weight.copy_(new)
            plain.weight.copy_(new)


@pytest.mark.skipif(not decode.can_pack(torch.float32), reason="oneDNN's packed linear needs an x86 CPU with mkldnn")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_emulated_linear_is_the_emulated_kernel_in_another_summation_order(dtype):
    """A Linear on the emulated kernel, packed (what an engine gets wherever `auto` picks emulated, e.g. bf16 on an
    AVX2-only CPU): the same fp32 product of the rounded operands as `F.linear` on the fp32 image, summed by oneDNN
    instead of MKL, then one rounding of the output. The two fp32 sums differ by at most 2 eps32 sqrt(K) max|x| max|w|
    (the fp32 case above); where that straddles a rounding boundary of `dtype` the outputs differ by one spacing, at
    most eps(dtype) |out|. Such straddles need the sums within fp32 noise (~1e-6 relative) of a boundary spaced
    eps(dtype) (~1e-2 relative) apart: fewer than 1% of outputs may differ (a forgotten rounding of x or of the
    weight would change most of them). After a sync the packed forward follows the new weight."""
    from phantomclip.precision.recipes import use_emulated_matmul

    K, N = 96, 80
    g = torch.Generator().manual_seed(0)
    linear, plain = (use_emulated_matmul(torch.nn.Linear(K, N).to(dtype)) for _ in range(2))
    with torch.no_grad():
        for p_lin, p_plain in zip(linear.parameters(), plain.parameters()):
            p_lin.copy_(torch.randn(p_lin.shape, generator=g))
            p_plain.copy_(p_lin)
    assert decode.pack_linears(linear) == 1 and linear._pc_packed_dtype == torch.float32
    for step in range(2):
        for rows in (1, 16, 384):
            x = torch.randn(rows, K, generator=g)  # fp32: both kernels round it to dtype first
            with torch.no_grad():
                got, want = linear(x), plain(x)
            assert got.dtype == want.dtype == dtype
            fp32_sums = 2 * eps(torch.float32) * K**0.5 * x.abs().max() * linear.weight.float().abs().max()
            bound = eps(dtype) * want.float().abs() + fp32_sums
            d = (got.float() - want.float()).abs()
            assert bool((d <= bound).all()), report(f"{dtype} packed emulated vs emulated, {rows} rows", got, want)
            assert (d > 0).float().mean().item() < 0.01, report(f"{rows} rows: too many outputs differ", got, want)
        with torch.no_grad():  # a weight sync: in place, both sides
            new = torch.randn(N, K, generator=g)
            linear.weight.copy_(new)
            plain.weight.copy_(new)


@pytest.mark.skipif(not decode.can_pack(torch.float32), reason="oneDNN's packed linear needs an x86 CPU with mkldnn")
def test_emulated_engine_is_packed_and_agrees_with_its_f_linear_twin(tiny, tiny_prompts):
    """The bf16 engine on the emulated kernel runs packed fp32 images by default, and reports the log-probs of the
    same engine on F.linear to the rounding of a reordered bf16 forward (the bound of the static-vs-HF test above)."""
    packed = LocalEngine(tiny.model, torch.bfloat16, matmul="emulated")
    plain = LocalEngine(tiny.model, torch.bfloat16, matmul="emulated", packed=False)
    assert packed.describe()["packed_weights"] and not plain.describe()["packed_weights"]
    params = SamplingParams(max_tokens=16, seed=5)
    ro = plain.generate(tiny_prompts, params)
    a = torch.tensor([x for row in packed.rescore(ro, params).logp_engine for x in row])
    b = torch.tensor([x for row in ro.logp_engine for x in row])
    context = max(len(p) for p in tiny_prompts) + 16
    assert_close_eps(a, b, torch.bfloat16, b.abs() + torch.log(torch.tensor(320.0)),
                     terms=forward_terms(tiny.model.config, context), name="emulated bf16 engine, packed vs F.linear")


@pytest.mark.skipif(not decode.can_pack(torch.float32), reason="oneDNN's packed linear needs an x86 CPU with mkldnn")
def test_engine_on_packed_weights_agrees_with_f_linear_and_syncs(tiny, tiny_prompts):
    """LocalEngine fp32 with packed weights (the default here) against the same engine on F.linear: the same tokens
    rescored agree within the fp32 noise of reordered reductions (fp32_forward_noise); after a weight sync both
    engines again agree (the packed copies were re-laid out), and the packed engine moved by much more than that."""
    from conftest import fp32_forward_noise

    packed, plain = LocalEngine(tiny.model, torch.float32), LocalEngine(tiny.model, torch.float32, packed=False)
    assert packed.packed and not plain.packed and packed.describe()["packed_weights"]
    params = SamplingParams(max_tokens=8, seed=0)
    ro = plain.generate(tiny_prompts, params)
    noise = fp32_forward_noise(tiny.model, max(len(p) for p in tiny_prompts) + 8)

    def max_gap(a, b):
        return max(abs(x - y) for r1, r2 in zip(a.logp_engine, b.logp_engine) for x, y in zip(r1, r2))

    before = packed.rescore(ro, params)
    assert max_gap(before, ro) <= noise, (max_gap(before, ro), noise)
    moved = {n: w * 1.05 for n, w in tiny.model.state_dict().items()}
    packed.load_weights(moved)
    plain.load_weights(moved)
    after, reference = packed.rescore(ro, params), plain.rescore(ro, params)
    assert max_gap(after, reference) <= noise, (max_gap(after, reference), noise)
    assert max_gap(after, before) > 100 * noise


def test_a_bf16_layout_that_rounds_otherwise_is_not_used(monkeypatch):
    """bf16 packing is used only where it reproduces F.linear bit for bit on this CPU: a weight shape whose probe
    found a difference keeps F.linear (an fp32 Linear is packed regardless: its kernel is allowed to differ)."""
    if not decode.can_pack(torch.bfloat16):
        pytest.skip("no native bf16 kernel on this CPU")
    monkeypatch.setattr(decode, "_BF16_IDENTICAL", {(80, 96, True): False})
    assert decode.pack_linears(torch.nn.Linear(96, 80).to(torch.bfloat16)) == 0
    assert decode.pack_linears(torch.nn.Linear(96, 48).to(torch.bfloat16)) == 1  # probed here: identical
    assert decode._BF16_IDENTICAL[(48, 96, True)] is True
    assert decode.pack_linears(torch.nn.Linear(96, 80)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_in_four_ops_equals_transformers_bit_for_bit(dtype):
    """decode.rotate computes rotate_half(x)*sin as roll(x)*signed_sin: equal to transformers' own RoPE bit for bit
    (negation is exact and rounding is symmetric in sign), over q and k side by side as over each alone."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 9, 5, 64, generator=g).to(dtype)  # [B, Hq, T, D]
    k = torch.randn(3, 3, 5, 64, generator=g).to(dtype)  # [B, Hkv, T, D]
    angles = torch.randn(3, 5, 64, generator=g) * 40  # [B, T, D]: many turns, signs of sin and cos both ways
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes cos/sin at dim 1
    cos1, sin1 = cos[:, None], decode.signed_sin(sin[:, None])  # [B, 1, T, D]
    assert torch.equal(decode.rotate(q, cos1, sin1), q_ref) and torch.equal(decode.rotate(k, cos1, sin1), k_ref)
    both = decode.rotate(torch.cat([q, k], 1), cos1, sin1)  # [B, Hq + Hkv, T, D]
    assert torch.equal(both[:, :9], q_ref) and torch.equal(both[:, 9:], k_ref)
