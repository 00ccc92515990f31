"""The async fix's three ratios (integrations.trl_async_ratio) on a real packed batch of TRL's AsyncGRPOTrainer
trained one version late: TRL's unchanged loss and the gradient reaching each packed position of the trainer's
log-probs equal a hand computation from independently built copies, and a version without a kept copy falls back to
the server's log-probs, as the module says."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_close_eps

pytest.importorskip("trl")

import trl_async_setup as setup  # noqa: E402
from phantomclip.integrations.trl_async.monitor import with_async_shadow_ratio  # noqa: E402
from phantomclip.integrations.trl_async.ratio import DECOUPLED_WEIGHT_CAP  # noqa: E402

EPS = 0.05
"""a trust region narrow enough that some clips fire on the tiny model's move."""


class _Recording(torch.nn.Module):
    """The model as TRL calls it, keeping the log-probs its gradient forward returned (their gradient after
    backward; a no-grad call, π_prox's, is passed through)."""

    def __init__(self, inner, captured: dict):
        super().__init__()
        self.inner, self.captured = inner, captured

    def forward(self, **kw):
        out = self.inner(**kw)
        if out.log_probs.requires_grad:
            out.log_probs.retain_grad()
            self.captured["lp"] = out.log_probs
        return out


def _trl_loss(tmp_path, ratio: str, before=None):
    """(trainer, batch, loss, d loss / d log_probs [N], the log-probs' values [N]) for one stale micro-batch."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    trainer, _ = setup.make_trainer(str(tmp_path / ratio), cls=with_async_shadow_ratio(AsyncGRPOTrainer, ratio=ratio),
                                    epsilon=EPS, reward=setup.spread)
    v1 = copy.deepcopy(trainer.model).eval()  # the weights the first sync sends as version 1, in fp32
    batch = setup.batch_with_staleness(trainer)
    if before is not None:
        before(trainer)
    captured = {}
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(_Recording(trainer.model, captured), batch)
    loss.backward()
    return trainer, batch, loss, captured, v1


def _check(batch, loss, captured, r, weight, clipped: bool):
    """TRL's loss against Σ −w·min(r A, clip(r) A) / n, and the gradient per position against Σ −w A r / n over its
    terms where the clip does not fire (where it does: 0)."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    _, token_index, selected = packed_forward(batch)
    A = batch["advantages"][selected] * weight  # [M] the advantage TRL is handed
    n = batch["global_n_tokens"][0].item()  # one process: tokens per rank = all of them
    per_token = -torch.min(r * A, torch.clamp(r, 1 - EPS, 1 + EPS) * A)  # [M]
    assert ((per_token != -(r * A)).any()) == clipped  # a clip fires (or, decoupled: cannot)
    # one fp32 sum of M terms of size |r A| in TRL's order and in this one
    assert_close_eps(loss.item(), per_token.sum().item() / n, torch.float32, (r * A).abs().max() / n,
                     terms=token_index.numel(), name="loss")
    fires = ((A > 0) & (r > 1 + EPS)) | ((A < 0) & (r < 1 - EPS))  # TRL's clip on the ratio it is handed
    grad_terms = torch.where(fires, 0.0, -A * r / n)  # [M]
    want = torch.zeros(captured["lp"].numel()).index_add_(0, token_index, grad_terms)  # [N]
    # autograd through exp and the min/clamp: each term one or two roundings of |A r| / n, summed per position
    assert_close_eps(captured["lp"].grad.flatten(), want, torch.float32, (A * r).abs().max() / n, terms=4,
                     name="per-position gradient")


def test_shadow_ratio_equals_a_hand_computation(tmp_path):
    """ratio "shadow": r = exp(α), α = shadow(θ_t) − shadow(θ_v) from the engine-dtype copies on the same row."""
    from phantomclip.integrations.trl_async.forward import packed_forward, score_labelled

    trainer, batch, loss, captured, _ = _trl_loss(tmp_path, "shadow")
    kwargs, token_index, selected = packed_forward(batch)
    shadows = trainer._pc_async.stores["engine"]
    assert batch["pc_sample_version"][0][batch["segment_id"][selected]].unique().tolist() == [1]
    now = score_labelled(shadows.versions[2], kwargs).flatten()[token_index]  # [M]
    old = score_labelled(shadows.versions[1], kwargs).flatten()[token_index]  # [M]
    assert (now != old).any()
    _check(batch, loss, captured, torch.exp(now - old), 1.0, clipped=True)


def test_trainer_ratio_equals_a_hand_computation(tmp_path):
    """ratio "trainer": r = exp(logp(θ_t) − logp(θ_v)) in the trainer's fp32, the old side from a copy of the model
    taken before training (version 1's weights) through TRL's own fused forward: independent of the hooks' copies."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    trainer, batch, loss, captured, v1 = _trl_loss(tmp_path, "trainer")
    kwargs, token_index, _ = packed_forward(batch)
    with torch.no_grad():
        old = v1(**kwargs, fused_lm_head=True).log_probs.flatten()[token_index]  # [M]
    now = captured["lp"].detach().flatten()[token_index]  # [M] the loss's own forward at θ_t
    assert trainer._pc_async.stores["trainer"].dtype == "fp32" and (now != old).any()
    _check(batch, loss, captured, torch.exp(now - old), 1.0, clipped=True)


def test_decoupled_ratio_equals_a_hand_computation(tmp_path):
    """ratio "decoupled": r = π_θ / π_prox ≡ 1 (π_prox the live model's forward at θ_t), never clipped, and the
    advantage weighted by min(π_prox / μ, 2): loss Σ −w A / n, gradient −w A / n on every term."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    _, batch, loss, captured, _ = _trl_loss(tmp_path, "decoupled")
    _, token_index, selected = packed_forward(batch)
    now = captured["lp"].detach().flatten()[token_index]  # [M]
    weight = torch.exp(now - batch["old_log_probs"][selected]).clamp(max=DECOUPLED_WEIGHT_CAP)  # [M]
    raw = torch.exp(now - batch["old_log_probs"][selected])  # [M]
    assert (raw > DECOUPLED_WEIGHT_CAP).any() and (raw < 1).any()  # the cap truncates some, others weigh less
    _check(batch, loss, captured, torch.ones_like(now), weight, clipped=False)


def test_a_version_without_its_copy_is_clipped_against_the_server(tmp_path):
    """The stated fallback: with version 1's copy gone (as for a monitor attached after training started), ratio
    "shadow" clips those tokens on exp(shadow(θ_t) − μ(θ_v)), named once in a warning; the step trains."""
    from phantomclip.integrations.trl_async.forward import packed_forward, score_labelled

    def forget_version_1(trainer):
        trainer._pc_async.stores["engine"].versions.pop(1)

    with pytest.warns(UserWarning, match=r"tokens of weight version 1 \(trained at 2\) have no bfloat16 copy"):
        trainer, batch, loss, captured, _ = _trl_loss(tmp_path, "shadow", before=forget_version_1)
    kwargs, token_index, selected = packed_forward(batch)
    now = score_labelled(trainer._pc_async.stores["engine"].versions[2], kwargs).flatten()[token_index]  # [M]
    _check(batch, loss, captured, torch.exp(now - batch["old_log_probs"][selected]), 1.0, clipped=True)
