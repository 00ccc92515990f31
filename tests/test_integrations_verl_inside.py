"""phantomclip inside verl 0.9.1 (integrations/verl.py): the registered losses through verl's own dispatch, the driver's
figures through verl's own rollout correction, the counts over two processes.

Needs verl, which the default suite's venv does not have: these tests skip there, and docs/verl.md gives the venv
and the command that runs them (`.venv-verl`). The pure figures (`clip_counts`, `driver_figures`) and the two-process
test need only torch and run everywhere.

Tolerances: counts are integers and compared exactly; a figure computed in float64 on both sides from the same fp32
inputs differs only by summation order, |Δ| ≤ N·2^-53 relative (N ≤ 100 tokens here: 1e-12); a verl figure is a
fp32 mean (`verl_F.masked_mean`: fp32 sum of N terms over count + 1e-8), relative error ≤ N·2^-24 + 1e-8/N, below
1e-5 for the N ≤ 100 tokens used here.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phantomclip.base.errors import IntegrationError
from phantomclip.integrations.verl import clip_counts, driver_figures  # with verl: registers and hooks, as a plugin
from phantomclip.maths.metrics import mismatch_stats, phantom_clip_mask

HAS_VERL = importlib.util.find_spec("verl") is not None
if os.environ.get("PHANTOMCLIP_REQUIRE_VERL") == "1" and not HAS_VERL:  # CI's verl stage: a skip would hide it
    raise RuntimeError("PHANTOMCLIP_REQUIRE_VERL=1 but verl is not importable: run scripts/install_verl_cpu.sh")
needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl is not installed in this venv: run this file in the verl "
                                "venv (docs/verl.md, 'Tests'): pip install 'phantomclip[verl]'")
FP32_MEAN = 1e-5
F64_SUM = 1e-12
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _batch(seed: int = 0, B: int = 8, T: int = 9, beta_scale: float = 0.2):
    """(old, rollout, mask, advantages [B, T]) with no ratio within 1e-3 of a decision boundary, so fp32 ratio-space
    and float64 log-space decisions agree (the fp32 rounding of a log-prob near 3 is 2.4e-7)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 4  # [B, T] trainer log-probs
    beta = beta_scale * torch.randn(B, T, generator=g)  # [B, T]
    bounds = torch.tensor([math.log1p(-EPS_LOW), math.log1p(EPS_HIGH), math.log(2.0), math.log(0.5)])
    near = (beta[..., None] - bounds).abs().min(-1).values < 1e-3
    beta = torch.where(near, beta + 3e-3, beta)
    rollout = old - beta  # [B, T] engine log-probs: old − rollout = β
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()  # [B, T]
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()  # [B, T] one advantage per sequence
    return old, rollout, mask, adv


