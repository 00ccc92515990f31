import pytest
import torch

from conftest import MATMULS, assert_close_eps, eps, forward_terms, report
from phantomclip.engines.local import left_pad
from phantomclip.precision.recipes import apply_recipe, forward_context, get_recipe
from phantomclip.precision.scoring import (
    LOGIT_STATS,
    logit_statistics,
    logprobs_from_logits,
    naive_logprobs,
    position_ids_from_mask,
    score,
)


def _logit_scale(model, recipe, ids, attn) -> torch.Tensor:
    """[B, T]: max |logit| of the distribution that scores each position (the one computed at t-1; 0 at t = 0).

    The scale of a log-prob's rounding error: log p_t = z_t - logsumexp(z), and both terms round in proportion to
    the logits' size, not to log p's (which may be near 0)."""
    with torch.no_grad(), forward_context(recipe):
        z = model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits  # [B, T, V]
    z = z.float()
    return torch.cat([torch.zeros_like(z[:, :1, 0]), z[:, :-1].abs().amax(-1)], 1)


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_chunked_matches_naive_fp32(tiny, tiny_prompts, chunk):
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe("fp32")
    model = apply_recipe(tiny.model, recipe)
    s = score(model, recipe, ids, attn, chunk_size=chunk)
    naive = naive_logprobs(model, recipe, ids, attn)
    m = s.mask
    assert m.sum() == attn.sum() - len(tiny_prompts)  # every real token but each row's first
    # The same body forward; the head runs on gathered rows in chunks (another matmul shape: chunk 1 is a
    # matrix-vector product) against all rows at once, and the log-softmax on [chunk, V] against [B, T, V]. So the
    # logits (H-term dot products: eps * max|z| * sqrt(H) each) and logsumexp (a V-term sum of terms <= 1:
    # eps * sqrt(V), below that) differ by summation order: 2 eps * max|z| * sqrt(H) per token.
    scale = _logit_scale(model, recipe, ids, attn)[m]
    H = tiny.model.config.hidden_size
    assert_close_eps(s.logp[m], naive[m], torch.float32, scale, terms=H, name="chunked vs naive")
    assert (s.logp[~m] == 0).all()


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize("name", ["bf16", "fp32-head", "bf16-autocast"])
def test_chunked_matches_naive_low_precision(tiny, tiny_prompts, name, matmul):
    # Same model, same body; the head runs on other matmul shapes, then both upcast the logits to fp32 for the
    # log-softmax: the fp32 bound of the test above. Where the logits come out in bf16 (bf16, bf16-autocast), the
    # head's fp32 accumulation is rounded to bf16 once, and a different summation order can carry a logit across a
    # rounding boundary: one bf16 ulp (<= eps_bf16 * |z|). Flips of z_t and inside logsumexp (which moves by
    # sum_j p_j * ulp(z_j) <= eps_bf16 * max|z|) bound |Δ log p| by 2 eps_bf16 * max|z|. A flip needs the two fp32
    # sums to straddle a boundary (odds ~ 2^-16 * sqrt(H) per logit when they differ at all): a rare token, never a
    # systematic shift, so all but 1% stay within the fp32 bound. Measured (AVX-512-BF16, AVX2 and SSE kernels,
    # both matmuls): bit-identical logits.
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe(name)
    model = apply_recipe(tiny.model, recipe, matmul)
    s = score(model, recipe, ids, attn)
    naive = naive_logprobs(model, recipe, ids, attn)
    scale = _logit_scale(model, recipe, ids, attn)[s.mask]
    H = tiny.model.config.hidden_size
    if "lm_head" in recipe.fp32_modules:  # fp32 logits: nothing rounds to bf16 after the shapes diverge
        assert_close_eps(s.logp[s.mask], naive[s.mask], torch.float32, scale, terms=H, name=name)
        return
    fp32_bound = 2 * eps(torch.float32) * scale * H**0.5
    d = (s.logp[s.mask] - naive[s.mask]).abs()
    beyond = (d > fp32_bound).float().mean()
    assert beyond <= 0.01, report(f"{name}: share beyond the fp32 bound", s.logp[s.mask], naive[s.mask])
    assert_close_eps(s.logp[s.mask], naive[s.mask], torch.bfloat16, scale, name=f"{name}: bf16 flips")


