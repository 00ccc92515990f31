"""The TRL integration with LoRA (PEFT), TRL's KL term, dropout and a bf16 trainer (one process; real DeepSpeed ZeRO-3:
tests/test_trl_zero3.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close_eps

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from phantomclip.integrations.trl import IntegrationError, PrecisionMonitor, with_shadow_ratio  # noqa: E402
from phantomclip.integrations.weights import build_shadow, full_weights, sync_shadow  # noqa: E402
from trl_ranks_worker import B, L, global_batch, make_trainer, rows  # noqa: E402


def _lora(model, **kw):
    """LoRA on three projections with B randomised (PEFT starts B at 0, which would merge to W exactly)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **kw)
    pm = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return pm


def _peft_trainer(tmp_path, cls=None, callbacks=(), **lora):
    trainer = make_trainer(str(tmp_path), cls=cls, callbacks=callbacks)
    trainer.model = trainer.model_wrapped = _lora(trainer.model, **lora)
    return trainer


def _trl_sync(trainer) -> dict[str, torch.Tensor]:
    """What TRL 1.16 hands vLLM: VLLMGeneration._iter_named_params (merge_adapter, names, unmerge), run on an
    instance holding only what that method reads."""
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gen = object.__new__(VLLMGeneration)
    gen.model, gen.accelerator, gen._dist = trainer.model, trainer.accelerator, DistributedBackend(trainer.accelerator)
    return {name: p.detach().clone() for name, p in gen._iter_named_params()}