def test_clip_counts_hand_worked():
    # ℓ = [0.3, −0.3, 0.1, 1.2], A = [1, −1, 1, −1], ε = 0.2 / 0.28, c = 3:
    # r0 = e^0.3 = 1.350 > 1.28, A > 0: clipped high; r1 = e^−0.3 = 0.741 < 0.8, A < 0: clipped low;
    # r2 = 1.105: inside; r3 = e^1.2 = 3.320, A < 0: max(3.320, 1.28) = 3.320 > −A·c = 3: dual-clipped.
    old = torch.zeros(1, 4)
    new = torch.tensor([[0.3, -0.3, 0.1, 1.2]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = clip_counts(old, new, adv, torch.ones(1, 4), EPS_LOW, EPS_HIGH, 3.0)
    assert (out["tokens"], out["clip_high_tokens"], out["clip_low_tokens"], out["dual_clip_tokens"]) == (4, 1, 1, 1)
    assert out["clip_rate"] == 0.5
    assert out["log_ratio_abs_mean"] == pytest.approx((0.3 + 0.3 + 0.1 + 1.2) / 4, rel=1e-7)  # fp32 inputs


def test_bad_settings_are_one_line(monkeypatch):
    import phantomclip.integrations.verl as pv

    for name, value in ((pv.EPS_ENV[0], "wide"), (pv.EPS_ENV[1], "-0.2"), (pv.RECOMPUTE_ENV, "every")):
        monkeypatch.setenv(name, value)
        with pytest.raises(IntegrationError, match=name) as e:
            pv.driver_eps() if name in pv.EPS_ENV else pv.recompute_every()
        assert "\n" not in str(e.value)
        monkeypatch.delenv(name)
    assert pv.driver_eps() == (0.2, 0.2) and pv.recompute_every() == 0  # verl's default clip_ratio; off
    monkeypatch.setattr(pv, "version", lambda name: "0.8.0")
    with pytest.raises(IntegrationError, match="install verl==0.9.1"):
        pv.check_verl_version()


def test_driver_figures_against_mismatch_stats():
    old, rollout, mask, _ = _batch(1)
    ours = driver_figures(old, rollout, mask, mask, None, {}, EPS_LOW, EPS_HIGH)
    ref = mismatch_stats(old, rollout, mask, EPS_LOW, EPS_HIGH)  # the project's own β statistics, another code path
    for key in ("beta_mean", "beta_abs_mean", "beta_abs_p99", "beta_abs_max", "outside_trust_region"):
        mine = ours["phantomclip/beta_outside_trust_region" if key == "outside_trust_region" else f"phantomclip/{key}"]
        assert mine == pytest.approx(ref[key], rel=F64_SUM, abs=1e-15), key
    assert ours["phantomclip/beta_tokens"] == ref["tokens"] == int(mask.sum())
    assert "phantomclip/is_token_share" not in ours  # no IS setting: nothing to say about weights


def test_counts_over_two_processes(tmp_path):
    """Each of two gloo ranks holds half the batch; the reduced counts equal one process on the whole batch."""
    old, rollout, mask, adv = _batch(2, B=10)
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))  # [B, T] α + β
    torch.save({"old": old, "new": new, "mask": mask, "adv": adv}, tmp_path / "batch.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    worker = Path(__file__).parent / "verl_ranks_worker.py"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    "29561", str(worker), str(tmp_path)], check=True, env=env, timeout=300, capture_output=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    whole = clip_counts(old, new, adv, mask, EPS_LOW, EPS_HIGH)
    for rank in got:
        for key in ("tokens", "clip_high_tokens", "clip_low_tokens", "dual_clip_tokens", "clip_rate"):
            assert rank[key] == whole[key], key
        assert rank["log_ratio_abs_mean"] == pytest.approx(whole["log_ratio_abs_mean"], rel=F64_SUM)
    halves = [clip_counts(old[s], new[s], adv[s], mask[s], EPS_LOW, EPS_HIGH) for s in (slice(0, 5), slice(5, 10))]
    assert whole["clip_high_tokens"] > 0 and whole["clip_low_tokens"] > 0  # the batch exercises both sides
    assert halves[0]["clip_rate"] != whole["clip_rate"]  # a rank's own rate is not the global one


# ------------------------------------------------------------------------------------------------ with verl


def _actor_config(**policy_loss):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                           clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, policy_loss=policy_loss or None)


