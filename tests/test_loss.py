import math

import pytest
import torch

from conftest import assert_close_eps
from phantomclip.maths.loss import (
    AGGREGATIONS,
    CORRECTIONS,
    CorrectionParams,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    log_importance_weights,
    rollout_correction,
)


def test_group_advantages_hand_worked():
    # group [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; group [5, 5, 5]: all 0
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3, eps=0.0)
    assert adv.tolist() == pytest.approx([-1, 0, 1, 0, 0, 0])
    assert group_advantages(torch.tensor([1.0, 3.0]), 2, scale_rewards=False).tolist() == pytest.approx([-1.0, 1.0])
    with pytest.raises(ValueError):
        group_advantages(torch.ones(5), 2)


def test_sequence_level_weight_is_masked_geometric_mean():
    lr = torch.tensor([[0.1, 0.3, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert log_importance_weights(lr, mask, "sequence")[0].tolist() == pytest.approx([0.2])


def test_clipped_surrogate_values_and_masks():
    # r = e^l; A = +1 row 0, -1 row 1. ε = 0.2.
    log_w = torch.log(torch.tensor([[1.1, 1.3, 0.7], [1.1, 1.3, 0.7]]))
    out = clipped_surrogate(log_w, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    # A>0: -min(r, clip r) = -[1.1, 1.2, 0.7];  A<0: -min(-r, -clip r) = max(r, clip r) = [1.1, 1.3, 0.8]
    assert out.per_token_loss.tolist() == [pytest.approx([-1.1, -1.2, -0.7]), pytest.approx([1.1, 1.3, 0.8])]
    assert out.clipped_high.tolist() == [[False, True, False], [False, False, False]]
    assert out.clipped_low.tolist() == [[False, False, False], [False, False, True]]


def _grad(loss_fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss_fn(logp).loss.backward()
    return logp.grad


def test_aggregations_hand_worked():
    # r = 1 everywhere (logp = logp_old): per-token loss = -A. A = [1, -2]; masks of length 2 and 1.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    vals = {t: grpo_loss(logp, logp, adv, mask, loss_type=t, max_len=4).loss.item() for t in AGGREGATIONS}
    assert vals["grpo"] == pytest.approx((-1 + 2) / 2)  # per-sequence means -1 and +2
    assert vals["dapo"] == pytest.approx((-1 - 1 + 2) / 3)
    assert vals["dr_grpo"] == pytest.approx((-1 - 1 + 2) / (2 * 4))


def test_no_clip_gradient_is_the_unclipped_policy_gradient():
    g = torch.Generator().manual_seed(0)
    logp_old = torch.randn(3, 4, generator=g)
    logp = logp_old + 0.5 * torch.randn(3, 4, generator=g)  # far outside the trust region
    adv, mask = torch.tensor([1.0, -1.0, 0.5]), torch.ones(3, 4)
    grad = _grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, eps_low=math.inf, eps_high=math.inf), logp)
    # d/dlogp of -mean(r A) = -r A / N
    expected = -torch.exp(logp - logp_old) * adv[:, None] / 12
    # the same three fp32 operations (exp, times A, over N) in another order on each side, half an ulp each
    assert_close_eps(grad, expected, torch.float32, expected.abs(), terms=3, name="grad")


def test_force_r1_detach_trick_is_reinforce():
    # logp_old = logp.detach(): r == 1 in value, gradient of r is d logp -> REINFORCE: -A d logp / N
    logp0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    adv, mask = torch.tensor([2.0, -1.0]), torch.ones(2, 3)
    lp = logp0.clone().requires_grad_(True)
    out = grpo_loss(lp, lp.detach(), adv, mask)
    out.loss.backward()
    assert not out.clipped_low.any() and not out.clipped_high.any()
    expected = -adv[:, None].expand(2, 3) / 6
    assert_close_eps(lp.grad, expected, torch.float32, expected.abs(), terms=2, name="grad")  # r = 1, A times 1/N


def test_shadow_ratio_clips_on_alpha_but_keeps_trainer_gradient():
    # Token 0: log r = 0.5 (beyond 1.2) but α = 0 -> not clipped with the shadow ratio; gradient = -A r / N.
    # Token 1: log r = 0 but α = 0.5 -> clipped with the shadow ratio (A > 0): zero gradient.
    logp_old = torch.zeros(1, 2)
    logp = torch.tensor([[0.5, 0.0]])
    alpha = torch.tensor([[0.0, 0.5]])
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    plain = grpo_loss(logp, logp_old, adv, mask)
    assert plain.clipped_high.tolist() == [[True, False]]
    shadow = grpo_loss(logp, logp_old, adv, mask, clip_log_ratio=alpha)
    assert shadow.clipped_high.tolist() == [[False, True]]
    grad = _grad(lambda lp: grpo_loss(lp, logp_old, adv, mask, clip_log_ratio=alpha), logp)
    assert grad[0].tolist() == pytest.approx([-math.exp(0.5) / 2, 0.0])
    # and with α = log r the shadow path equals the plain loss exactly
    same = grpo_loss(logp, logp_old, adv, mask, clip_log_ratio=logp - logp_old)
    assert same.loss.item() == plain.loss.item()  # the same tensors through the same operations


def test_rollout_corrections_hand_worked():
    # token log ratios old - engine: seq 0 = [log 2, log 4] (Π = 8), seq 1 = [log 0.25, 0] (Π = 0.25)
    logp_engine = torch.zeros(2, 2)
    logp_old = torch.log(torch.tensor([[2.0, 4.0], [0.25, 1.0]]))
    mask = torch.ones(2, 2)
    p = CorrectionParams(cap=3.0, icepop_low=0.5, icepop_high=3.0)
    w = {mode: rollout_correction(logp_old, logp_engine, mask, mode, p) for mode in CORRECTIONS}
    assert w["token_truncate"][0].tolist() == [pytest.approx([2, 3]), pytest.approx([0.25, 1])]
    assert w["token_mask"][0].tolist() == [pytest.approx([2, 0]), pytest.approx([0.25, 1])]
    assert w["token_mask"][1].tolist() == [[False, True], [False, False]]
    assert w["sequence_truncate"][0].tolist() == [pytest.approx([3, 3]), pytest.approx([0.25, 0.25])]
    assert w["sequence_mask"][0].tolist() == [pytest.approx([0, 0]), pytest.approx([0.25, 0.25])]
    assert w["sequence_mask"][1].tolist() == [[True, True], [False, False]]
    assert w["icepop"][1].tolist() == [[False, True], [True, False]]
    assert w["none"][0].tolist() == [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match="token_truncate"):
        rollout_correction(logp_old, logp_engine, mask, "bogus")


def test_one_sided_infinite_epsilon_keeps_the_other_clip():
    log_w = torch.log(torch.tensor([[0.5, 3.0]]))
    low = clipped_surrogate(log_w, torch.tensor([-1.0]), 0.2, math.inf)
    assert low.clipped_low.tolist() == [[True, False]]
    assert low.per_token_loss.tolist()[0] == pytest.approx([0.8, 3.0])  # max(r, clip r) with clip range [0.8, inf)


def test_nan_at_padding_does_not_leak():
    logp = torch.tensor([[0.0, float("nan")]])
    mask = torch.tensor([[1, 0]])
    for t in AGGREGATIONS:
        out = grpo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), mask, loss_type=t, level="sequence")
        assert torch.isfinite(out.loss), t
