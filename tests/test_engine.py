import math

import pytest
import torch

from conftest import MATMULS, assert_close_eps, eps, forward_terms, report
from phantomclip.engines.local import LocalEngine, Rollout, SamplingParams, sample_next_token
from phantomclip.precision.recipes import apply_recipe, get_recipe
from phantomclip.precision.scoring import position_ids_from_mask, score


def test_sample_next_token_is_seeded_and_returns_exact_logprobs():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    a = sample_next_token(logits, torch.Generator().manual_seed(7))
    b = sample_next_token(logits, torch.Generator().manual_seed(7))
    assert torch.equal(a[0], b[0])
    expected = torch.log_softmax(logits, -1).gather(-1, a[0][:, None]).squeeze(-1)
    # bit-identical by construction: the same log_softmax of the same fp32 tensor (dividing by temperature 1 is
    # exact), and with no truncation the processed log-probs are that same tensor
    assert torch.equal(a[1], expected) and torch.equal(a[2], expected), report("raw", a[1], expected)


def test_tiny_tail_probabilities_keep_their_own_cdf_step():
    # One dominant logit: the tail tokens have p ~ 1e-9 each; an fp32 CDF would erase their steps.
    logits = torch.full((1, 1000), -20.0)
    logits[0, 0] = 0.0
    probs = torch.softmax(logits.double(), -1)[0]
    cdf = torch.cumsum(probs, 0)
    assert (cdf[1:] > cdf[:-1]).all()  # fp64: every token has a non-empty interval
    tok, lp, _ = sample_next_token(logits.expand(50000, 1000), torch.Generator().manual_seed(0))
    assert torch.isfinite(lp).all()
    assert (tok != 0).sum().item() <= 5  # expected 50000 * 999 * 2e-9 ~ 1e-1


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = torch.log(probs).expand(20000, 4)
    tok, _, _ = sample_next_token(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).float() / 20000
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3], atol=0.015), freq


def test_top_k_top_p_kept_set_and_processed_logprob():
    # p = [0.5, 0.3, 0.15, 0.05]. top_p = 0.7 keeps {0, 1} (mass before token 1 is 0.5 < 0.7; before token 2 is
    # 0.8 >= 0.7). Processed log-prob of token 0 = log(0.5 / 0.8); raw stays log 0.5.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    tok, raw, proc = sample_next_token(logits, torch.Generator().manual_seed(0), top_p=0.7)
    assert set(tok.tolist()) == {0, 1}
    zero = tok == 0
    # fp32 against exact values: log p rounds by eps * |log p| (|log p| <= |log 0.05| = 3), each renormalising
    # logsumexp over V = 4 terms adds eps * sqrt(V) of that size: 2 eps_fp32 * max|log p| * sqrt(V)
    scale = logits.abs().max()
    assert_close_eps(raw[zero], math.log(0.5), torch.float32, scale, terms=4, name="raw")
    assert_close_eps(proc[zero], math.log(0.5 / 0.8), torch.float32, scale, terms=4, name="processed")
    # top_k = 3 keeps {0, 1, 2}: S = 0.95
    tok, raw, proc = sample_next_token(logits, torch.Generator().manual_seed(0), top_k=3)
    assert set(tok.tolist()) == {0, 1, 2}
    assert_close_eps(proc - raw, -math.log(0.95), torch.float32, scale, terms=4, name="-log S")
    # both: top-k first (k=2 -> renormalised [0.625, 0.375]), then top-p 0.6 on that -> only token 0, S = 0.5
    tok, raw, proc = sample_next_token(logits[:200], torch.Generator().manual_seed(0), top_k=2, top_p=0.6)
    assert set(tok.tolist()) == {0}
    assert_close_eps(proc, 0.0, torch.float32, scale, terms=4, name="the one kept token")
    # temperature 2: log softmax(z / 2), bit-identical by construction (the same ops on the same tensor)
    tok, raw, _ = sample_next_token(logits[:5], torch.Generator().manual_seed(0), temperature=2.0)
    assert torch.equal(raw, torch.log_softmax(logits[:5] / 2, -1).gather(-1, tok[:, None]).squeeze(-1))