def _both(name_a: str, name_b: str, config, old, new, adv, mask, weights=None):
    """verl's loss `name_a` and ours `name_b`, each on a leaf copy of the same log-probs: (loss, grad, metrics)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    out = []
    for name in (name_a, name_b):
        lp = new.clone().requires_grad_(True)  # [B, T]
        loss, metrics = get_policy_loss_fn(name)(old_log_prob=old, log_prob=lp, advantages=adv,
                                                 response_mask=mask.bool(), loss_agg_mode="token-mean",
                                                 config=config, rollout_is_weights=weights)
        loss.backward()
        out.append((loss.detach(), lp.grad, metrics))
    return out


@needs_verl
def test_registered_loss_is_verls_vanilla_bit_for_bit():
    old, rollout, mask, adv = _batch(4)
    new = old + 0.25 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))  # [B, T] α
    weights = torch.exp((old - rollout).clamp(max=math.log(2.0))) * mask  # [B, T] token TIS weights
    (l_v, g_v, m_v), (l_p, g_p, m_p) = _both("vanilla", "phantomclip_vanilla", _actor_config(), old, new, adv, mask,
                                             weights)
    assert torch.equal(l_v, l_p) and torch.equal(g_v, g_p)  # the loss and its gradient, bit for bit
    assert {k: v for k, v in m_p.items() if not k.startswith("phantomclip/")} == m_v  # verl's metrics untouched
    n = int(mask.sum())
    assert m_p["phantomclip/actor/tokens"] == n
    assert m_p["phantomclip/actor/clip_rate"] == pytest.approx(m_v["actor/pg_clipfrac"], rel=FP32_MEAN)
    assert m_p["phantomclip/actor/dual_clip_tokens"] / n == pytest.approx(m_v["actor/pg_clipfrac_lower"],
                                                                         rel=FP32_MEAN, abs=1e-9)
    lr = (new - old).double()[mask.bool()]  # [N]: |ℓ| by hand, float64
    assert m_p["phantomclip/actor/log_ratio_abs_mean"] == pytest.approx(lr.abs().mean().item(), rel=1e-6)  # fp32 ℓ
    hand = phantom_clip_mask(lr, adv[mask.bool()], EPS_LOW, EPS_HIGH)  # the clip's zero-gradient tokens, log space
    clipped = m_p["phantomclip/actor/clip_high_tokens"] + m_p["phantomclip/actor/clip_low_tokens"]
    assert clipped == int(hand.sum()) > 0
    assert clipped == round(m_v["actor/pg_clipfrac"] * n)  # verl's own count: the same tokens, not just the rate


@needs_verl
def test_bypass_mode_clips_alpha_plus_beta():
    """Bypass mode: verl's apply_bypass_mode puts the engine's log-probs in old_log_probs; on the first mini-batch
    (θ = θ_old, α = 0) the trainer's log-probs are `old`, so every clip the loss makes is on β alone: phantom."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    old, rollout, mask, adv = _batch(6, beta_scale=0.3)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": mask, "old_log_probs": old})
    corr = RolloutCorrectionConfig(bypass_mode=True)
    apply_bypass_mode(batch=batch, rollout_corr_config=corr, policy_loss_config=OmegaConf.create({}))
    engine_as_old = batch.batch["old_log_probs"]
    assert torch.equal(engine_as_old, rollout)
    config = _actor_config(loss_mode="bypass_mode", rollout_correction=corr)
    (l_v, g_v, m_v), (l_p, g_p, m_p) = _both("bypass_mode", "phantomclip_bypass_mode", config, engine_as_old, old,
                                             adv, mask)
    assert torch.equal(l_v, l_p) and torch.equal(g_v, g_p)
    ok = mask.bool()
    phantom = phantom_clip_mask((old - rollout).double()[ok], adv[ok], EPS_LOW, EPS_HIGH)  # β's clips, by hand
    clipped = m_p["phantomclip/actor/clip_high_tokens"] + m_p["phantomclip/actor/clip_low_tokens"]
    assert clipped == int(phantom.sum()) > 0
    assert m_p["phantomclip/actor/clip_rate"] == pytest.approx(m_v["actor/pg_clipfrac"], rel=FP32_MEAN)