def test_left_padding_does_not_change_scores(tiny, tiny_prompts):
    recipe = get_recipe("fp32")
    model = apply_recipe(tiny.model, recipe)
    alone = score(model, recipe, torch.tensor([tiny_prompts[0]]), torch.ones(1, len(tiny_prompts[0]), dtype=torch.long))
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    batched = score(model, recipe, ids, attn)
    row = batched.logp[0][batched.mask[0]]
    # Every matmul and the attention run on other shapes (a padded batch of 6 against one row): the whole
    # forward's reductions reordered, fp32 (measured <= 0.1 of the bound on AVX-512, AVX2 and SSE kernels)
    scale = _logit_scale(model, recipe, ids, attn)[0][batched.mask[0]]
    terms = forward_terms(tiny.model.config, ids.shape[1])
    assert_close_eps(row, alone.logp[0][alone.mask[0]], torch.float32, scale, terms=terms, name="padded vs alone")


def test_entropy_and_logp_from_logits_hand_worked():
    # Uniform over 4: log p = -log 4, H = log 4. Point mass (one logit +inf-like): H ~ 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    logp, ent = logprobs_from_logits(logits, torch.tensor([2, 0]))
    assert logp.dtype == torch.float32
    # log 4 (and 4 * 1/4 * log 4): a handful of fp32 roundings of a value of size log 4 each, against fp64
    log4 = torch.tensor(4.0, dtype=torch.float64).log()
    assert_close_eps(logp[0], -log4, torch.float32, log4, name="log p uniform")
    assert_close_eps(ent[0], log4, torch.float32, log4, terms=4, name="entropy uniform")
    # Point mass: after the max is subtracted (exactly), the target's logit is 0 and logsumexp = log(1 + 3e^-50),
    # a sum of size 1: |log p| and H are below one fp32 rounding of 1 (exact: -6e-22 and 3e-20).
    assert abs(logp[1].item()) <= eps(torch.float32) and 0 <= ent[1].item() <= eps(torch.float32)
    # entropy agrees with -(p log p).sum on random logits: two fp32 sums of V terms p log p (all one sign, so
    # sum |p log p| = H), each log p carrying logsumexp's rounding (eps * max|z|, weighted by sum p = 1)
    z = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    _, ent = logprobs_from_logits(z, torch.zeros(3, dtype=torch.long))
    ref = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    assert_close_eps(ent, ref, torch.float32, ref + z.abs().amax(-1), terms=50, name="entropy")


@pytest.mark.parametrize("matmul", MATMULS)
def test_logprob_only_path_matches_the_entropy_path(tiny, tiny_prompts, matmul):
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe("bf16")
    model = apply_recipe(tiny.model, recipe, matmul)
    full = score(model, recipe, ids, attn, chunk_size=5)
    lean = score(model, recipe, ids, attn, chunk_size=5, entropy=False)
    # The same bf16 logits (same forward, same chunks), upcast to fp32: z_t - logsumexp(z) against log_softmax(z)
    # gathered. Only logsumexp's reduction (V terms <= 1 after the max shift) and the last subtraction (of size
    # max|z|) round differently: 2 eps_fp32 * (max|z| + sqrt(V)).
    scale = _logit_scale(model, recipe, ids, attn) + tiny.model.config.vocab_size**0.5
    assert_close_eps(full.logp, lean.logp, torch.float32, scale, name="logsumexp vs log_softmax")
    assert (lean.entropy == 0).all() and (full.entropy[full.mask] > 0).all()


