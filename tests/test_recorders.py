"""The recorders users add to their own runs (integrations/recorders.py), on batches laid out as each framework lays
them out (vLLM's RequestOutput, TRL's generation dict, verl's DataProto), hand-made here so that every value written
can be checked against the one put in; the real engines' runs of them are in tests/test_rollouts_vllm_real.py."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from phantomclip.base.errors import IntegrationError
from phantomclip.integrations.recorders import RolloutRecorder, record_verl_batch, record_vllm, rows_as_records
from phantomclip.rollouts.readers import read_rollouts


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _completion(ids, logps, **extra):
    """vLLM's CompletionOutput as far as the recorder reads it: token_ids, logprobs as one {token: Logprob} per
    position (vllm/outputs.py, vllm/logprobs.py), finish_reason; routed_experts / weight_versions when returned."""
    logprobs = [{t: SimpleNamespace(logprob=lp, rank=1), t + 1: SimpleNamespace(logprob=-9.0, rank=2)}
                for t, lp in zip(ids, logps)]
    return SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason="stop", **extra)


def test_record_vllm_writes_each_completion_with_its_routes_and_version(tmp_path):
    """Two requests, the second with n = 2 completions: three records; the sampled token's log-prob is read from its
    own entry (not the other top-k one); numpy routes [positions, layers, k] become lists; the last weight-version
    span's version is the record's."""
    routes = np.array([[[0, 1]], [[1, 2]], [[2, 3]]], dtype=np.uint8)  # prompt 2 + completion 2 - 1 = 3 positions
    spans = [SimpleNamespace(version="3", start=0, end=1), SimpleNamespace(version="4", start=1, end=2)]
    outputs = [SimpleNamespace(prompt_token_ids=[5, 6], outputs=[_completion([7, 8], [-0.5, -1.5],
                                                                             routed_experts=routes,
                                                                             weight_versions=spans)]),
               SimpleNamespace(prompt_token_ids=[9], outputs=[_completion([10], [-0.25]), _completion([11], [-2.0])])]
    params = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0)
    path = tmp_path / "v.jsonl"
    assert record_vllm(outputs, path, dtype="bfloat16", params=params, logprobs_mode="processed_logprobs",
                       step=2) == 3
    header, *records = _lines(path)
    assert header["logprobs"] == "processed" and header["engine"]["dtype"] == "bfloat16"
    assert header["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0}  # vLLM's -1: off
    assert records[0] == {"prompt_ids": [5, 6], "completion_ids": [7, 8], "logp_engine": [-0.5, -1.5], "step": 2,
                          "weight_version": 4, "routed_experts": [[[0, 1]], [[1, 2]], [[2, 3]]], "finished": True}
    assert [r["completion_ids"] for r in records[1:]] == [[10], [11]]
    assert [r["logp_engine"] for r in records[1:]] == [[-0.25], [-2.0]]


def test_record_vllm_refuses_what_diagnose_would_refuse(tmp_path):
    missing = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="length")
    with pytest.raises(IntegrationError, match="no log-prob for some sampled token: sample with"):
        record_vllm([SimpleNamespace(prompt_token_ids=[5], outputs=[missing])], tmp_path / "x.jsonl", "bfloat16")
    with pytest.raises(IntegrationError, match="logprobs_mode 'logits'"):
        record_vllm([], tmp_path / "x.jsonl", "bfloat16", logprobs_mode="logits")
    assert not (tmp_path / "x.jsonl").exists()


def test_rows_as_records_reads_padded_rows_and_leaves_out_the_unusable():
    """prompts left-padded, completions right-padded (TRL and verl both): row 0 is whole; row 1's completion mask
    is zero throughout (TRL's masked truncation) and row 2 holds a NaN log-prob: both left out, rows named."""
    prompt = torch.tensor([[0, 5, 6], [0, 0, 7], [8, 9, 10]])  # [3, 3], pad 0 on the left
    prompt_mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    completion = torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16]])  # [3, 3], pad 0 on the right
    completion_mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    logps = torch.tensor([[-0.5, -1.0, 0.0], [-0.1, 0.0, 0.0], [-0.2, math.nan, -0.3]])
    rows = rows_as_records(prompt, prompt_mask, completion, completion_mask, logps,
                           advantages=torch.tensor([0.5, -0.5, 1.0]), step=3, version=2)
    assert [b for b, _ in rows] == [0]
    r = rows[0][1]
    assert (r.prompt_ids, r.completion_ids, r.logp_engine) == ([5, 6], [11, 12], [-0.5, -1.0])
    assert (r.step, r.weight_version, r.advantage) == (3, 2, 0.5)


