"""The async fix's three ratios (integrations.trl_async.ratio) on a real packed batch of TRL's AsyncGRPOTrainer
trained one version late: TRL's unchanged loss and the gradient reaching each packed position of the trainer's
log-probs equal a hand computation from independently built copies (the importance weight at and under its cap, per
token and per sequence, from TRL's fields), and a version without a kept copy falls back to the server's log-probs,
as the module says."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import assert_close_eps

pytest.importorskip("trl")

import trl_async_setup as setup  # noqa: E402
from phantomclip.integrations.trl_async.monitor import with_async_shadow_ratio  # noqa: E402
from phantomclip.integrations.trl_async.ratio import WEIGHT_CAP  # noqa: E402

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


def _trl_loss(tmp_path, ratio: str, before=None, **weight):
    """(trainer, batch, loss, d loss / d log_probs [N], the log-probs' values [N]) for one stale micro-batch."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    cls = with_async_shadow_ratio(AsyncGRPOTrainer, ratio=ratio, **weight)
    trainer, _ = setup.make_trainer(str(tmp_path / ratio), cls=cls, epsilon=EPS, reward=setup.spread)
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


def _trust_region_by_hand(tmp_path, ratio="trust-region", **weight):
    """(batch, loss, captured, r, log π_trainer(θ_v) − log μ [M], segment [M]): the old side from a copy of the
    model taken before training (version 1's weights) through TRL's own fused forward, independent of the hooks'
    kept versions and of their swap."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    trainer, batch, loss, captured, v1 = _trl_loss(tmp_path, ratio, **weight)
    kwargs, token_index, selected = packed_forward(batch)
    with torch.no_grad():
        old = v1(**kwargs, fused_lm_head=True).log_probs.flatten()[token_index]  # [M]
    now = captured["lp"].detach().flatten()[token_index]  # [M] the loss's own forward at θ_t
    assert trainer._pc_async.fix == "trust-region" and (now != old).any()
    return batch, loss, captured, torch.exp(now - old), old - batch["old_log_probs"][selected], batch[
        "segment_id"][selected]


def test_trust_region_ratio_equals_a_hand_computation(tmp_path):
    """ratio "trust-region" (the default): r = exp(logp(θ_t) − logp(θ_v)) in the trainer's fp32, clipped, and the
    advantage times w = min(π_trainer(θ_v) / μ, 2) per token. Here every w is under the cap (largest β 0.37),
    and above and below 1: w = exp(β) on every token (the cap itself: test_the_weight_at_its_cap)."""
    batch, loss, captured, r, beta, _ = _trust_region_by_hand(tmp_path)
    assert torch.exp(beta).max() < WEIGHT_CAP and (beta > 0).any() and (beta < 0).any()
    _check(batch, loss, captured, r, torch.exp(beta).clamp(max=WEIGHT_CAP), clipped=True)


def test_trainer_is_the_earlier_name_of_trust_region(tmp_path):
    batch, loss, captured, r, beta, _ = _trust_region_by_hand(tmp_path, ratio="trainer")
    _check(batch, loss, captured, r, torch.exp(beta), clipped=True)


def test_the_weight_at_its_cap(tmp_path):
    """vllm_importance_sampling_clip_max=1.0 (TRL's name): tokens whose π_trainer(θ_v) / μ exceeds 1 weigh exactly
    1 (truncated at the cap), the others exp(β) < 1."""
    batch, loss, captured, r, beta, _ = _trust_region_by_hand(tmp_path, vllm_importance_sampling_clip_max=1.0)
    assert (beta > 0).any() and (beta < 0).any()
    _check(batch, loss, captured, r, torch.exp(beta).clamp(max=1.0), clipped=True)


def test_sequence_mask_from_trls_field(tmp_path):
    """vllm_importance_sampling_mode="sequence_mask" at cap 1.0 (TRL's meaning, grpo_trainer.py): one weight per
    sequence, exp(Σ its tokens' β), set to 0 where it exceeds the cap."""
    batch, loss, captured, r, beta, segment = _trust_region_by_hand(
        tmp_path, vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.0)
    per_seq = {int(s): float(beta[segment == s].double().sum()) for s in segment.unique()}
    weight = torch.tensor([0.0 if per_seq[int(s)] > 0 else torch.tensor(per_seq[int(s)]).exp().item()
                           for s in segment])  # [M]
    assert (weight == 0).any() and (weight > 0).any()
    _check(batch, loss, captured, r, weight, clipped=True)


def test_trls_fields_on_the_config_are_followed():
    """A config carrying TRL's importance-sampling fields (GRPOConfig's names; AsyncGRPOConfig in trl 1.16 has
    none) sets the weight; the deprecated `vllm_importance_sampling_cap` is its clip_max; the same field set to
    another value in with_async_shadow_ratio is refused in one line; correction off means weight 1."""
    from types import SimpleNamespace

    from phantomclip.base.errors import IntegrationError
    from phantomclip.integrations.trl_async.ratio import ImportanceWeight, importance_weight

    assert importance_weight(SimpleNamespace()) == ImportanceWeight("token_truncate", 2.0, None, True)
    args = SimpleNamespace(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=3.0,
                           vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_correction=True)
    assert importance_weight(args) == ImportanceWeight("token_mask", 3.0, 0.5, True)
    assert importance_weight(SimpleNamespace(vllm_importance_sampling_cap=4.0)).cap == 4.0
    with pytest.raises(IntegrationError, match=r"differs from the trainer config's vllm_importance_sampling_clip_max"):
        importance_weight(args, cap=2.0)
    with pytest.raises(IntegrationError, match=r"must be one of token_truncate"):
        importance_weight(SimpleNamespace(), mode="token")
    w = ImportanceWeight("token_mask", 3.0, 0.5)
    weight, capped = w.apply(torch.log(torch.tensor([0.25, 1.0, 2.0, 4.0])), torch.zeros(4, dtype=torch.long))
    assert weight.tolist() == [0.0, 1.0, 2.0, 0.0] and capped.tolist() == [True, False, False, True]
    off = importance_weight(SimpleNamespace(vllm_importance_sampling_correction=False))
    assert off.apply(torch.tensor([3.0]), torch.zeros(1, dtype=torch.long))[0].tolist() == [1.0]


def test_decoupled_ratio_equals_a_hand_computation(tmp_path):
    """ratio "decoupled": r = π_θ / π_prox ≡ 1 (π_prox the live model's forward at θ_t), never clipped, and the
    advantage weighted by min(π_prox / μ, 2): loss Σ −w A / n, gradient −w A / n on every term."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    _, batch, loss, captured, _ = _trl_loss(tmp_path, "decoupled")
    _, token_index, selected = packed_forward(batch)
    now = captured["lp"].detach().flatten()[token_index]  # [M]
    weight = torch.exp(now - batch["old_log_probs"][selected]).clamp(max=WEIGHT_CAP)  # [M]
    raw = torch.exp(now - batch["old_log_probs"][selected])  # [M]
    assert (raw > WEIGHT_CAP).any() and (raw < 1).any()  # the cap truncates some, others weigh less
    _check(batch, loss, captured, torch.ones_like(now), weight, clipped=False)


def test_fewer_versions_kept_clip_on_the_move_since_the_oldest_kept(tmp_path):
    """versions_kept=1 (the cheapest form): only the newest version's weights are kept, so a token of version 1
    trained at version 2 is clipped against version 2, the live weights: r ≡ 1, no clip, and its weight is
    min(π_trainer(θ_t) / μ, 2), the move since version 1 joining β, the same loss as "decoupled" by hand; the
    tokens are counted as clipped against a substitute (not against the server), and the clip rate counts them:
    0, since r ≡ 1 (NaN would say no token was clipped against a kept version)."""
    from phantomclip.integrations.trl_async.forward import packed_forward

    trainer, batch, loss, captured, _ = _trl_loss(tmp_path, "trust-region", versions_kept=1)
    _, token_index, selected = packed_forward(batch)
    now = captured["lp"].detach().flatten()[token_index]  # [M]
    weight = torch.exp(now - batch["old_log_probs"][selected]).clamp(max=WEIGHT_CAP)  # [M]
    _check(batch, loss, captured, torch.ones_like(now), weight, clipped=False)
    assert sorted(trainer._pc_async.stores["trainer"].versions) == [2]
    figures = trainer._pc_async.offpolicy
    assert figures["substitute_total"] == token_index.numel() and figures["no_copy_total"] == 0
    assert figures["clip_rate"] == 0.0
    alpha = [v for k, v in figures.items() if k.startswith("alpha_abs_mean_s")]
    assert alpha and all(math.isnan(v) for v in alpha)  # no token was clipped against its own version


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


def test_a_swapped_forward_leaves_no_cast_behind():
    """Inside an autocast region torch caches the bf16 cast of each fp32 leaf that requires grad, whatever the grad
    mode: a version swapped in must neither reuse the current weights' cast nor leave its own for the loss's
    forward. An fp32 Linear under CPU bf16 autocast: version 1 swapped in between two forwards at the current
    weights scores as a separate copy of version 1 does, and the forward after it as the one before, bit for bit."""
    from types import SimpleNamespace

    from phantomclip.integrations.trl_async.versions import TrainerVersions

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    v1 = copy.deepcopy(model)
    args = SimpleNamespace(max_staleness=1, token_budget=0, gradient_accumulation_steps=1, weight_sync_steps=1)
    versions = TrainerVersions(SimpleNamespace(model=model, args=args, state=SimpleNamespace(global_step=0)))
    versions.snapshot(1)
    with torch.no_grad():
        model.weight.add_(1.0)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        now = model(x).float()  # caches the cast of the current weight
        old = versions.score(model, {"x": x}, 1, lambda m, kw: m(kw["x"]).float())
        again = model(x).float()
        want = v1(x).float()
    assert torch.equal(old, want) and torch.equal(again, now) and not torch.equal(old, now)
