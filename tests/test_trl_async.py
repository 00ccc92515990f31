"""AsyncPrecisionMonitor and with_async_shadow_ratio inside TRL 1.16's real AsyncGRPOTrainer on CPU: its queue,
staleness filter, planner, tree packing, collator and compute_loss, with the bf16 LocalEngine standing in for the
vLLM server (integrations.trl_async_cpu) and the tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import assert_close_eps, eps

pytest.importorskip("trl")

import trl_async_setup as setup  # noqa: E402
from phantomclip.integrations.trl_async.monitor import (  # noqa: E402
    AsyncPrecisionMonitor,
    IntegrationError,
    async_figures,
    async_precision_stats,
    with_async_shadow_ratio,
)


def _rows(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "precision/beta_abs_mean" in h]


def test_cpu_tree_attention_equals_the_plain_forward(tmp_path):
    """TRL's packing of a group (a shared prompt, completions that share and then leave a prefix) through TRL's
    tree_attention with the CPU kernel gives each sample's log-probs as a plain forward of that sample alone."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention
    from trl.trainer.utils import add_fused_lm_head

    from phantomclip.integrations.trl_async.cpu import use_cpu_stand_ins
    from phantomclip.integrations.trl_async.forward import packed_forward

    register_tree_attention()
    use_cpu_stand_ins()
    path = setup.model_dir(str(tmp_path))
    packed_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=TREE_ATTENTION).eval()
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    add_fused_lm_head(packed_model)
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12, 13], [5, 6, 7, 20], [30, 31, 32]]  # 3 share a 4-token prompt
    row = TreeRow()
    for i, s in enumerate(seqs):
        mask = [0, 0, 0] + [1] * (len(s) - 3)
        row.add({"input_ids": torch.tensor(s), "completion_mask": torch.tensor(mask), "group_id": 0,
                 "old_log_probs": torch.zeros(len(s)), "advantage": 1.0})
    p = row.pack()
    inputs = {k: v.unsqueeze(0) for k, v in p.items()}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    kwargs, token_index, _ = packed_forward(inputs)
    assert kwargs["input_ids"].shape[1] < sum(map(len, seqs))  # the shared prefix is forwarded once
    with torch.no_grad():
        got = packed_model(**kwargs, fused_lm_head=True).log_probs.flatten()[token_index]  # [M]
        want = []
        for s in seqs:
            logits = plain(torch.tensor([s])).logits[0].float()  # [T, V]
            lp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(s[1:])[:, None])[:, 0]  # [T-1]
            want.append(lp[2:])  # the completion tokens (positions 3..)
    want = torch.cat(want)
    # the same fp32 forward in another attention layout and another head (TRL's chunked log-softmax): roundings of
    # sums over the hidden size (64) and the vocabulary (320) of values of size |logp| + a few
    assert_close_eps(got, want, torch.float32, want.abs() + 4, terms=320, factor=4.0, name="packed vs plain")


