"""PrecisionMonitor and with_shadow_ratio on two processes (torchrun over gloo, CPU): the same figures on every rank,
equal to one process on the whole batch; the same gradients as one process; FSDP2 and FSDP1 shards mirrored.

The ranks run tests/trl_ranks_worker.py (one launch for every check, about 10 s); the one-process reference runs here
with the worker's own helpers, one thread as in the workers, on the same rows in the same chunks (two micro-batches
of B/2 rows: TRL's gradient accumulation over the global batch), so every forward has the shapes it has on a rank.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_close_eps, eps, run_ranks

pytest.importorskip("trl")

import trl_ranks_worker as worker  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    return run_ranks("trl_ranks_worker.py", out, WORLD, timeout=180)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return one_process_reference(tmp_path_factory)


def one_process_reference(tmp_path_factory) -> dict:
    """The whole global batch in one process: the monitor's per-token tensors of both halves, and the shadow-ratio
    gradients accumulated over them (gradient_accumulation_steps=2, so TRL's loss normalises by the whole batch)."""
    from trl import GRPOTrainer

    from phantomclip.integrations.trl import PrecisionMonitor, with_shadow_ratio

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tmp = tmp_path_factory.mktemp("one")
        batch = worker.global_batch()
        halves = [(r * worker.B // WORLD, (r + 1) * worker.B // WORLD) for r in range(WORLD)]
        monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
        trainer = worker.make_trainer(str(tmp / "m"), gradient_accumulation_steps=WORLD)
        monitor.attach(trainer)
        trainer.current_gradient_accumulation_steps = WORLD
        trainer.model.train()
        tensors = []
        for lo, hi in halves:
            trainer._compute_loss(trainer.model, worker.rows(batch, lo, hi, trainer))
            tensors.append(monitor.last_tensors)
        shadowed = worker.make_trainer(str(tmp / "s"), cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"),
                                       gradient_accumulation_steps=WORLD)
        shadowed.current_gradient_accumulation_steps = WORLD
        shadowed.model.train()
        losses = []
        for lo, hi in halves:
            loss = shadowed._compute_loss(shadowed.model, worker.rows(batch, lo, hi, shadowed))
            loss.backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in shadowed.model.named_parameters() if p.grad is not None}
    finally:
        torch.set_num_threads(threads)
    whole = [torch.cat([t[i] for t in tensors]) for i in range(4)]  # logp, logp_shadow, mask, advantages
    return {"tensors": whole, "grads": grads, "losses": losses}


def assert_figures_equal(got: dict, want: dict, beta_abs_max: float, tokens: int, what: str) -> None:
    """Counts, rates and the p99 are the same numbers (the same tokens, the same selection and interpolation); the
    means are float64 sums of the same fp32 differences in another order: each addition rounds by at most
    eps64/2 of the running sum (<= tokens * max|β|), so they agree to tokens * eps64 * max|β|."""
    assert set(want) <= set(got), (what, set(want) - set(got))
    for key, value in want.items():
        if key in ("beta_mean", "beta_abs_mean", "shadow_minus_engine_mean"):
            assert_close_eps(got[key], value, torch.float64, beta_abs_max, terms=tokens**2, factor=1.0,
                             name=f"{what} {key}")
        elif isinstance(value, float) and math.isnan(value):
            assert math.isnan(got[key]), (what, key, got[key])
        else:
            assert got[key] == value, (what, key, got[key], value)


def test_every_rank_logs_the_global_figures_of_one_process(ranks, one_process):
    from phantomclip.integrations.trl import precision_stats

    logp, logp_shadow, mask, adv = one_process["tensors"]
    want = precision_stats(logp, logp_shadow, mask, adv, 0.2, 0.2)
    beta = (logp - logp_shadow)[mask.bool()].abs()
    assert beta.max() > 0 and want["beta_abs_mean"] > 0  # an fp32 trainer against a bf16 shadow: a real gap
    for r, rank in enumerate(ranks):
        for kind in ("ddp", "fsdp2", "fsdp1"):
            assert_figures_equal(rank[f"{kind}_stats"], want, beta.max().item(), beta.numel(), f"rank {r} {kind}")
    # the ranks' local figures differ (each holds other rows), so a local figure would have been rank 0's alone
    local = [precision_stats(logp[lo:lo + 4], logp_shadow[lo:lo + 4], mask[lo:lo + 4], adv[lo:lo + 4], 0.2, 0.2)
             for lo in (0, 4)]
    assert local[0]["beta_abs_mean"] != local[1]["beta_abs_mean"]


def test_uneven_ranks_no_rows_and_nonfinite_values(ranks):
    """A rank without rows and a NaN / −inf on another neither hang nor skew: the figures are those of the
    concatenation, on both ranks."""
    from phantomclip.integrations.trl import precision_stats

    per_rank = worker.uneven_inputs(0, WORLD)
    whole = [torch.cat([p[i] for p in per_rank]) for i in range(4)]
    want = precision_stats(*whole, 0.2, 0.2)
    assert want["nonfinite"] == 2 and math.isfinite(want["beta_abs_p99"])
    for rank in ranks:
        assert_figures_equal(rank["uneven_stats"], want, 1.0, 15, "uneven")


def test_shadow_ratio_gradients_under_ddp_equal_one_process(ranks, one_process):
    """DDP averages the two ranks' gradients; one process accumulates the two halves. Each gradient entry is a sum
    over the batch's tokens in another order and scaling, so they agree to about eps32 * max|g| * sqrt(tokens)."""
    want = one_process["grads"]
    tokens = int(worker.global_batch()["num_items_in_batch"].item())
    assert ranks[0]["ddp_grads"].keys() == want.keys()
    for r, rank in enumerate(ranks):
        for name, g in want.items():
            assert g.abs().max() > 0, name
            assert_close_eps(rank["ddp_grads"][name], g, torch.float32, g.abs().max(), terms=tokens, factor=2.0,
                             name=f"rank {r} {name}")
    # TRL's dapo loss: each rank's half normalised by half the global token count, one process's by all of it
    total = sum(one_process["losses"])
    assert_close_eps(sum(rank["ddp_loss"] for rank in ranks) / WORLD, total, torch.float32, abs(total) + 1e-3,
                     terms=tokens, name="loss")


def test_shadow_ratio_runs_on_fsdp_shards_with_the_ddp_loss(ranks):
    """with_shadow_ratio on FSDP2 and FSDP1 shards: forward and backward run, and each rank's loss is the one DDP
    computes on the same rows (the same forward on gathered weights, the same shadow): equal to a few fp32 roundings
    of the loss's sum over the rank's tokens."""
    tokens = int(worker.global_batch()["num_items_in_batch"].item())
    for r, rank in enumerate(ranks):
        for kind in ("fsdp2", "fsdp1"):
            assert_close_eps(rank[f"{kind}_sr_loss"], rank["ddp_loss"], torch.float32, abs(rank["ddp_loss"]) + 1e-3,
                             terms=tokens, name=f"rank {r} {kind} loss")


def test_training_loop_logs_the_same_rows_on_every_rank(ranks):
    """3 steps of trainer.train() with interval 2: precision figures at the optimizer steps 0 and 2 (logged as steps
    1 and 3), none at step 2, identical on both ranks, and the trainer precision recorded first."""
    logs = [rank["train_log"] for rank in ranks]
    assert logs[0] == logs[1]
    assert logs[0][0]["precision/trainer_precision"] == "fp32" and logs[0][0]["precision/engine_dtype"] == "bfloat16"
    measured = [h["step"] for h in logs[0] if "precision/beta_abs_mean" in h]
    assert measured == [1, 3], logs[0]
    assert all(h["precision/beta_abs_mean"] > 0 for h in logs[0] if "precision/beta_abs_mean" in h)


def test_sharded_shadow_holds_a_whole_model_in_the_engine_dtype(ranks):
    from phantomclip.models.load import load_model

    n = sum(p.numel() for p in load_model(worker.MODEL).model.parameters())
    for rank in ranks:
        assert rank["fsdp2_shadow_bytes"] == rank["fsdp1_shadow_bytes"] == 2 * n  # bf16: 2 bytes a parameter
    assert eps(torch.bfloat16) == 2**-7  # (the dtype the shadow is in)
