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