@needs_verl
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_driver_hook_through_verls_rollout_correction(level):
    """A real DataProto through verl's compute_rollout_correction_and_add_to_batch, reached as ray_trainer reaches
    it (the module attribute): verl's metrics unchanged, ours beside them, against verl's own and a hand count."""
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper as helper

    old, rollout, mask, _ = _batch(7, beta_scale=0.35)
    tensors = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}
    corr = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=2.0, rollout_rs="token_k1",
                                   rollout_rs_threshold="0.5_2.0")
    hooked = helper.compute_rollout_correction_and_add_to_batch
    assert hooked._phantomclip
    b_ours, m_ours = hooked(DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()}), corr)
    b_verl, m_verl = hooked.__wrapped__(DataProto.from_dict(tensors={k: v.clone() for k, v in tensors.items()}), corr)
    assert {k: v for k, v in m_ours.items() if not k.startswith("phantomclip/")} == m_verl
    for key in ("response_mask", "rollout_is_weights"):
        assert torch.equal(b_ours.batch[key], b_verl.batch[key])
    ok = mask.bool()
    beta = (old - rollout).double()  # [B, T]
    ref = mismatch_stats(old, rollout, mask, 0.2, 0.2)  # the driver's default ε (PHANTOMCLIP_VERL_CLIP_* unset)
    assert m_ours["phantomclip/beta_abs_mean"] == pytest.approx(ref["beta_abs_mean"], rel=F64_SUM)
    assert m_ours["phantomclip/beta_outside_trust_region"] == pytest.approx(ref["outside_trust_region"], rel=F64_SUM)
    # rejection sampling (token_k1, band [0.5, 2]): verl's own masked fractions are the second computation
    assert m_ours["phantomclip/rs_token_share"] == pytest.approx(m_verl["rollout_corr/rollout_rs_masked_fraction"],
                                                                 rel=FP32_MEAN)
    assert m_ours["phantomclip/rs_seq_share"] == pytest.approx(
        m_verl["rollout_corr/rollout_rs_seq_masked_fraction"], rel=FP32_MEAN)
    assert 0 < m_ours["phantomclip/rs_token_share"] < 1
    # IS truncation (TIS at 2): a token (a sequence) is touched when its raw weight exceeds 2, by hand in float64
    if level == "token":
        touched = (beta > math.log(2.0)) & ok  # [B, T]
        assert m_ours["phantomclip/is_token_share"] == pytest.approx(
            m_verl["rollout_corr/rollout_is_ratio_fraction_high"], rel=FP32_MEAN)
    else:
        touched = (torch.where(ok, beta, 0).sum(-1, keepdim=True) > math.log(2.0)).expand_as(ok) & ok
        seqs = ok.any(-1)
        assert m_ours["phantomclip/is_seq_share"] == pytest.approx(
            m_verl["rollout_corr/rollout_is_ratio_fraction_high"] * len(seqs) / int(seqs.sum()), rel=FP32_MEAN)
    assert m_ours["phantomclip/is_token_share"] == touched.sum().item() / ok.sum().item()
    assert m_ours["phantomclip/is_seq_share"] == touched.any(-1)[ok.any(-1)].double().mean().item()
    # ESS of the applied weights over the kept tokens, by hand
    w = b_verl.batch["rollout_is_weights"].double()[b_verl.batch["response_mask"].bool()]
    assert m_ours["phantomclip/is_ess"] == pytest.approx((w.sum() ** 2 / (w.numel() * (w ** 2).sum())).item(),
                                                         rel=F64_SUM)


@needs_verl
def test_ess_equals_verls_without_rejection():
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper as helper

    old, rollout, mask, _ = _batch(8, beta_scale=0.35)
    corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    _, metrics = helper.compute_rollout_correction_and_add_to_batch(batch, corr)
    assert metrics["phantomclip/is_ess"] == pytest.approx(metrics["rollout_corr/rollout_is_eff_sample_size"],
                                                          rel=FP32_MEAN)
    assert metrics["phantomclip/rs_token_share"] == 0.0