_ENGINE_VS_SCORER: dict = {}


def _engine_vs_scorer(tiny, prompts, dtype, params, matmul="auto"):
    """(rollout, fp32 scorer's log-probs [N], engine's [N], max |logit| of the scorer's distribution for each [N]);
    cached per (dtype, matmul, params), as the bf16 test compares against the fp16 run."""
    key = (dtype, matmul, params, len(prompts))
    if key in _ENGINE_VS_SCORER:
        return _ENGINE_VS_SCORER[key]
    engine = LocalEngine(tiny.model, dtype, matmul=matmul)
    ro = engine.generate(prompts, params)
    batch = ro.pack(tiny.tokenizer.pad_token_id)
    recipe = get_recipe("fp32")
    model = apply_recipe(tiny.model, recipe)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    s = score(model, recipe, ids, attn, batch["completion_mask"])
    m = batch["completion_mask"]
    assert torch.equal(s.mask, m)
    with torch.no_grad():
        z = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits  # [B, T, V]
    scale = torch.cat([torch.zeros_like(z[:, :1, 0]), z[:, :-1].abs().amax(-1)], 1)  # [B, T]
    _ENGINE_VS_SCORER[key] = ro, s.logp[m], batch["logp_engine"][m], scale[m]
    return _ENGINE_VS_SCORER[key]


def test_fp32_engine_decode_matches_fp32_prefill_scorer(tiny, tiny_prompts):
    params = SamplingParams(max_tokens=24, seed=3)
    _, logp, logp_engine, scale = _engine_vs_scorer(tiny, tiny_prompts, torch.float32, params)
    assert logp.numel() == 6 * 24
    # fp32 both (no low-precision matmul: 'native' and 'emulated' are the same kernels). Decode runs every matmul
    # on one token against the KV cache, prefill on whole rows: every reduction of the forward is reordered.
    # Measured 0.26-0.38 of the bound (AVX-512, AVX2 and SSE kernels; max |Δ| 1.9e-5); was atol 1e-4.
    context = max(len(p) for p in tiny_prompts) + 24
    assert_close_eps(logp, logp_engine, torch.float32, scale, terms=forward_terms(tiny.model.config, context),
                     name="fp32 decode vs prefill")


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_engine_differs_from_fp32_by_a_bounded_amount(tiny, tiny_prompts, dtype, matmul):
    params = SamplingParams(max_tokens=24, seed=3)
    _, logp, logp_engine, scale = _engine_vs_scorer(tiny, tiny_prompts, dtype, params, matmul)
    gap = (logp - logp_engine).abs()
    # Each stage of a low-precision forward rounds its output to the low dtype (relative error <= eps_low / 2),
    # and those errors reach the logits as a relative change of order eps_low: the mean |β| is about one eps_low
    # of the logits' size, for bf16 and fp16 alike (measured 0.87-1.13 eps_low * mean max|z| on AVX-512-BF16,
    # AVX2 and SSE kernels, both matmuls; mean |β| ~0.05 in bf16, ~0.008 in fp16). Far above fp32 noise, and
    # within a factor 4 either way of that size.
    size = eps(dtype) * scale.mean()
    assert size / 4 < gap.mean() < 4 * size, report(f"{dtype} engine vs fp32 (size {size:.3e})", logp, logp_engine)
    # The worst token: those roundings as a random walk over the forward's stages (measured <= 0.2 of this bound)
    context = max(len(p) for p in tiny_prompts) + 24
    assert_close_eps(logp, logp_engine, dtype, scale, terms=forward_terms(tiny.model.config, context), name=str(dtype))
    if dtype == torch.bfloat16:  # bf16 keeps 3 fewer mantissa bits than fp16: a larger gap
        _, lp16, le16, _ = _engine_vs_scorer(tiny, tiny_prompts, torch.float16, params, matmul)
        assert gap.mean() > (lp16 - le16).abs().mean()


