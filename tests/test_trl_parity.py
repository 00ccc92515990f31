"""Our pure GRPO loss against TRL's own code, fed the same tensors.

TRL computes advantages and the vLLM importance-sampling correction inside
`GRPOTrainer._generate_and_score_completions`, and the loss in `GRPOTrainer._compute_loss`. We replace only its
generation (`_generate`, which would call vLLM) by fixed completions with fixed "engine" log-probs, let TRL run
everything else, and compare its advantages, correction weights and loss with ours for every correction mode,
loss type and importance-sampling level.
"""

import pytest
import torch

from conftest import assert_close_eps, eps, forward_terms

trl = pytest.importorskip("trl")

from phantomclip.maths.loss import (  # noqa: E402
    CorrectionParams,
    group_advantages,
    grpo_loss,
    rollout_correction,
)
from phantomclip.precision.recipes import get_recipe  # noqa: E402
from phantomclip.precision.scoring import score  # noqa: E402

G = 4  # completions per prompt
P_LEN = 5  # every prompt has 5 tokens: no left padding (TRL does not pass position ids; we count real tokens)


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    from datasets import Dataset

    from phantomclip.models.load import load_model

    lm = load_model("tiny-random:30")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (P_LEN,), generator=gen).tolist() for _ in range(2)]
    lengths = torch.randint(2, 7, (2 * G,), generator=gen)
    completions = [torch.randint(0, 250, (int(n),), generator=gen).tolist() for n in lengths]
    # "Engine" log-probs: the model's own fp32 values, shifted per row and with noise of std 1, so the
    # correction ratios exp(logp_old - logp_engine) land on both sides of the cap 3 and of 1.
    engine_logps = []
    for b, c in enumerate(completions):
        ids = torch.tensor([prompts[b // G] + c])
        true = score(lm.model, get_recipe("fp32"), ids, torch.ones_like(ids)).logp[0, P_LEN:]  # [len(c)]
        shift = 1.5 if b % 2 else -0.5  # odd rows: engine much less sure, ratio > 3 (masked); even rows: kept
        engine_logps.append((true - shift + torch.randn(len(c), generator=gen)).tolist())

    def reward(completions, completion_ids, **kw):
        return [float(sum(ids) % 11) for ids in completion_ids]  # varied, deterministic

    def make(loss_type="dapo", level="token", mode=None):
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=2 * G, num_generations=G,
            max_completion_length=8, report_to=[], use_cpu=True, save_strategy="no", bf16=False, loss_type=loss_type,
            importance_sampling_level=level, epsilon=0.2, logging_steps=1,
            vllm_importance_sampling_mode=mode or "sequence_mask",
        )
        ds = Dataset.from_dict({"prompt": ["x"] * (2 * G)})
        tr = GRPOTrainer(model=lm.model, args=args, reward_funcs=reward, train_dataset=ds,
                         processing_class=lm.tokenizer)
        tr.use_vllm = mode is not None  # the correction runs only on the vLLM path; generation itself is replaced
        tr.vllm_importance_sampling_correction = mode is not None
        prompt_lists = [p for p in prompts for _ in range(G)]

        def fake_generate(_prompts):
            texts = [lm.tokenizer.decode(c) for c in completions]
            return prompt_lists, completions, None, texts, engine_logps, {}, None, None

        tr._generate = fake_generate
        tr.current_gradient_accumulation_steps = 1
        out = tr._generate_and_score_completions([{"prompt": "x"} for _ in range(2 * G)])
        return tr, out

    return lm, make


def _logit_scale(lm, out):
    """[B, L]: max |logit| of the distribution scoring each completion token (the scale of its log-prob's rounding)."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        z = lm.model(input_ids=ids, attention_mask=attn).logits  # [B, P + L, V]
    P, L = out["prompt_ids"].shape[1], out["completion_ids"].shape[1]
    return z[:, P - 1 : P + L - 1].abs().amax(-1)


def _ours_logp(lm, out):
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)  # [B, P + L]
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    score_mask = torch.cat([torch.zeros_like(out["prompt_mask"]), out["completion_mask"]], 1).bool()
    logp = score(lm.model, get_recipe("fp32"), ids, attn, score_mask, entropy=False, grad=True).logp  # [B, P + L]
    return logp[:, out["prompt_ids"].shape[1]:]  # [B, L]


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_advantages_and_correction_weights_match_trl(trl_setup, mode):
    lm, make = trl_setup
    tr, out = make(mode=mode)
    mask = out["completion_mask"].bool()
    rewards = torch.tensor([float(sum(c[m].tolist()) % 11) for c, m in zip(out["completion_ids"], mask)])
    adv = group_advantages(rewards, G)
    # (r - mean) / (std + 1e-4) in fp32: the group's mean and std are G-term sums of rewards of size max|r|, so
    # the numerator rounds by eps * max|r| * sqrt(G), then is divided by the std
    std = rewards.view(-1, G).std(-1).repeat_interleave(G)
    scale = rewards.abs().max() / (std + 1e-4)
    assert_close_eps(adv, out["advantages"], torch.float32, scale, terms=G, name="advantages")
    logp = _ours_logp(lm, out).detach()
    # fp32 forwards by two code paths (ours: body, then the head on the scored rows; TRL: the whole model, then
    # its selective log-softmax): the whole forward's reductions may be reordered (measured: bit-identical here)
    terms = forward_terms(lm.model.config, out["prompt_ids"].shape[1] + out["completion_ids"].shape[1])
    scale = _logit_scale(lm, out)[mask]
    assert_close_eps(logp[mask], out["old_per_token_logps"][mask], torch.float32, scale, terms=terms, name="logp")
    sampling = out["sampling_per_token_logps"]
    weight, masked = rollout_correction(out["old_per_token_logps"], sampling, mask, mode, CorrectionParams(cap=3.0))
    trl_w = out["importance_sampling_ratio"].expand_as(weight)
    # w = exp(log ratio), the log ratio a sum of up to L per-token log ratios (sequence modes) of size max|lr|:
    # it rounds by eps * max|lr| * sqrt(L), which exp turns into a relative error, plus exp's own rounding (eps)
    lr = (out["old_per_token_logps"] - sampling)[mask].abs().max()
    L = mask.shape[1]
    assert_close_eps(weight[mask], trl_w[mask], torch.float32, trl_w[mask] * (1 + lr * L**0.5), name=mode)
    if mode.endswith("mask"):
        assert masked.any() and not masked.all()  # the made-up engine log-probs exercise the mask
        assert torch.equal(masked[mask], trl_w[mask] == 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("mode", [None, "token_truncate", "sequence_mask"])
def test_loss_matches_trl(trl_setup, loss_type, level, mode):
    lm, make = trl_setup
    tr, out = make(loss_type=loss_type, level=level, mode=mode)
    mask = out["completion_mask"]
    gen = torch.Generator().manual_seed(2)
    # Old log-probs moved off the current ones, so ratios land on both sides of [0.8, 1.2] and the clip fires.
    old = _ours_logp(lm, out).detach() + 0.3 * torch.randn(mask.shape, generator=gen)  # [B, L]
    out["old_per_token_logps"] = old
    trl_loss = tr._compute_loss(tr.model, out)
    logp = _ours_logp(lm, out)
    weight = out["importance_sampling_ratio"].expand_as(old) if mode else None
    ours = grpo_loss(logp, old, out["advantages"], mask, eps_low=0.2, eps_high=0.2, loss_type=loss_type, level=level,
                     max_len=8, is_weight=weight)
    # Both losses average K per-token terms of size <= max |r A w| (the aggregation weights sum to <= 1): fp32
    # summation, 2 eps * max|term| * sqrt(K). And TRL scores the batch with its own forward: a log-prob that differs
    # by δ moves its term by |term| * δ (r = exp(logp - old)), so the δ measured between the two forwards enters
    # too (0 here: they agree bit for bit; a few fp32 ulps of the logits on other kernels).
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    with torch.no_grad():
        attn = torch.cat([out["prompt_mask"], mask], 1)
        trl_logp = tr._get_per_token_logps_and_entropies(tr.model, ids, attn, mask.shape[1])[0]
    m = mask.bool()
    delta = (logp.detach() - trl_logp)[m].abs().max()
    ratio = torch.exp(logp.detach() - old)
    term = (ratio * out["advantages"].abs()[:, None] * (1 if weight is None else weight))[m].abs().max()
    K = int(m.sum())
    bound = term * (delta + 2 * eps(torch.float32) * K**0.5)
    assert abs(ours.loss.item() - trl_loss.item()) <= bound, (ours.loss.item(), trl_loss.item(), f"bound {bound:.3e}")
    assert (ours.clipped_low | ours.clipped_high).any()  # the comparison covers clipped tokens