@needs_verl
def test_hooks_are_where_verl_reaches_them():
    """ray_trainer imports the correction helper by name inside fit, at each step: the wrapped module attribute is what
    it calls. verl's plugin switch imports this module in every verl process."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    source = inspect.getsource(RayPPOTrainer.fit)
    assert "from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch" in source
    code = ("import verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
            "from verl.trainer.ppo import rollout_corr_helper as h; from verl.workers import engine_workers as w; "
            "print(sorted(k for k in R if k.startswith('phantomclip')), "
            "getattr(h.compute_rollout_correction_and_add_to_batch, '_phantomclip', False), "
            "getattr(w.ppo_loss, '_phantomclip', False))")  # the workers bind ppo_loss by name: the wrapped one
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "phantomclip.integrations.verl",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "['phantomclip_bypass_mode', 'phantomclip_vanilla'] True True", out.stderr[-800:]
    bypass = ("import verl; from verl.trainer.ppo import ray_trainer as t, rollout_corr_helper as h; "
              "print(t.RayPPOTrainer.fit._phantomclip, h.apply_bypass_mode._phantomclip, "
              "t.compute_data_metrics._phantomclip)")  # the bypass hooks load from inside verl's import too
    out = subprocess.run([sys.executable, "-c", bypass], env={**env, "PHANTOMCLIP_VERL_BYPASS_RECOMPUTE_EVERY": "5"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True True True", out.stderr[-800:]


@needs_verl
def test_worker_loss_entry_runs_ours(monkeypatch):
    """verl's worker-side loss entry (workers/utils/losses.py ppo_loss) on a real TensorDict: with loss_mode
    phantomclip_vanilla its loss and gradient equal loss_mode vanilla's, and our figures come back in its metrics."""
    from tensordict import TensorDict
    from verl.utils.tensordict_utils import assign_non_tensor
    from verl.workers.utils.losses import ppo_loss

    old, rollout, mask, adv = _batch(9)
    new = old + 0.25 * torch.randn(old.shape, generator=torch.Generator().manual_seed(10))
    results = []
    for mode in ("vanilla", "phantomclip_vanilla"):
        config = _actor_config(loss_mode=mode)
        lp = new.clone().requires_grad_(True)
        data = TensorDict({"response_mask": mask, "old_log_probs": old, "advantages": adv}, batch_size=[old.shape[0]])
        assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)  # one rank, local mean
        monkeypatch.setattr("verl.workers.utils.losses.no_padding_2_padding", lambda x, d: x)  # padded already
        loss, metrics = ppo_loss(config, {"log_probs": lp}, data)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (l_v, g_v, m_v), (l_p, g_p, m_p) = results
    assert torch.equal(l_v, l_p) and torch.equal(g_v, g_p)
    assert m_p["phantomclip/actor/tokens"].aggregate() == int(mask.sum())


class _RecomputeStandIn:
    """The actor's recompute at the boundary it crosses: RayPPOTrainer._compute_old_log_prob sends the batch to the
    actor worker group (Ray + FSDP, not run here) and returns (DataProto with old_log_probs, mfu)."""

    def __init__(self, old: torch.Tensor):
        self.old, self.calls = old, 0

    def _compute_old_log_prob(self, batch):
        from verl import DataProto

        self.calls += 1
        return DataProto.from_dict(tensors={"old_log_probs": self.old.clone()}), 0.0