def _trl_trainer(tmp_path):
    """The attributes RolloutRecorder.record reads of a GRPOTrainer (trl 1.16): args' sampling, the model's name,
    the process index."""
    args = SimpleNamespace(temperature=0.9, top_p=1.0, top_k=0, min_p=None)
    return SimpleNamespace(args=args, model=SimpleNamespace(config=SimpleNamespace(_name_or_path="m")),
                           accelerator=SimpleNamespace(process_index=1))


def test_rollout_recorder_writes_one_file_per_generation(tmp_path):
    """TRL's generation dict (`_generate_and_score_completions`' keys) as a file named by step and rank, with vLLM's
    processed log-probs, TRL's sampling settings and each completion's advantage; a tool-masked row is left out."""
    recorder = RolloutRecorder(tmp_path / "r")
    recorder.trainer = _trl_trainer(tmp_path)
    batch = {"prompt_ids": torch.tensor([[1, 2], [0, 3]]), "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
             "completion_ids": torch.tensor([[4, 5], [6, 7]]), "completion_mask": torch.ones(2, 2, dtype=torch.long),
             "sampling_per_token_logps": torch.tensor([[-0.5, -0.25], [-1.0, -2.0]]),
             "advantages": torch.tensor([1.0, -1.0]), "tool_mask": torch.tensor([[1, 1], [1, 0]])}
    path = recorder.record(batch, step=6, version=5)
    assert path.name == "step-000006-rank1.jsonl" and recorder.files == [path]
    header, *records = _lines(path)
    assert header["logprobs"] == "processed" and header["sampling"]["temperature"] == 0.9
    assert records == [{"prompt_ids": [1, 2], "completion_ids": [4, 5], "logp_engine": [-0.5, -0.25], "step": 6,
                        "weight_version": 5, "advantage": 1.0}]
    with pytest.raises(IntegrationError, match="every must be a whole number >= 1"):
        RolloutRecorder(tmp_path, every=0)


