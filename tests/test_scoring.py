import pytest
import torch
from conftest import report

from phantomclip.engine import left_pad
from phantomclip.recipes import apply_recipe, get_recipe
from phantomclip.scoring import logprobs_from_logits, naive_logprobs, score


@pytest.mark.parametrize("chunk", [1, 7, 256])
def test_chunked_matches_naive_fp32(tiny, tiny_prompts, chunk):
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe("fp32")
    model = apply_recipe(tiny.model, recipe)
    s = score(model, recipe, ids, attn, chunk_size=chunk)
    naive = naive_logprobs(model, recipe, ids, attn)
    m = s.mask
    assert m.sum() == attn.sum() - len(tiny_prompts)  # every real token but each row's first
    assert torch.allclose(s.logp[m], naive[m], atol=1e-5), report("chunked vs naive", s.logp[m], naive[m])
    assert (s.logp[~m] == 0).all()


@pytest.mark.parametrize("name", ["bf16", "fp32-head", "bf16-autocast"])
def test_chunked_matches_naive_low_precision(tiny, tiny_prompts, name):
    # Same model, same kernels: only the log-softmax path differs (both upcast logits to fp32).
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe(name)
    model = apply_recipe(tiny.model, recipe)
    s = score(model, recipe, ids, attn)
    naive = naive_logprobs(model, recipe, ids, attn)
    assert torch.allclose(s.logp[s.mask], naive[s.mask], atol=1e-5), report(name, s.logp[s.mask], naive[s.mask])


def test_left_padding_does_not_change_scores(tiny, tiny_prompts):
    recipe = get_recipe("fp32")
    model = apply_recipe(tiny.model, recipe)
    alone = score(model, recipe, torch.tensor([tiny_prompts[0]]), torch.ones(1, len(tiny_prompts[0]), dtype=torch.long))
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    batched = score(model, recipe, ids, attn)
    row = batched.logp[0][batched.mask[0]]
    assert torch.allclose(row, alone.logp[0][alone.mask[0]], atol=1e-5), report("padded vs alone", row, alone.logp[0][alone.mask[0]])


def test_entropy_and_logp_from_logits_hand_worked():
    # Uniform over 4: log p = -log 4, H = log 4. Point mass (one logit +inf-like): H ~ 0.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [50.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    logp, ent = logprobs_from_logits(logits, torch.tensor([2, 0]))
    assert logp.dtype == torch.float32
    assert logp[0].item() == pytest.approx(-torch.log(torch.tensor(4.0)).item())
    assert ent[0].item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert logp[1].item() == pytest.approx(0.0, abs=1e-6) and ent[1].item() == pytest.approx(0.0, abs=1e-5)
    # entropy agrees with -(p log p).sum on random logits
    z = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    _, ent = logprobs_from_logits(z, torch.zeros(3, dtype=torch.long))
    ref = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    assert torch.allclose(ent, ref, atol=1e-5)


def test_logprob_only_path_matches_the_entropy_path(tiny, tiny_prompts):
    ids, attn = left_pad(tiny_prompts, tiny.tokenizer.pad_token_id)
    recipe = get_recipe("bf16")
    model = apply_recipe(tiny.model, recipe)
    full = score(model, recipe, ids, attn, chunk_size=5)
    lean = score(model, recipe, ids, attn, chunk_size=5, entropy=False)
    assert torch.allclose(full.logp, lean.logp, atol=1e-5), report("logsumexp vs log_softmax", full.logp, lean.logp)
    assert (lean.entropy == 0).all() and (full.entropy[full.mask] > 0).all()


def test_truncate_logprobs_hand_worked():
    """p = [0.5, 0.3, 0.15, 0.05] (one row), worked by hand; kept mass S and the renormalised log-probs."""
    from phantomclip.scoring import log_kept_mass, truncate_logprobs

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
    for (k, p, m), expected in cases.items():
        kept = truncate_logprobs(logp, k, p, m)
        assert torch.allclose(kept.exp(), torch.tensor([expected], dtype=torch.float32), atol=1e-6), ((k, p, m), kept.exp())
        S = {(0, 0.7, 0.0): 0.8, (3, 1.0, 0.0): 0.95, (0, 1.0, 0.5): 0.8, (0, 0.9, 0.2): 0.95, (2, 0.6, 0.0): 0.5}[(k, p, m)]
        assert log_kept_mass(logp, kept).exp().item() == pytest.approx(S, abs=1e-6)
    assert truncate_logprobs(logp) is logp  # nothing truncated: no copy


def test_score_reports_kept_mass(tiny, tiny_prompts):
    """score(truncation=...) gives log S per scored token, equal to the head's full distribution truncated by hand."""
    from phantomclip.recipes import get_recipe
    from phantomclip.scoring import log_kept_mass, score, truncate_logprobs

    ids = torch.tensor([tiny_prompts[0]])
    attn = torch.ones_like(ids)
    s = score(tiny.model, get_recipe("fp32"), ids, attn, truncation=(5, 0.8, 0.05))
    logits = tiny.model(input_ids=ids).logits[0, :-1].float()  # [T-1, V] predicts tokens 1..T-1
    logp_all = logits.log_softmax(-1)
    expected = log_kept_mass(logp_all, truncate_logprobs(logp_all, 5, 0.8, 0.05))  # [T-1]
    assert torch.allclose(s.log_kept[0, 1:], expected, atol=1e-5), report("log S", s.log_kept[0, 1:], expected)
    assert (s.log_kept[0, 1:] < 0).all() and s.log_kept[0, 0] == 0
    assert score(tiny.model, get_recipe("fp32"), ids, attn).log_kept is None