@needs_verl
def test_bypass_recompute_every_k_steps(monkeypatch):
    """Bypass mode measured every 2nd step: the wrapped apply_bypass_mode runs the recompute before verl's
    substitution, the wrapped compute_data_metrics adds β's figures and the phantom share at α = 0, by hand."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo import rollout_corr_helper as helper

    import phantomclip.integrations.verl as pv

    source = inspect.getsource(ray_trainer.RayPPOTrainer.fit)  # where fit reaches the three wrapped names
    assert "from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode" in source
    assert "compute_data_metrics(batch=batch, use_critic=self.use_critic)" in source
    assert "return old_log_prob, old_log_prob_mfu" in inspect.getsource(ray_trainer.RayPPOTrainer._compute_old_log_prob)
    monkeypatch.setenv(pv.RECOMPUTE_ENV, "2")
    pv.install_bypass_recompute()
    old, rollout, mask, adv = _batch(11, beta_scale=0.3)
    stand_in = _RecomputeStandIn(old)
    monkeypatch.setattr(pv._BypassState, "trainer", stand_in)
    monkeypatch.setattr(pv._BypassState, "steps", 0)
    B, T = old.shape
    found = []
    for step in range(3):
        batch = DataProto.from_dict(tensors={
            "rollout_log_probs": rollout.clone(), "response_mask": mask.clone(), "advantages": adv.clone(),
            "returns": adv.clone(), "token_level_scores": adv.clone(), "token_level_rewards": adv.clone(),
            "prompts": torch.zeros(B, 3, dtype=torch.long), "responses": torch.zeros(B, T, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(B, 3), mask], 1)})
        helper.apply_bypass_mode(batch=batch, rollout_corr_config=RolloutCorrectionConfig(bypass_mode=True),
                                 policy_loss_config=OmegaConf.create({}))
        assert torch.equal(batch.batch["old_log_probs"], rollout)  # verl's substitution, unchanged
        found.append(ray_trainer.compute_data_metrics(batch=batch, use_critic=False))
    assert stand_in.calls == 2  # steps 0 and 2
    assert not any(k.startswith("phantomclip/") for k in found[1])
    ok = mask.bool()
    beta = (old - rollout).double()[ok]
    ref = mismatch_stats(old, rollout, mask, 0.2, 0.2)
    for metrics in (found[0], found[2]):
        assert metrics["phantomclip/beta_abs_mean"] == pytest.approx(ref["beta_abs_mean"], rel=F64_SUM)
        hand = phantom_clip_mask(beta, adv[ok], 0.2, 0.2).double().mean().item()
        assert metrics["phantomclip/phantom_clip_rate_at_alpha0"] == hand > 0
        assert metrics["phantomclip/recompute_seconds"] >= 0


WORKER = Path(__file__).parent / "verl_actor_step_worker.py"


@pytest.fixture(scope="module")
def actor_runs(tmp_path_factory):
    """verl's actor update run once per loss mode, one process each: {mode: what the worker saved}, and the folder."""
    out = tmp_path_factory.mktemp("verl-actor")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MASTER_PORT": "29573"}
    runs = {}
    for mode in ("vanilla", "phantomclip_vanilla"):
        done = subprocess.run([sys.executable, str(WORKER), str(out), mode], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = torch.load(out / f"{mode}.pt", weights_only=False)
    return runs, out


@needs_verl
def test_real_actor_update_step_on_cpu(actor_runs):
    """verl's own actor (TrainingWorker, FSDP2 engine, gloo, one process) on a tiny Llama: recompute, the driver's
    rollout correction, then an update of two mini-batches with loss_mode vanilla and with phantomclip_vanilla from the
    same start. The weights after the update are equal bit for bit; the figures ride in verl's own metrics."""
    runs, _ = actor_runs
    ours, theirs = runs["phantomclip_vanilla"], runs["vanilla"]
    assert ours["params"].keys() == theirs["params"].keys()
    assert all(torch.equal(ours["params"][k], theirs["params"][k]) for k in ours["params"])
    assert any(not torch.equal(ours["params"][k], ours["start"][k]) for k in ours["params"])  # the step moved them
    m = ours["metrics"]
    assert m["actor/pg_loss"] == theirs["metrics"]["actor/pg_loss"]
    batch = ours["batch"]
    assert sum(m["phantomclip/actor/tokens"]) == int(batch["response_mask"].sum())  # per mini-batch, all tokens
    for rate, verls in zip(m["phantomclip/actor/clip_rate"], m["actor/pg_clipfrac"]):
        assert rate == pytest.approx(verls, rel=FP32_MEAN, abs=1e-12)
    assert m["phantomclip/actor/log_ratio_abs_mean"][0] == 0.0  # first mini-batch: θ = θ_old, the recompute exact
    assert m["phantomclip/actor/log_ratio_abs_mean"][1] > 0  # after one optimizer step: α
    ref = mismatch_stats(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], 0.2, 0.2)
    assert ours["driver"]["phantomclip/beta_abs_mean"] == pytest.approx(ref["beta_abs_mean"], rel=F64_SUM)