def _data_proto(routes: bool):
    """A verl DataProto as its agent loop leaves it (verl/experimental/agent_loop/agent_loop.py `_postprocess`):
    prompts [B, P] left-padded, responses [B, R] right-padded, attention_mask [B, P + R], response_mask [B, R],
    rollout_log_probs [B, R] (0.0 past the response), advantages [B, R] (GRPO: one value per row), routed_experts
    [B, P + R, layers, k] zero outside each row."""
    batch = {
        "prompts": torch.tensor([[0, 1, 2], [3, 4, 5]]), "responses": torch.tensor([[6, 7], [8, 0]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
        "rollout_log_probs": torch.tensor([[-0.5, -1.0], [-0.75, 0.0]]),
        "advantages": torch.tensor([[0.3, 0.3], [-0.3, 0.0]]),
    }
    if routes:  # position q of row b at column start_b + q; value 10 * column + layer marks where it came from
        r = torch.zeros(2, 5, 2, 1, dtype=torch.long)
        for col in range(5):
            r[:, col, 0, 0], r[:, col, 1, 0] = 10 * col, 10 * col + 1
        batch["routed_experts"] = r
    return SimpleNamespace(batch=batch, meta_info={"global_steps": 9})


def test_record_verl_batch_reads_verls_layout(tmp_path):
    path = tmp_path / "verl.jsonl"
    assert record_verl_batch(_data_proto(routes=True), path, sampling={"temperature": 1.0, "top_k": -1}) == 2
    header, *records = _lines(path)
    assert header["logprobs"] == "processed" and header["sampling"]["top_k"] == 0
    assert [(r["prompt_ids"], r["completion_ids"], r["logp_engine"], r["step"], r["advantage"]) for r in records] == [
        ([1, 2], [6, 7], [-0.5, -1.0], 9, pytest.approx(0.3)), ([3, 4, 5], [8], [-0.75], 9, pytest.approx(-0.3))]
    # row 0 starts at column 1 (one pad): its 2 + 2 - 1 = 3 routed positions are columns 1..3
    assert records[0]["routed_experts"] == [[[10], [11]], [[20], [21]], [[30], [31]]]
    assert records[1]["routed_experts"] == [[[0], [1]], [[10], [11]], [[20], [21]]]
    header, stream = read_rollouts(str(path))  # and diagnose reads it
    assert len(list(stream)) == 2
    with pytest.raises(IntegrationError, match="calculate_log_probs=True"):
        proto = _data_proto(routes=False)
        proto.batch.pop("rollout_log_probs")
        record_verl_batch(proto, tmp_path / "x.jsonl")


def test_async_recorder_writes_the_samples_of_each_step_with_their_version(tmp_path):
    """AsyncGRPOTrainer's queue (trl 1.16 RolloutSample: the whole sequence, a completion mask over it, vLLM's
    log-probs zero outside the completion, advantage, model_version): every sample dequeued during a step lands in
    that step's file with its own version; a multi-turn sample (a mask with a gap) is left out."""
    import queue

    from phantomclip.integrations.recorders import AsyncRolloutRecorder

    def sample(ids, mask, logps, version, adv):
        return SimpleNamespace(input_ids=np.array(ids), completion_mask=np.array(mask),
                               old_log_probs=np.array(logps, dtype=np.float32), advantage=adv, model_version=version)

    q = queue.Queue()
    q.put(sample([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -0.5, -0.25], 3, 0.75))
    q.put(sample([1, 5, 6, 7], [0, 1, 0, 1], [0, -1.0, 0, -2.0], 4, -0.75))  # a tool turn inside
    trainer = SimpleNamespace(rollout_queue=q, args=SimpleNamespace(temperature=1.0))
    recorder = AsyncRolloutRecorder(tmp_path / "a")
    recorder.attach(trainer)
    assert q.get().model_version == 3 and q.get().model_version == 4  # what the dataset dequeues, unchanged
    path = recorder.flush(step=5)
    header, *records = _lines(path)
    assert path.name == "step-000005.jsonl" and header["logprobs"] == "processed"
    assert records == [{"prompt_ids": [1, 2], "completion_ids": [3, 4], "logp_engine": [-0.5, -0.25], "step": 5,
                        "weight_version": 3, "advantage": 0.75}]
    assert recorder.flush(step=6) is None  # nothing dequeued since
    with pytest.raises(IntegrationError, match="works with TRL's AsyncGRPOTrainer"):
        AsyncRolloutRecorder(tmp_path).attach(SimpleNamespace())


def test_rollout_recorder_reads_the_canary_after_every_weight_sync(tmp_path):
    """canary=[...]: after each sync of TRL's VLLMGeneration (wrapped, whatever sync is installed), the engine's
    reading of the fixed probe is written as canary records of the step the sync is for, one file per step and
    rank, equal to read_canary's own reading (phantomclip's LocalEngine stands for colocate mode's LLM here; the
    vLLM path is CI stage 2's). Server mode, sleep mode and a probe that is no list of sequences: one line each."""
    from phantomclip.engines.local import LocalEngine
    from phantomclip.integrations.recorders import read_canary, read_canary_after_sync
    from phantomclip.models.load import load_model

    lm = load_model("tiny-random:0", progress=lambda *a, **k: None)
    engine, probe, synced = LocalEngine(lm.model, torch.bfloat16), [[5, 6, 7, 8], [9, 10, 11]], []
    generation = SimpleNamespace(mode="colocate", llm=engine, enable_sleep_mode=False,
                                 sync_weights=lambda: synced.append(trainer.state.global_step))
    trainer = _trl_trainer(tmp_path)
    trainer.vllm_generation, trainer.state, trainer.processing_class = generation, SimpleNamespace(global_step=0), None
    recorder = RolloutRecorder(tmp_path / "r", canary=probe)
    recorder.trainer = trainer
    read_canary_after_sync(generation, lambda: recorder.record_canary(recorder._probe(trainer)))
    for step in (0, 3):
        trainer.state.global_step = step
        generation.sync_weights()
    assert synced == [0, 3]
    assert [p.name for p in recorder.files] == ["canary-000000-rank1.jsonl", "canary-000003-rank1.jsonl"]
    want = read_canary(engine, probe)
    for path, step in zip(recorder.files, (0, 3)):
        header, *records = _lines(path)
        assert [r["logp_engine"] for r in records] == want  # the same engine, weights and kernels: bit for bit
        assert all(r["canary"] and r["step"] == step and r["prompt_ids"] + r["completion_ids"] == s
                   for r, s in zip(records, probe))
    for change, words in (({"mode": "server"}, "needs vllm_mode='colocate'"),
                          ({"enable_sleep_mode": True}, "vllm_enable_sleep_mode")):
        with pytest.raises(IntegrationError, match=words):
            recorder._probe(SimpleNamespace(vllm_generation=SimpleNamespace(**{**vars(generation), **change})))
    with pytest.raises(IntegrationError, match="canary must be True, False or a list of fixed token-id sequences"):
        RolloutRecorder(tmp_path, canary=[[1]])
