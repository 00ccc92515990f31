"""PrecisionMonitor and with_shadow_ratio under real DeepSpeed ZeRO-3, two processes over gloo on CPU.

The ranks run tests/trl_zero3_worker.py (one launch for every check); the one-process reference is
tests/test_trl_ranks.py's (the same tiny model, global batch, chunks and thread count), so each figure under ZeRO-3
is held to the same tolerance as under DDP. The shadow is built outside ZeRO-3's init hooks (before the fix:
'Cannot copy out of meta tensor') and scored with TRL's fused head (before: 'Parameter' object has no attribute
'ds_status').
"""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close_eps, run_ranks

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("deepspeed")

import trl_ranks_worker as worker  # noqa: E402
from test_trl_ranks import WORLD, assert_figures_equal, one_process_reference  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    return run_ranks("trl_zero3_worker.py", out, WORLD, timeout=400)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return one_process_reference(tmp_path_factory)


def test_zero_figures_equal_one_process_with_and_without_offload(ranks, one_process):
    """Each rank holds placeholders (ZeRO-3 partitions every parameter: 0 elements outside a gather) and logs the
    figures of one process on the whole batch, with the parameters on the rank and offloaded to CPU memory; under
    ZeRO-2 the weights are whole on every rank (only gradients and optimizer states are partitioned)."""
    from phantomclip.integrations.trl import precision_stats

    logp, logp_shadow, mask, adv = one_process["tensors"]
    want = precision_stats(logp, logp_shadow, mask, adv, 0.2, 0.2)
    beta = (logp - logp_shadow)[mask.bool()].abs()
    assert want["beta_abs_mean"] > 0
    for r, rank in enumerate(ranks):
        for kind in ("zero3", "zero3_offload"):
            assert rank[f"{kind}_kind"] == "zero3" and rank[f"{kind}_placeholder_numel"] == 0
            assert_figures_equal(rank[f"{kind}_stats"], want, beta.max().item(), beta.numel(), f"rank {r} {kind}")
        assert rank["zero2_kind"] == "none" and rank["zero2_placeholder_numel"] > 0
        assert all(rank["zero2_shadow_equal"].values())
        assert_figures_equal(rank["zero2_stats"], want, beta.max().item(), beta.numel(), f"rank {r} zero2")


def test_zero3_shadow_is_the_gathered_weights_in_bf16(ranks):
    """The shadow filled through GatheredParameters is bit for bit the one filled from the same model unsharded
    (plain and with LoRA merged: W + s·BA computed on the gathered base, A and B), each parameter gathered once and
    alone, and the trainer's parameters are placeholders again afterwards."""
    from phantomclip.models.load import load_model

    n_params = len(list(load_model(worker.MODEL).model.parameters()))  # the tied head counts once
    for rank in ranks:
        for kind in ("zero3", "zero3_offload", "peft"):
            equal = rank[f"{kind}_shadow_equal"]
            assert len(equal) == 20 and all(equal.values()), (kind, [n for n, ok in equal.items() if not ok])
        assert rank["peft_kind"] == "zero3"
        for kind in ("zero3", "zero3_offload"):
            assert rank[f"{kind}_released"] == 0
            assert rank[f"{kind}_gathers"] == (n_params, n_params, 1, n_params)


def test_shadow_ratio_gradients_under_zero3_equal_one_process(ranks, one_process):
    """ZeRO-3's reduce-scatter averages the ranks' gradients as DDP does; the whole gradients (safe_get_full_grad)
    equal one process accumulating the two halves, to the tolerance of tests/test_trl_ranks.py's DDP check."""
    want = one_process["grads"]
    tokens = int(worker.global_batch()["num_items_in_batch"].item())
    assert ranks[0]["zero3_grads"].keys() == want.keys()
    for r, rank in enumerate(ranks):
        for name, g in want.items():
            assert g.abs().max() > 0, name
            assert_close_eps(rank["zero3_grads"][name], g, torch.float32, g.abs().max(), terms=tokens, factor=2.0,
                             name=f"rank {r} {name}")
    total = sum(one_process["losses"])
    assert_close_eps(sum(rank["zero3_loss"] for rank in ranks) / WORLD, total, torch.float32, abs(total) + 1e-3,
                     terms=tokens, name="loss")


def test_zero3_training_loop_logs_the_same_rows_on_every_rank(ranks):
    """2 steps of trainer.train() with with_shadow_ratio and the monitor, the policy built inside zero.Init: the
    precision figures at both optimizer steps, identical on both ranks, the second after a real sync."""
    logs = [rank["train_log"] for rank in ranks]
    assert logs[0] == logs[1] and ranks[0]["train_kind"] == "zero3"
    assert logs[0][0]["precision/trainer_precision"] == "fp32" and logs[0][0]["precision/engine_dtype"] == "bfloat16"
    measured = [h for h in logs[0] if "precision/beta_abs_mean" in h]
    assert [h["step"] for h in measured] == [1, 2], logs[0]
    assert all(h["precision/beta_abs_mean"] > 0 for h in measured)
    assert 0 < measured[1]["precision/changed_share_at_sync"] <= 1  # the optimizer stepped: the shadow moved


def test_deepspeed_tensor_parallel_is_refused_at_attach(tmp_path):
    """DeepSpeed AutoTP layers hold a slice of each weight, which the shadow cannot take for the whole: one line at
    attach, naming the layer (one process; the layer is DeepSpeed's own class, its slicing not set up)."""
    from deepspeed.module_inject.layers import LinearLayer

    from phantomclip.integrations.trl import IntegrationError, PrecisionMonitor

    trainer = worker.make_trainer(str(tmp_path))
    layer = LinearLayer.__new__(LinearLayer)
    torch.nn.Module.__init__(layer)
    trainer.model.model.layers[0].self_attn.q_proj = layer
    with pytest.raises(IntegrationError, match=r"^the shadow cannot mirror DeepSpeed tensor parallelism \(LinearLayer "
                       r"at model\.layers\.0\.self_attn\.q_proj holds a slice of its weight\)"):
        PrecisionMonitor().attach(trainer)