@needs_verl
def test_actor_update_over_two_ranks(actor_runs):
    """The same update by verl's actor on 2 data-parallel ranks (torchrun, FSDP2 over gloo), each rank holding half of
    every mini-batch: every rank logs the counts of the one-process run, mini-batch by mini-batch."""
    runs, out = actor_runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29575", str(WORKER), str(out), "phantomclip_vanilla", "1",
                           str(out / "phantomclip_vanilla.pt")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    one = runs["phantomclip_vanilla"]["metrics"]
    for rank in (0, 1):
        two = torch.load(out / f"rank{rank}-phantomclip_vanilla.pt", weights_only=False)["metrics"]
        for key in ("tokens", "clip_high_tokens", "clip_low_tokens", "dual_clip_tokens", "clip_rate"):
            assert two[f"phantomclip/actor/{key}"] == one[f"phantomclip/actor/{key}"], key
        assert two["phantomclip/actor/log_ratio_abs_mean"][0] == 0.0
    assert sum(one["phantomclip/actor/clip_low_tokens"]) + sum(one["phantomclip/actor/clip_high_tokens"]) > 0


@needs_verl
def test_the_fix_decoupled_mode_with_token_tis():
    """The fix docs/verl.md gives for bypass mode, on the same tokens at α = 0: bypass mode (the clip on π/μ) zeroes the
    gradient of every token whose β points out of the trust region; decoupled mode with token TIS (the clip on
    π/π_old, β in the weight min(exp β, 2)) clips none, and each token's gradient is −A·w / N (token-mean: d/dℓ of
    −A·e^ℓ·w at ℓ = 0, over the N tokens)."""
    old, rollout, mask, adv = _batch(12, beta_scale=0.3)
    ok = mask.bool()
    _, (_, g_bypass, m_bypass) = _both("vanilla", "phantomclip_vanilla", _actor_config(), rollout, old, adv, mask)
    phantom = torch.zeros_like(ok)
    phantom[ok] = phantom_clip_mask((old - rollout).double()[ok], adv[ok], EPS_LOW, EPS_HIGH)
    assert phantom.any() and torch.all(g_bypass[phantom] == 0)  # every phantom clip: no gradient
    assert m_bypass["phantomclip/actor/clip_high_tokens"] + m_bypass["phantomclip/actor/clip_low_tokens"] == int(
        phantom.sum())
    w = torch.exp((old - rollout).clamp(max=math.log(2.0))) * mask  # [B, T] verl's token TIS at 2
    (_, g_fix, m_fix), _ = _both("phantomclip_vanilla", "vanilla", _actor_config(), old, old, adv, mask, w)
    assert m_fix["phantomclip/actor/clip_rate"] == 0.0
    want = -(adv * w) / mask.sum()  # [B, T]
    assert torch.allclose(g_fix[ok], want[ok], rtol=1e-6, atol=0)  # fp32: a product and a quotient, a few ulp
    assert torch.all(g_fix[phantom] != 0)


@needs_verl
def test_counts_reduce_over_the_group_verl_hands_ppo_loss(tmp_path):
    """verl's engines call ppo_loss with their data-parallel group (Ulysses' dp dimension, Megatron's data-parallel
    group: the last pipeline stage's ranks, each token once); the counts are reduced over that group. Each of two
    ranks passes a group of itself alone: its counts are its own half's; with dp_group=None: both halves'."""
    old, rollout, mask, adv = _batch(13, B=10)
    new = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(14))
    torch.save({"old": old, "new": new, "mask": mask, "adv": adv}, tmp_path / "batch.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29563", str(Path(__file__).parent / "verl_ranks_worker.py"), str(tmp_path), "groups"],
                          env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    whole = clip_counts(old, new, adv, mask, EPS_LOW, EPS_HIGH)
    for rank, rows in ((0, slice(0, 5)), (1, slice(5, 10))):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        own = clip_counts(old[rows], new[rows], adv[rows], mask[rows], EPS_LOW, EPS_HIGH)
        for key in ("tokens", "clip_high_tokens", "clip_low_tokens", "clip_rate"):
            assert got["alone"][key] == own[key] and got["every"][key] == whole[key], key