def test_truncate_logprobs_hand_worked():
    """p = [0.5, 0.3, 0.15, 0.05] (one row), worked by hand; kept mass S and the renormalised log-probs."""
    from phantomclip.precision.scoring import log_kept_mass, truncate_logprobs

    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    cases = {
        # top-p 0.7: mass above each token 0, 0.5, 0.8, 0.95 -> keep the first two, S = 0.8
        (0, 0.7, 0.0): [0.5 / 0.8, 0.3 / 0.8, 0, 0],
        # top-k 3: S = 0.95
        (3, 1.0, 0.0): [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        # min-p 0.5: keep p >= 0.25 -> S = 0.8
        (0, 1.0, 0.5): [0.5 / 0.8, 0.3 / 0.8, 0, 0],
        # min-p 0.2 keeps p >= 0.1 (S = 0.95); then top-p 0.9 on [0.526, 0.316, 0.158]: mass above 0, 0.526,
        # 0.842 < 0.9 -> all three stay
        (0, 0.9, 0.2): [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0],
        # top-k 2 then top-p 0.6 on [0.625, 0.375]: mass above the second is 0.625 >= 0.6 -> only the top, S = 0.5
        (2, 0.6, 0.0): [1, 0, 0, 0],
    }
    # fp32 against exact (fp64) values: log p rounds by eps * |log p| (|log p| <= 3), each renormalising
    # logsumexp over V = 4 terms adds eps * sqrt(V) of that size, and exp carries the log's error over, relative
    # to p <= 1: 2 eps_fp32 * max|log p| * sqrt(V).
    scale = logp.abs().max()
    for (k, p, m), expected in cases.items():
        kept = truncate_logprobs(logp, k, p, m)
        expected = torch.tensor([expected], dtype=torch.float64)
        assert_close_eps(kept.exp(), expected, torch.float32, scale, terms=4, name=str((k, p, m)))
        S = {(0, 0.7, 0.0): 0.8, (3, 1.0, 0.0): 0.95, (0, 1.0, 0.5): 0.8, (0, 0.9, 0.2): 0.95,
             (2, 0.6, 0.0): 0.5}[(k, p, m)]
        assert_close_eps(log_kept_mass(logp, kept).exp(), S, torch.float32, scale, terms=4, name=f"S {(k, p, m)}")
    assert truncate_logprobs(logp) is logp  # nothing truncated: no copy


def test_score_reports_kept_mass(tiny, tiny_prompts):
    """score(truncation=...) gives log S per scored token, equal to the head's full distribution truncated by hand."""
    from phantomclip.precision.recipes import get_recipe
    from phantomclip.precision.scoring import log_kept_mass, score, truncate_logprobs

    ids = torch.tensor([tiny_prompts[0]])
    attn = torch.ones_like(ids)
    s = score(tiny.model, get_recipe("fp32"), ids, attn, truncation=(5, 0.8, 0.05))
    logits = tiny.model(input_ids=ids).logits[0, :-1].float()  # [T-1, V] predicts tokens 1..T-1
    logp_all = logits.log_softmax(-1)
    expected = log_kept_mass(logp_all, truncate_logprobs(logp_all, 5, 0.8, 0.05))  # [T-1]
    # fp32 both, as in test_chunked_matches_naive_fp32: the head on other shapes, so log p (and log S, a logsumexp
    # of kept log p, weighted by kept shares summing to 1) differ by 2 eps * max|z| * sqrt(H)
    scale = logits.abs().amax(-1)  # [T-1]
    H = tiny.model.config.hidden_size
    assert_close_eps(s.log_kept[0, 1:], expected, torch.float32, scale, terms=H, name="log S")
    assert (s.log_kept[0, 1:] < 0).all() and s.log_kept[0, 0] == 0
    assert score(tiny.model, get_recipe("fp32"), ids, attn).log_kept is None


def test_logit_statistics_hand_worked_and_through_score(tiny, tiny_prompts):
    # z = [1, 3, 2]: mean 2, population variance (1 + 1 + 0) / 3, std sqrt(2/3) = 0.81650; max 3.
    # Target 1 (the top): margin 3 - 2 = 1. Target 0: margin 1 - 3 = -2. A tie [2, 2, 0] with target 0: margin 0.
    z = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [2.0, 2.0, 0.0]])
    got = logit_statistics(z, torch.tensor([1, 0, 0]))  # [3, 3]
    want = torch.tensor([[(2 / 3) ** 0.5, 3.0, 1.0], [(2 / 3) ** 0.5, 3.0, -2.0], [(8 / 9) ** 0.5, 2.0, 0.0]])
    # a handful of fp32 operations on numbers of size <= 3
    assert_close_eps(got, want, torch.float32, 3.0, terms=3, name="logit statistics")
    assert len(LOGIT_STATS) == got.shape[1]
    # through score: the same statistics as the full logits of the model give, at every scored position
    ids = torch.tensor([tiny_prompts[0]])
    s = score(tiny.model, get_recipe("fp32"), ids, torch.ones_like(ids), logit_stats=True)
    with torch.no_grad():
        logits = tiny.model(input_ids=ids).logits[0, :-1].float()  # [T-1, V] predicts tokens 1..T-1
    expected = logit_statistics(logits, ids[0, 1:])  # [T-1, 3]
    # the head on other shapes (chunked hidden states against the whole forward): 2 eps * max|z| * sqrt(H)
    scale = logits.abs().amax(-1, keepdim=True)  # [T-1, 1]
    assert_close_eps(s.logit_stats[0, 1:], expected, torch.float32, scale, terms=tiny.model.config.hidden_size,
                     name="score's logit statistics")
    assert (s.logit_stats[0, 0] == 0).all() and score(tiny.model, get_recipe("fp32"), ids, torch.ones_like(ids)
                                                      ).logit_stats is None