def test_shadow_head_on_labelled_rows_equals_trls_full_row_head():
    """The shadow forward scores only the labelled positions (in blocks of HEAD_ROWS_CPU on a CPU) and gives, bit for
    bit, what TRL's fused forward of the whole packed row gives on a CPU, where TRL scores every position: at the
    bundled model's widths (hidden 576, 9/3 heads, MLP 1536, a tied 49152-token head: TRL's head in two vocabulary
    chunks) with 2 random layers (depth does not change the head's products), a row of a 38-token prompt and 8
    completions of 5-32 tokens, some sharing a prefix. Exact, not within a tolerance: each row's bf16 logits are
    those of its own dot products whatever the other rows of the product, and TRL's log-softmax fold is per row.
    Measured so before relying on it, on the bundled model's real weights and a row like this one (2-core EPYC,
    avx512_bf16): oneDNN's brgemm, its fallback under ONEDNN_MAX_CPU_ISA=AVX2 and ATen's gemm with mkldnn off each
    gave equal log-probs at 1-301 rows, at 1 and 2 threads."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention
    from trl.trainer.utils import add_fused_lm_head

    from phantomclip.integrations.trl_async.cpu import use_cpu_stand_ins
    from phantomclip.integrations.trl_async.forward import HEAD_ROWS_CPU, packed_forward, score_labelled
    from phantomclip.integrations.weights import build_shadow, sync_shadow

    register_tree_attention()
    use_cpu_stand_ins()
    torch.manual_seed(0)
    vocab = 49152
    config = LlamaConfig(vocab_size=vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    master = LlamaForCausalLM(config).eval()
    shadow = build_shadow(master, "bfloat16", "cpu")
    sync_shadow(shadow, master)
    shadow.set_attn_implementation(TREE_ATTENTION)
    add_fused_lm_head(shadow)
    shadow.eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (38,), generator=g).tolist()
    row, previous = TreeRow(), []
    for i in range(8):
        n = int(torch.randint(5, 33, (1,), generator=g))
        completion = torch.randint(0, vocab, (n,), generator=g).tolist()
        if i % 3 == 1:  # shares its first 3 tokens with the previous completion: a branch inside the completions
            completion = previous[:3] + completion[3:]
        previous = completion
        row.add({"input_ids": torch.tensor(prompt + completion), "completion_mask": torch.tensor([0] * 38 + [1] * n),
                 "group_id": 0, "old_log_probs": torch.zeros(38 + n), "advantage": 1.0})
    inputs = {k: v.unsqueeze(0) for k, v in row.pack().items()}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    kwargs, token_index, _ = packed_forward(inputs)
    labelled = int((kwargs["shift_labels"] != -100).sum())
    n_rows = kwargs["input_ids"].shape[1]
    # several head calls, the last one partial; unlabelled positions left out; the head in two vocabulary chunks
    assert labelled > HEAD_ROWS_CPU and labelled % HEAD_ROWS_CPU != 0 and n_rows > labelled and vocab > 32768
    with torch.no_grad():
        full = shadow(**kwargs, fused_lm_head=True).log_probs.float()  # [1, N] TRL's head on every position
    got = score_labelled(shadow, kwargs)  # [1, N]
    assert torch.equal(got, full)
    assert torch.equal(got.flatten()[token_index], full.flatten()[token_index]) and token_index.numel() > labelled


def test_monitor_on_the_real_async_trainer(tmp_path):
    """3 steps, one group a step, two groups sampled per fill: staleness at the loss 0, 1, 1 (the group sampled with
    the step's weights, then the fill's second group a version late; the next fill happens while the previous
    step's batch is prefetched, one sync before it trains). Figures equal the stats function on the last batch's
    tensors; the old-version shadow holds the weights TRL sent as that version, not today's; training is unchanged
    by the monitor."""
    from phantomclip.integrations.trl_async.forward import score_labelled
    from phantomclip.integrations.weights import build_shadow

    plain, _ = setup.make_trainer(str(tmp_path / "a"), steps=3)
    plain.train()
    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    sent = {}
    watched, engine = setup.make_trainer(str(tmp_path / "b"), callbacks=[monitor], steps=3)
    send = watched.weight_transfer.send_weights

    def keep_and_send(it):  # what TRL streams as version model_version + 1 (TRL bumps the version after sending)
        sent[watched.model_version + 1] = {n: t.clone() for n, t in it}
        send(iter(sent[watched.model_version + 1].items()))

    watched.weight_transfer.send_weights = keep_and_send
    watched.train()
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(watched)  # the monitor changes nothing: same seeds, same numbers
    rows = _rows(watched)
    assert len(rows) == 3
    stale = [[k for k in range(3) if r[f"precision/staleness_share_{k}"] == 1.0] for r in rows]
    assert stale == [[0], [1], [1]], stale
    assert rows[0]["precision/alpha_abs_mean"] == 0.0  # staleness 0, weight_sync_steps 1: α is exactly zero
    assert all(r["precision/beta_abs_mean"] > 0 for r in rows)  # fp32 trainer vs bf16 engine: a real gap
    assert rows[-1]["precision/beta_kernel_abs_mean"] > 0  # the engine's decode kernels against the packed forward
    # the last row equals the stats function on the last batch's tensors (one micro-batch a step: TRL's window
    # reduction of one (sum, count) pair is sum / count)
    rec = watched._pc_async.last
    want = async_figures(async_precision_stats(rec.logp, rec.logp_engine, rec.logp_shadow, rec.logp_shadow_old,
                                         rec.advantages, rec.staleness, eps_low=0.2, eps_high=0.2,
                                         max_staleness=2))
    for key, value in want.items():
        assert math.isclose(rows[-1][f"precision/{key}"], value, rel_tol=1e-12, abs_tol=1e-15), key
    # versions 1 (initial sync) to 4 (after step 3) were sent; the last step trained version 2's samples at 3
    shadows = watched._pc_async.stores["engine"]
    assert sorted(sent) == [1, 2, 3, 4] and rec.versions.unique().tolist() == [2] and rec.staleness.max() == 1
    assert sorted(shadows.versions) == [1, 2, 3, 4]  # staleness bound (max_staleness 2 + prefetch 1) + 1 kept
    for name, p in shadows.versions[4].named_parameters():  # the weights sent as 4, rounded to bf16
        assert torch.equal(p, sent[4][name].to(torch.bfloat16)), name
    # keyed by version: the old log-probs are those of the weights TRL sent as version 2, rounded to bf16, on the
    # same packed row (a shadow built apart and filled from what was sent: bit for bit); version 3's differ
    for v, equal in ((2, True), (3, False)):
        apart = build_shadow(watched.model, "bfloat16", "cpu")
        with torch.no_grad():
            for name, p in apart.named_parameters():
                p.copy_(sent[v][name])
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(apart, temperature=watched.temperature)
        scored = score_labelled(apart.eval(), rec.row).flatten()[rec.token_index]
        assert torch.equal(scored, rec.logp_shadow_old) == equal, v


@pytest.mark.parametrize("ratio", ["shadow", None])
def test_shadow_ratio_leaves_staleness_zero_ratios_at_one(tmp_path, ratio):
    """With the fix, a batch trained at its sampling version has α = 0 exactly: TRL's logged ratio is 1 and no
    clip fires, whatever β is (the trainer's first step). None: the default ratio ("trust-region": the old side is
    the same no-grad forward of the same weights as the current side at staleness 0)."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    cls = with_async_shadow_ratio(AsyncGRPOTrainer, **({"ratio": ratio} if ratio else {}))
    trainer, _ = setup.make_trainer(str(tmp_path / "z"), cls=cls, steps=1, epsilon=0.001)
    trainer.train()
    row = next(h for h in trainer.state.log_history if "ratio" in h)
    assert row["ratio"] == 1.0 and row["clip_ratio/region_mean"] == 0.0 and row["kl"] == 0.0


def test_async_stats_on_constructed_tensors():
    # ε = 0.2 (log bounds −0.223 / +0.182). Tokens: α = [0, 0, 0.3, 0.1], β_precision = [0.25, −0.3, 0, 0],
    # β_kernel = [0, 0, 0, 0.1]; A = [+1, −1, +1, +1]; staleness [0, 0, 1, 2]; plus one token without a shadow
    # (staleness 3, over max_staleness 2: trained after the prefetch's sync) and one whose engine log-prob is NaN.
    shadow_old = torch.tensor([-1.0, -2.0, -3.0, -1.5, -2.0, -1.0])
    shadow = shadow_old + torch.tensor([0.0, 0.0, 0.3, 0.1, 0.0, 0.0])
    logp = shadow + torch.tensor([0.25, -0.3, 0.0, 0.0, 0.0, 0.0])
    engine = shadow_old - torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    shadow_old[4] = math.nan  # its version has no shadow
    engine[5] = math.nan
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    s = async_figures(async_precision_stats(logp, engine, shadow, shadow_old, adv, torch.tensor([0, 0, 1, 2, 3, 0]),
                                            eps_low=0.2, eps_high=0.2, max_staleness=2))
    tol = 4 * eps(torch.float32) * 3  # each value one fp32 rounding of numbers below 3.3
    assert (s["no_shadow_total"], s["nonfinite_total"]) == (1, 1)
    assert s["alpha_mean"] == pytest.approx(0.4 / 4, abs=tol)
    assert s["beta_mean"] == pytest.approx((0.25 - 0.3 + 0.1) / 4, abs=tol)
    assert s["beta_abs_mean"] == pytest.approx(0.65 / 4, abs=tol)
    # TRL's ratio log r = α + β: [0.25, −0.3, 0.3, 0.2]; fires with A: +0.25 (A > 0) yes, −0.3 (A < 0) yes,
    # 0.3 yes, 0.2 yes (> 0.182); on α alone: only 0.3 -> 4 clips, 1 real, 3 phantom
    assert (s["clip_rate"], s["alpha_clip_rate"], s["phantom_rate"]) == (1.0, 0.25, 0.75)
    # staleness over all 6 trained tokens, those without a figure included: [0, 0, 1, 2, 3, 0]
    shares = (s["staleness_share_0"], s["staleness_share_1"], s["staleness_share_2"], s["staleness_share_over"])
    assert shares == (3 / 6, 1 / 6, 1 / 6, 1 / 6)
    # |β| sorted [0, 0.1, 0.25, 0.3]: position 0.99 × 3 = 2.97, 0.25 + 0.97 × 0.05 (torch.quantile's linear rule)
    assert s["beta_abs_p99"] == pytest.approx(0.25 + 0.97 * 0.05, abs=tol)


def test_bad_input(tmp_path, monkeypatch):
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    import phantomclip.integrations.trl_async.checks as checks
    import phantomclip.integrations.trl_async.forward as forward
    import phantomclip.integrations.trl_async.monitor as integration

    with pytest.raises(IntegrationError, match="interval must be an integer >= 1"):
        AsyncPrecisionMonitor(interval=0)
    with pytest.raises(IntegrationError, match="wraps AsyncGRPOTrainer"):
        with_async_shadow_ratio(dict)
    with pytest.raises(IntegrationError, match="unknown dtype"):
        AsyncPrecisionMonitor(engine_dtype="fp8")
    trainer, _ = setup.make_trainer(str(tmp_path / "x"), steps=1)
    # shadows that do not fit: one line with the need and what is available
    monkeypatch.setattr(checks, "available_memory", lambda device: 10_000)
    with pytest.raises(IntegrationError) as e:
        AsyncPrecisionMonitor().attach(trainer)
    kept, per = integration.shadow_memory(trainer, "bfloat16")
    # fixed-count planner, no accumulation, a sync every step: staleness bound 2 + 1, one copy per version 0 .. 3
    assert kept == 4 and per == 2 * sum(p.numel() for p in trainer.model.parameters())
    assert "need" in str(e.value) and "staleness bound 3 = max_staleness 2 + prefetch" in str(e.value)
    assert "\n" not in str(e.value)
    monkeypatch.undo()
    # a newer TRL whose trainer lacks what the hooks read: one line naming it, before anything is replaced
    monkeypatch.delattr(AsyncGRPOTrainer, "_sync_weight")
    with pytest.raises(IntegrationError, match="AsyncGRPOTrainer has no method '_sync_weight'"):
        AsyncPrecisionMonitor().attach(trainer)
    monkeypatch.undo()
    del trainer.model_version
    with pytest.raises(IntegrationError, match="has no attribute 'model_version'"):
        AsyncPrecisionMonitor().attach(trainer)
    assert "_pc_async" not in trainer.__dict__
    # a fused head without what the shadow forward reads off it (a newer TRL): one line naming it
    with pytest.raises(IntegrationError, match="fused head has no 'backbone_attr'"):
        forward.fused_head(nn.Linear(2, 2))
    # a GRPOTrainer is not an async trainer; one monitor per trainer
    with pytest.raises(IntegrationError, match="not dict"):
        AsyncPrecisionMonitor().attach({})


def test_weights_that_move_between_syncs(tmp_path):
    """weight_sync_steps 2: the second step trains a sample of the version synced at the start (staleness 0) with
    weights one optimizer step newer, so α is measured against a separate copy of the current weights (one more
    shadow kept, counted in the memory check), not the version's."""
    from phantomclip.integrations.trl_async.monitor import shadow_memory

    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer, _ = setup.make_trainer(str(tmp_path / "w"), callbacks=[monitor], steps=2, weight_sync_steps=2)
    # staleness bound: max_staleness 2 + ⌈1 / (1 · 2)⌉ = 3, so 4 versions, and the current weights
    assert shadow_memory(trainer, "bfloat16")[0] == 4 + 1
    trainer.train()
    rows = _rows(trainer)
    assert [r["precision/staleness_share_0"] for r in rows] == [1.0, 1.0]
    assert rows[0]["precision/alpha_abs_mean"] == 0.0 and rows[1]["precision/alpha_abs_mean"] > 0
    shadows = trainer._pc_async.stores["engine"]
    assert shadows.current is not None and sorted(shadows.versions) == [1, 2]


@pytest.mark.parametrize("sync_steps", [1, 2])
def test_shadow_path_equals_the_reference_path(tmp_path, sync_steps):
    """The monitor's shadows (filled in place by copy_, recycled, scored under inference_mode) give per token the same
    α and β, bit for bit, as the plain path they replaced: a new bf16 copy per forward, each weight cast by .to()
    then copied (weights.sync_shadow), scored under no_grad. On every measured step, at staleness 0 and 1
    (`sync_steps` 1), and with weights one optimizer step past the last sync (`sync_steps` 2: today's shadow is a
    separate copy)."""
    from trl.trainer.utils import add_fused_lm_head

    from phantomclip.integrations.weights import build_shadow, sync_shadow

    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    trainer, _ = setup.make_trainer(str(tmp_path / "r"), callbacks=[monitor], steps=3, weight_sync_steps=sync_steps)
    sent, checked = {}, []
    send = trainer.weight_transfer.send_weights

    def keep_and_send(it):  # what TRL streams as version model_version + 1
        sent[trainer.model_version + 1] = {n: t.clone() for n, t in it}
        send(iter(sent[trainer.model_version + 1].items()))

    def reference(weights: dict | None) -> nn.Module:
        shadow = build_shadow(trainer.model, "bfloat16", "cpu")
        if weights is None:  # today's weights, as the replaced path read them
            sync_shadow(shadow, trainer.model)
        else:
            with torch.no_grad():
                for name, p in shadow.named_parameters():
                    p.copy_(weights[name].to(p.dtype))
        add_fused_lm_head(shadow, temperature=trainer.temperature)
        return shadow.eval()

    record = monitor._record

    def check_then_record(rec):  # inside the loss, before the optimizer step: the model holds θ_t
        with torch.no_grad():
            now = reference(None)(**rec.row, fused_lm_head=True).log_probs.float().flatten()[rec.token_index]
            old = torch.empty_like(now)
            for v in rec.versions.unique().tolist():
                at = rec.versions == v
                full = reference(sent[v])(**rec.row, fused_lm_head=True).log_probs.float().flatten()
                old[at] = full[rec.token_index][at]
        alpha, alpha_ref = rec.logp_shadow - rec.logp_shadow_old, now - old  # [M]
        beta, beta_ref = rec.logp - rec.logp_engine - alpha, rec.logp - rec.logp_engine - alpha_ref  # [M]
        checked.append((torch.equal(rec.logp_shadow, now), torch.equal(rec.logp_shadow_old, old),
                        torch.equal(alpha, alpha_ref), torch.equal(beta, beta_ref), int(rec.staleness.max())))
        record(rec)

    trainer.weight_transfer.send_weights = keep_and_send
    monitor._record = check_then_record
    trainer.train()
    assert [c[:4] for c in checked] == [(True,) * 4] * 3, checked
    stale = [c[4] for c in checked]
    assert stale == ([0, 1, 1] if sync_steps == 1 else [0, 0, 1]), stale
    if sync_steps == 2:
        assert trainer._pc_async.stores["engine"].current is not None