def test_generate_is_deterministic_and_stops_on_stop_tokens(tiny, tiny_prompts):
    engine = LocalEngine(tiny.model, torch.bfloat16)
    p = SamplingParams(max_tokens=40, seed=11, stop_token_ids=(tiny.tokenizer.eos_token_id,))
    a, b = engine.generate(tiny_prompts, p), engine.generate(tiny_prompts, p)
    assert a.completion_ids == b.completion_ids and a.logp_engine == b.logp_engine
    c = engine.generate(tiny_prompts, SamplingParams(max_tokens=40, seed=12))
    assert c.completion_ids != a.completion_ids
    # Stop on whatever token row 0 sampled third: that row must end right there, keeping the stop token.
    stop = a.completion_ids[0][2]
    d = engine.generate(tiny_prompts, SamplingParams(max_tokens=40, seed=11, stop_token_ids=(stop,)))
    first = d.completion_ids[0].index(stop)
    assert len(d.completion_ids[0]) == first + 1 and d.finished[0]
    for ids, fin, lp in zip(d.completion_ids, d.finished, d.logp_engine):
        assert len(lp) == len(ids)
        assert fin == (stop in ids) and (not fin or ids.index(stop) == len(ids) - 1)
        assert fin or len(ids) == 40


def test_pack_layout():
    logp = [[-0.1, -0.2], [-0.3, -0.4, -0.5]]
    ro = Rollout([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], logp, logp)
    b = ro.pack(pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 5, 6, 0], [0, 0, 4, 7, 8, 9]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b["completion_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert torch.equal(b["logp_engine"][1, 3:], torch.tensor([-0.3, -0.4, -0.5]))  # the same floats, stored as fp32


def test_weight_sync_moves_the_engine(tiny, tiny_prompts):
    import copy

    master = copy.deepcopy(tiny.model)
    engine = LocalEngine(master, torch.bfloat16)
    p = SamplingParams(max_tokens=8, seed=0)
    before = engine.generate(tiny_prompts[:2], p)
    with torch.no_grad():
        for w in master.parameters():
            w.mul_(1.5)
    assert engine.generate(tiny_prompts[:2], p).logp_engine == before.logp_engine  # not synced yet
    engine.load_weights(master)
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(engine.model.lm_head.weight, master.lm_head.weight.to(torch.bfloat16))
    assert engine.generate(tiny_prompts[:2], p).logp_engine != before.logp_engine


def test_bad_sampling_params():
    for kw in ({"max_tokens": 0}, {"temperature": 0}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"min_p": 1.0},
               {"min_p": -0.1}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


@pytest.mark.parametrize("matmul", MATMULS)
def test_rescore_reproduces_the_engines_own_logprobs_and_follows_its_weights(tiny, tiny_prompts, matmul):
    """Teacher-forcing a rollout through the engine that sampled it (same weights, batch, kernels, decode path)
    repeats the same arithmetic: the log-probs equal the rollout's bit for bit, rows of different lengths included
    (a stop token ends some rows early). With other weights they move; with the first weights back they return."""
    engine = LocalEngine(tiny.model, torch.bfloat16, matmul=matmul)
    stop = engine.generate(tiny_prompts, SamplingParams(max_tokens=30, seed=5)).completion_ids[0][4]
    params = SamplingParams(max_tokens=30, seed=5, top_p=0.9, stop_token_ids=(stop,))
    ro = engine.generate(tiny_prompts, params)
    assert len({len(c) for c in ro.completion_ids}) > 1  # rows end at different steps
    again = engine.rescore(ro, params)
    assert again.completion_ids == ro.completion_ids and again.finished == ro.finished
    assert again.logp_engine == ro.logp_engine and again.logp_engine_processed == ro.logp_engine_processed
    original = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    engine.load_weights({k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g)
                         for k, v in original.items()})
    moved = engine.rescore(ro, params)
    assert moved.completion_ids == ro.completion_ids and moved.logp_engine != ro.logp_engine
    engine.load_weights(original)
    assert engine.rescore(ro, params).logp_engine == ro.logp_engine