def test_shadow_holds_the_merged_weights_trl_sends_vllm(tmp_path):
    trainer = _peft_trainer(tmp_path, lora_dropout=0.1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    ours = {n: t.clone() for n, t in full_weights(trainer.model)}
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # ours writes nothing
    theirs = _trl_sync(trainer)
    assert ours.keys() == theirs.keys() and not any("lora_" in n for n in ours)
    merged = [n for n in ours if "q_proj.weight" in n or "down_proj.weight" in n]
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name  # W + s·BA, bit for bit, as PEFT's merge computes it
    base = trainer.model.get_base_model()
    assert not torch.equal(ours[merged[0]], dict(base.named_parameters())[merged[0].replace(".weight",
                                                                                             ".base_layer.weight")])
    shadow = build_shadow(trainer.model, "bfloat16", "cpu")
    sync_shadow(shadow, trainer.model)
    for name, p in shadow.named_parameters():
        assert torch.equal(p, theirs[name].to(torch.bfloat16)), name  # what vLLM loads: the cast of TRL's tensor


def _loss_inputs(trainer, beta_ref_shift: float = 0.3) -> dict:
    part = rows(global_batch(), 0, B // 2, trainer)
    part["ref_per_token_logps"] = part["old_per_token_logps"] - beta_ref_shift  # a reference 0.3 nats away
    return part


@pytest.mark.parametrize("use_peft,bias_correction", [(False, False), (True, False), (False, True)])
def test_kl_term_is_trls_own_under_shadow_ratio(tmp_path, use_peft, bias_correction):
    """With beta > 0, the KL term TRL logs (mean of exp(ref − logp) − (ref − logp) − 1) is the one TRL computes
    with the trainer's own log-probs, although the ratio uses the shadow's: ref and logp move by the same shift.
    Per token, ref' − logp' = (ref + (s − l)) − s rounds three times at the scale of |logp|, so the KL values agree
    to a few eps32 * max|logp|. And the reference scores are never the shadow's (with PEFT: adapters disabled).
    TRL's use_bias_correction_kl (default on) weights that term by the PPO ratio, which under with_shadow_ratio is
    the shadow's by design: compared here where both ratios are 1 (no old log-probs: TRL takes logp.detach())."""
    from trl import GRPOTrainer
    from trl.trainer.utils import use_adapter

    kls = {}
    for name, cls in (("trl", None), ("shadow", with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"))):
        trainer = (_peft_trainer(tmp_path / name, cls=cls) if use_peft else make_trainer(str(tmp_path / name), cls=cls))
        trainer.beta = 0.04
        trainer.args.use_bias_correction_kl = bias_correction
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        inputs = _loss_inputs(trainer)
        if bias_correction:
            del inputs["old_per_token_logps"]
        trainer._compute_loss(trainer.model, inputs)
        kls[name] = trainer._metrics["train"]["kl"][-1]
        if use_peft and cls is not None:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            with torch.no_grad(), use_adapter(trainer.model, None):
                ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), L)
                plain, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids,
                                                                            torch.ones_like(ids), L)
            assert torch.equal(ref, plain)  # the reference call is TRL's own, not the shadow's
    assert kls["trl"] > 0.01  # the reference is 0.3 nats away: a real KL (k3 ≈ 0.3²/2)
    assert_close_eps(kls["shadow"], kls["trl"], torch.float32, 10.0, factor=4.0, name="kl")


def test_logged_kl_is_weighted_by_the_ratio_the_clip_sees(tmp_path):
    """TRL's default use_bias_correction_kl logs (and trains on) the masked mean of k3(ref − logp) · exp(logp − old)
    (trl 1.16 grpo_trainer.py, `_compute_loss`). With LoRA dropout and old log-probs scored at rollout (num_iterations
    > 1), TRL's own ratio compares two dropout forwards with different masks; under with_shadow_ratio both sides are
    the shadow's (dropout-free), so at a batch's first iteration the ratio is exactly 1 and the logged kl is the plain
    mean of k3 (docs/trl.md, 'Which KL TRL logs'). Each logged value is held to its formula on the tensors: the same
    float32 terms summed in another order (tokens terms of size <= max k3·ratio), or, under the fix, k3 of a
    difference rounded three times at |logp| <= 10 (test_kl_term_is_trls_own_under_shadow_ratio's bound)."""
    from trl import GRPOTrainer
    from trl.trainer.utils import use_adapter

    kls, wants = {}, {}
    for name, cls in (("trl", None), ("shadow", with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"))):
        trainer = _peft_trainer(tmp_path / name, cls=cls, lora_dropout=0.3)
        assert trainer.args.use_bias_correction_kl  # TRL's default
        trainer.beta = 0.04
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        inputs = rows(global_batch(), 0, B // 2, trainer)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            torch.manual_seed(10)  # the rollout's scoring, as TRL runs it with num_iterations > 1 (train mode)
            inputs["old_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, attention, L)
            with use_adapter(trainer.model, None):  # TRL's PEFT reference: adapters off
                ref, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, attention, L)
            inputs["ref_per_token_logps"] = ref
            torch.manual_seed(11)  # the loss's forward below draws the same dropout masks
            logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, attention, L)
        torch.manual_seed(11)
        trainer._compute_loss(trainer.model, inputs)
        kls[name] = trainer._metrics["train"]["kl"][-1]
        mask = inputs["completion_mask"].bool()
        k3 = torch.exp(ref - logp) - (ref - logp) - 1  # [B/2, L]
        ratio = torch.ones_like(logp) if cls else torch.exp(logp - inputs["old_per_token_logps"])
        wants[name] = ((k3 * ratio)[mask].sum() / mask.sum()).item(), (k3 * ratio)[mask].abs().max().item(), mask.sum()
    want, scale, tokens = wants["trl"]
    assert_close_eps(kls["trl"], want, torch.float32, scale, terms=int(tokens), name="TRL's kl")
    assert_close_eps(kls["shadow"], wants["shadow"][0], torch.float32, 10.0, factor=4.0, name="kl under the fix")
    print(f"logged kl: TRL alone {kls['trl']:.4f}, under with_shadow_ratio {kls['shadow']:.4f}")
    assert abs(kls["trl"] - kls["shadow"]) > 0.1 * kls["shadow"]  # dropout's ratio noise: not a rounding


def test_monitor_measures_beta_with_dropout_off(tmp_path):
    """LoRA dropout 0.5 perturbs the loss's forward; β is measured against a dropout-free trainer forward, and the
    gap dropout would have added is reported here (printed with -s)."""
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer = _peft_trainer(tmp_path, lora_dropout=0.5)
    monitor.attach(trainer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = _loss_inputs(trainer)
    trainer._compute_loss(trainer.model, inputs)
    logp, logp_shadow, mask, _ = monitor.last_tensors
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    trainer.model.eval()
    with torch.no_grad():
        clean, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, L)
    assert torch.equal(logp, clean)
    with_dropout = monitor._logp  # the loss's own (dropout on) log-probs
    m = mask.bool()
    gap_clean = (logp - logp_shadow)[m].abs().mean().item()
    gap_dropout = (with_dropout - logp_shadow)[m].abs().mean().item()
    print(f"mean |β| dropout off {gap_clean:.4f}, with lora_dropout 0.5 in the trainer's forward {gap_dropout:.4f}")
    assert gap_dropout > gap_clean


def test_bf16_trainer_is_measured_as_bf16(tmp_path, monkeypatch):
    """GRPOConfig(bf16=True): TRL's forward runs under bf16 autocast, and β is measured against that forward (the
    monitor's trainer log-probs are the autocast scores bit for bit, not an fp32 forward's), and the monitor names
    the precision. The gap is not the bf16-vs-bf16 kernel gap one might expect: autocast keeps norms, residual adds
    and embeddings in fp32 while the engine rounds them to bf16 (tiny-random:30 here: mean |β| 0.036 autocast vs
    0.039 fp32; diagnose on the bundled model: 0.046 vs 0.039), so both figures are asserted only apart."""
    gaps, logps = {}, {}
    for bf16 in (False, True):
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = make_trainer(str(tmp_path / str(bf16)))
        trainer.args.bf16 = bf16
        if bf16:  # what accelerate's autocast() is under mixed_precision="bf16" on CPU (its state is per process)
            monkeypatch.setattr(trainer.accelerator, "autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        monitor.attach(trainer)
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.train()
        inputs = _loss_inputs(trainer)
        trainer._compute_loss(trainer.model, inputs)
        gaps[monitor.trainer_precision] = monitor.last["beta_abs_mean"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = trainer.model(input_ids=ids, attention_mask=attention).logits[:, -L - 1:-1].float()
        own = out.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None])[..., 0]  # [B, L]
        m = inputs["completion_mask"].bool()
        logps[bf16] = (monitor.last_tensors[0][m], own[m])
    print(gaps)
    assert set(gaps) == {"fp32", "bf16-autocast"} and gaps["fp32"] != gaps["bf16-autocast"]
    for bf16, (recorded, own) in logps.items():  # TRL's fused head against a plain log-softmax: fp32 reordering
        assert_close_eps(recorded, own, torch.float32, own.abs().max(), terms=64, factor=4.0, name=f"bf16={bf16}")
    moved = (logps[True][0] - logps[False][0]).abs().max().item()
    assert moved > 1e-3, moved  # the autocast forward is another computation: bf16 products


def test_unsupported_peft_is_refused_at_attach(tmp_path):
    for lora, match in (({"use_dora": True}, "DoraLinearVariant"),):
        trainer = _peft_trainer(tmp_path, **lora)
        with pytest.raises(IntegrationError, match=match):
            PrecisionMonitor().attach(trainer)
    trainer = make_trainer(str(tmp_path / "emb"))
    config = peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"])
    trainer.model = trainer.model_wrapped = peft.get_peft_model(trainer.model, config)
    with pytest.raises(IntegrationError, match="LoRA on Linear layers only, not Embedding"):
        PrecisionMonitor().attach(trainer)
