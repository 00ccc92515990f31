import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import (
    MATMULS,
    as_written_before_run_ids,
    assert_close_eps,
    eps,
    forward_terms,
    fp32_forward_noise,
    report,
)
from phantomclip.maths.metrics import alpha_beta_stats, ratio_split
from phantomclip.precision.recipes import apply_recipe, forward_context, get_recipe
from phantomclip.precision.scoring import TrainerForward, position_ids_from_mask, score, score_completions
from phantomclip.runs.read import read_jsonl
from phantomclip.runs.rundir import RunDir
from phantomclip.training.tasks import TaskError
from phantomclip.training.trainer import (
    INTERVENTIONS,
    TrainConfig,
    TrainConfigError,
    resolve_plan,
    train,
)

# tiny-random:30 stops on its own in ~9% of 8-token completions: enough signal for reward = -length.
TINY = dict(model="tiny-random:30", max_tokens=8, prompts_per_step=2, lr=3e-3)


def _numbers(rows: list[dict]) -> list[dict]:
    """Metrics without wall-clock timings (the only part two identical runs may differ in)."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _same(a: list[dict], b: list[dict]) -> bool:
    nan_eq = lambda x, y: x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))  # noqa: E731
    return len(a) == len(b) and all(r.keys() == s.keys() and all(nan_eq(r[k], s[k]) for k in r) for r, s in zip(a, b))


# ------------------------------------------------------------------------------------------ interventions


def test_interventions_set_the_plan():
    base = TrainConfig()
    assert resolve_plan(base).trainer_recipe == "fp32" and resolve_plan(base).engine_recipe == "bf16"
    p = resolve_plan(TrainConfig(intervention="fp16"))
    assert (p.trainer_recipe, p.engine_recipe, p.loss_scaling) == ("fp16", "fp16", True)
    p = resolve_plan(TrainConfig(intervention="shadow-ratio, epsilon=0.3, tis"))
    assert (p.clip_on, p.eps_low, p.eps_high, p.correction) == ("shadow", 0.3, 0.3, "token_truncate")
    assert resolve_plan(TrainConfig(intervention="no-clip")).eps_high == math.inf
    assert resolve_plan(TrainConfig(intervention="force-r1")).ratio_against == "self"
    assert resolve_plan(TrainConfig(epsilon=0.1, epsilon_high=0.28)).eps_high == 0.28


@pytest.mark.parametrize(
    "intervention, message",
    [
        ("warp-drive", "unknown intervention 'warp-drive'"),
        ("match-bf16,fp16", "match-bf16 and fp16 conflict"),
        ("shadow-ratio,force-r1", "cannot be combined"),
        ("epsilon=abc", "needs a number"),
        ("epsilon=-1", "X must be a finite number > 0 and < 1"),
        ("correction=sideways", "unknown mode 'sideways'"),
    ],
)
def test_bad_interventions_are_refused(intervention, message):
    with pytest.raises(TrainConfigError, match=message):
        TrainConfig(intervention=intervention).validate()


@pytest.mark.parametrize("field, value",
                         [("staleness", -1), ("group_size", 1), ("engine_dtype", "fp8"), ("trainer", "int4")])
def test_bad_config_values_are_refused(field, value):
    with pytest.raises(TrainConfigError):
        TrainConfig(**{field: value}).validate()


# ------------------------------------------------------------------------------------------ decomposition


def _constructed_split(alpha, beta_kernel, beta_precision, logp_engine):
    """Log-prob tensors built from chosen parts: shadow_old = engine + β_kernel, shadow = shadow_old + α,
    logp = shadow + β_precision (all exact in fp32 for these short decimals to ~1e-7)."""
    logp_shadow_old = logp_engine + beta_kernel
    logp_shadow = logp_shadow_old + alpha
    logp = logp_shadow + beta_precision
    return ratio_split(logp, logp_shadow, logp_shadow_old, logp_engine)


def test_three_way_split_clip_accounting_on_constructed_tensors():
    # ε = 0.2: log bounds log 0.8 = -0.223, log 1.2 = 0.182. Five tokens of one sequence with A = +1:
    #   token 0: α = 0,    β_kernel = 0.3, β_precision = 0   -> log r 0.3 > 0.182: clipped; α alone would not: phantom
    #            (the kernel gap alone fired the clip; the old α = shadow − engine = 0.3 called this a real clip)
    #   token 1: α = 0.25, β_kernel = 0,   β_precision = 0   -> clipped, α alone clips: real
    #   token 2: α = 0,    β_kernel = 0.1, β_precision = 0.1 -> log r 0.2 > 0.182: clipped by β alone: phantom
    #   token 3: α = 0.1,  β_kernel = 0,   β_precision = 0.05 -> log r 0.15 inside: not clipped
    #   token 4: padding (mask 0), values must not count
    logp_engine = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -7.0]])
    alpha = torch.tensor([[0.0, 0.25, 0.0, 0.1, 0.0]])
    beta_kernel = torch.tensor([[0.3, 0.0, 0.1, 0.0, 9.0]])
    beta_precision = torch.tensor([[0.0, 0.0, 0.1, 0.05, 5.0]])
    split = _constructed_split(alpha, beta_kernel, beta_precision, logp_engine)
    mask = torch.tensor([[True, True, True, True, False]])
    clipped = (split["log_ratio"] > math.log(1.2)) & mask
    s = alpha_beta_stats(split, mask, torch.tensor([1.0]), clipped, torch.zeros_like(mask), eps_low=0.2,
                         eps_high=0.2)
    assert s["mismatch/tokens"] == 4
    assert s["clip/rate"] == pytest.approx(3 / 4)
    assert s["clip/phantom_rate"] == pytest.approx(2 / 4)
    assert s["clip/real_rate"] == pytest.approx(1 / 4)
    assert s["clip/phantom_adv_share"] == pytest.approx(2 / 4)  # |A| = 1 on each of 4 tokens
    assert s["clip/zeroed_adv_share"] == pytest.approx(3 / 4)
    assert s["adv/abs_sum"] == 4
    fp32_err = 1e-6  # the parts went through fp32 sums of magnitude <= 3: a few fp32 ulps (2^-23 * 4 = 5e-7)
    assert s["mismatch/alpha_mean"] == pytest.approx(0.35 / 4, abs=fp32_err)
    assert s["mismatch/beta_kernel_mean"] == pytest.approx(0.4 / 4, abs=fp32_err)
    assert s["mismatch/beta_precision_mean"] == pytest.approx(0.15 / 4, abs=fp32_err)
    assert s["mismatch/beta_mean"] == pytest.approx(0.55 / 4, abs=fp32_err)
    assert s["mismatch/beta_kernel_outside_trust_region"] == pytest.approx(1 / 4)  # token 0 (0.3)
    assert s["mismatch/beta_outside_trust_region"] == pytest.approx(2 / 4)  # tokens 0 (0.3) and 2 (0.2)
    assert s["mismatch/alpha_outside_trust_region"] == pytest.approx(1 / 4)  # token 1


def test_three_way_split_is_exact_per_token():
    """α + β_kernel + β_precision = log r token by token, and β = β_kernel + β_precision, in float64: on random
    fp32 log-probs of the size real ones have, the residual is float64 rounding of two additions (≤ 4 ulps of
    |log r|)."""
    g = torch.Generator().manual_seed(0)
    logp_engine = -torch.rand(64, 32, generator=g) * 12  # [B, T]
    logp_shadow_old = logp_engine + torch.randn(64, 32, generator=g) * 0.05
    logp_shadow = logp_shadow_old + torch.randn(64, 32, generator=g) * 0.1
    logp = logp_shadow + torch.randn(64, 32, generator=g) * 0.05
    split = ratio_split(logp, logp_shadow, logp_shadow_old, logp_engine)
    residual = split["alpha"] + split["beta_kernel"] + split["beta_precision"] - split["log_ratio"]
    bound = 4 * torch.finfo(torch.float64).eps * split["log_ratio"].abs().clamp_min(split["alpha"].abs())
    assert (residual.abs() <= bound).all(), report("identity", residual, torch.zeros_like(residual))
    assert torch.equal(split["beta"], split["beta_kernel"] + split["beta_precision"])
    assert split["alpha"].dtype == torch.float64


def _grouped_rollout(tiny, tiny_prompts, group=3):
    from phantomclip.engines.local import LocalEngine, SamplingParams

    prompts = [p for p in tiny_prompts[:2] for _ in range(group)]  # two groups of 3, prompts of different lengths
    return LocalEngine(tiny.model, torch.float32).generate(prompts, SamplingParams(max_tokens=6, seed=3))


@pytest.mark.parametrize("matmul", MATMULS)
def test_shared_prompt_scoring_matches_whole_rows(tiny, tiny_prompts, matmul):
    """score_completions (each group's prompt run once, KV cache repeated) against score() on whole rows."""
    rollout = _grouped_rollout(tiny, tiny_prompts)
    packed, P = rollout.pack(0), rollout.prompt_width
    T = packed["input_ids"].shape[1]
    for name in ("fp32", "bf16", "fp16"):
        recipe = get_recipe(name)
        model = apply_recipe(tiny.model, recipe, matmul)
        ids, attn, comp = packed["input_ids"], packed["attention_mask"], packed["completion_mask"]
        shared = score_completions(model, recipe, ids, attn, comp, P, 3)
        whole = score(model, recipe, ids, attn, comp).logp[:, P:]
        m = packed["completion_mask"][:, P:]
        assert torch.equal(shared[~m], torch.zeros_like(shared[~m]))
        with torch.no_grad(), forward_context(recipe):
            z = model(input_ids=packed["input_ids"], attention_mask=packed["attention_mask"],
                      position_ids=position_ids_from_mask(packed["attention_mask"])).logits.float()  # [B, T, V]
        scale = z[:, P - 1 : -1].abs().amax(-1)[m]  # max |logit| of the distribution scoring each completion token
        if name == "fp32":
            # Every matmul and the attention run on other shapes (prompts once per group, then the completions
            # against the cache): summation order only, through the whole forward (measured <= 0.1 of the bound)
            terms = forward_terms(tiny.model.config, T)
            assert_close_eps(shared[m], whole[m], torch.float32, scale, terms=terms, name=name)
            continue
        # In bf16/fp16 each layer rounds its fp32-accumulated output to the low dtype: where the two orders
        # straddle a rounding boundary an activation moves by one low-precision ulp, and that carries on into
        # the logits as a relative change of about eps_low (measured up to 0.7 eps_low * max|z| on AVX2 kernels,
        # 0 on AVX-512-BF16; on a third of the tokens). So |Δ log p| <= 2 eps_low * max|z| (z_t and logsumexp),
        # and the mean stays well under a flip per token: <= eps_low * mean max|z| / 2 (measured <= 0.15).
        low = recipe.compute_dtype
        assert_close_eps(shared[m], whole[m], low, scale, name=name)
        d = (shared - whole)[m].abs()
        assert d.mean() <= eps(low) * scale.mean() / 2, report(f"{name}: mean", shared[m], whole[m])


@pytest.mark.parametrize("matmul", MATMULS)
def test_trainer_forward_equals_the_inference_path_and_reaches_the_master(tiny, tiny_prompts, matmul):
    """The differentiable cast path (uncached emulated matmul, or the native kernels on weights cast inside the
    graph) gives the same log-probs as the inference path, bit for bit: the same weights (one rounding of the same
    master), the same kernels on the same shapes. And its gradient lands on the fp32 master weights."""
    master = tiny.model
    rollout = _grouped_rollout(tiny, tiny_prompts)
    packed, P = rollout.pack(0), rollout.prompt_width
    for name in ("bf16", "bf16-autocast", "fp32-head", "fp16", "fp32"):
        recipe = get_recipe(name)
        fwd = TrainerForward(master, recipe, matmul)
        logp = fwd.logprobs(packed, P, 3)
        ref = score_completions(apply_recipe(master, recipe, matmul), recipe, packed["input_ids"],
                                packed["attention_mask"], packed["completion_mask"], P, 3)
        assert torch.equal(logp.detach(), ref), report(name, logp.detach(), ref)
        (-logp.sum()).backward()
        grads = [p.grad for p in master.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), name
        assert all(g.dtype == torch.float32 for g in grads)
        assert sum(g.abs().sum().item() for g in grads) > 0
        master.zero_grad(set_to_none=True)


def test_shared_prompt_gradient_matches_whole_rows(tiny, tiny_prompts):
    """The gradient through the repeated KV cache equals the gradient of scoring whole rows (fp32: no low-precision
    matmul runs, so 'native' and 'emulated' are the same fp32 kernels and there is nothing to parametrize)."""
    master = tiny.model
    rollout = _grouped_rollout(tiny, tiny_prompts)
    packed, P = rollout.pack(0), rollout.prompt_width
    recipe = get_recipe("fp32")
    grads = []
    ids, attn, comp = packed["input_ids"], packed["attention_mask"], packed["completion_mask"]
    for shared in (True, False):
        if shared:
            logp = score_completions(master, recipe, ids, attn, comp, P, 3, grad=True)
        else:
            logp = score(master, recipe, ids, attn, comp, grad=True).logp
        (-logp.sum()).backward()
        grads.append({name: p.grad for name, p in master.named_parameters()})
        master.zero_grad(set_to_none=True)
    # Two fp32 computations of the same gradient in another summation order (other matmul shapes forward and
    # backward; oneDNN/MKL pick other kernels on each ISA). Each weight's gradient sums the contributions of the
    # N real token positions, each carrying the rounding of the forward and backward passes: per tensor,
    # |Δg| <= 2 eps * max|g| * sqrt(N). An absolute floor (the old atol 1e-5) is below that noise for large
    # tensors' near-zero entries: an AMX Xeon measured 3.1e-5 where max|g| = 37. Measured |Δg| / (eps * max|g|):
    # 7 on AVX-512-BF16, 8 on AVX2, 14 with SSE kernels, 7 on that Xeon; the bound is 2 sqrt(N) = 37.
    n_positions = int(packed["attention_mask"].sum())
    for name, g in grads[1].items():
        assert_close_eps(grads[0][name], g, torch.float32, g.abs().max(), terms=n_positions, name=f"grad {name}")


# ------------------------------------------------------------------------------------------ runs


@pytest.mark.parametrize("intervention",
                         [n for n in INTERVENTIONS if n not in ("epsilon", "correction", "r3")] + ["epsilon=0.1"])
def test_every_intervention_runs_with_finite_metrics(intervention):
    rows = train(TrainConfig(**TINY, steps=5, intervention=intervention)).metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    skip = {"mismatch/corr_beta_adv", "clip/zeroed_adv_share", "clip/phantom_adv_share"}  # NaN when all A = 0
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and k not in skip and not math.isfinite(v)}
        assert not bad, (intervention, r["step"], bad)
        # α + β = log r in the logged numbers: float64 means of ~100 values of size <= 10, each rounded at
        # 2^-53 relative, so the two sides differ by at most ~100 · 1.1e-16 · 10 ≈ 1e-13.
        parts = r["mismatch/alpha_mean"] + r["mismatch/beta_mean"]
        assert parts == pytest.approx(r["mismatch/log_ratio_mean"], abs=1e-12)
    if intervention in ("force-r1", "no-clip", "shadow-ratio"):
        assert all(r["clip/phantom_rate"] == 0 for r in rows)  # β never decides a clip
    if intervention == "force-r1":
        assert all(r["clip/rate"] == 0 for r in rows)
    if intervention in ("match-bf16", "fp16"):
        # same recipe: shadow == trainer bit for bit (TrainerForward == score_completions on the applied recipe,
        # test_trainer_forward_equals_the_inference_path_and_reaches_the_master)
        assert all(r["mismatch/beta_precision_abs_mean"] == 0 for r in rows)
        assert all(r["mismatch/beta_kernel_abs_mean"] > 0 for r in rows)  # but not the engine's kernels


@pytest.mark.parametrize("matmul", MATMULS)
def test_same_recipe_trainer_and_shadow_agree_under_both_matmuls(matmul):
    """match-bf16 with each low-precision kernel named: the trainer's bf16 forward is the shadow's, bit for bit, so
    β_precision is exactly 0 on every token; the engine's bf16 decode still differs from the prefill (β_kernel)."""
    rows = train(TrainConfig(**TINY, steps=2, intervention="match-bf16", matmul=matmul)).metrics
    assert all(r["mismatch/beta_precision_abs_mean"] == 0 and r["mismatch/beta_precision_abs_p99"] == 0 for r in rows)
    assert all(r["mismatch/beta_kernel_abs_mean"] > 0 for r in rows)


def test_neglen_converges_on_the_tiny_model_with_force_r1():
    """A real learning check: from ~8 tokens the policy learns to stop at once (mean length <= 2)."""
    rows = train(TrainConfig(**TINY, steps=30, intervention="force-r1")).metrics
    lengths = [round(r["completion/length_mean"], 1) for r in rows]
    assert lengths[0] > 7, lengths
    converged = [r["step"] for r in rows if r["task/converged"]]
    assert converged and converged[0] <= 30, lengths


def test_small_updates_are_invisible_to_the_bf16_engine(tmp_path, monkeypatch):
    """sync/changed_share: with lr 1e-9 no bf16 weight moves (an update must reach half a bf16 spacing, about
    |w|/256); with lr 3e-3 most do. (A reward that varies from the first step, so every step has a gradient.)"""
    (tmp_path / "varied.py").write_text("def first_token(prompts, completions, ids):\n"
                                        "    return [float(i[0] % 7) for i in ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(**TINY, steps=3, staleness=0, reward="varied:first_token")
    tiny_lr = train(TrainConfig(**{**vars(cfg), "lr": 1e-9})).metrics
    big_lr = train(cfg).metrics
    assert all(r["train/grad_norm"] > 0 for r in tiny_lr + big_lr)
    # Only weights within ~256 lr of zero can move: here exactly the zero-initialised padding row of the tied
    # embedding (64 values), against more than half of all weights with lr 3e-3.
    from phantomclip.models.load import load_model

    params = list(load_model(TINY["model"]).model.parameters())
    zero_share = sum(int((p == 0).sum()) for p in params) / sum(p.numel() for p in params)
    assert 0 < zero_share < 2e-3
    shares = [r["sync/changed_share"] for r in tiny_lr]
    assert shares[0] == zero_share and all(0 < x <= zero_share for x in shares), (shares, zero_share)
    assert all(r["sync/changed_share"] > 0.5 for r in big_lr), [r["sync/changed_share"] for r in big_lr]


def test_staleness_sets_the_weights_lag():
    rows = train(TrainConfig(**TINY, steps=4, staleness=2)).metrics
    assert [r["sync/weights_lag"] for r in rows] == [0, 1, 2, 2]  # batch k is sampled with θ_max(0, k-2)


def test_same_seed_same_run_and_resume_equals_uninterrupted(tmp_path):
    cfg = TrainConfig(**TINY, steps=5, staleness=1, checkpoint_every=2, intervention="recompute-old")
    full = train(cfg, out=tmp_path / "full").metrics
    again = train(cfg).metrics
    assert _same(_numbers(full), _numbers(again))
    first = train(TrainConfig(**{**vars(cfg), "steps": 3}), out=tmp_path / "split").metrics
    assert len(first) == 3
    resumed = train(cfg, out=tmp_path / "split", resume=True).metrics
    assert _same(_numbers(resumed), _numbers(full)), (_numbers(resumed)[-1], _numbers(full)[-1])
    assert _same(_numbers(RunDir(tmp_path / "split").metrics()), _numbers(full))  # null in the file reads as NaN


def test_a_failing_reward_names_the_function_and_keeps_the_run_valid(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def wrong_length(prompts, completions, ids):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match="wrong_length returned 1 values for 16"):
        train(TrainConfig(**TINY, steps=2, reward="bad_rewards:wrong_length"), out=tmp_path / "run")
    assert (tmp_path / "run" / "config.json").exists()
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == []


def _cli(out, *extra) -> list[str]:
    return [sys.executable, "-m", "phantomclip.cli.main", "train", "--model", TINY["model"], "--max-tokens", "8",
            "--prompts-per-step", "2", "--lr", "3e-3", "--steps", "40", "--checkpoint-every", "3", "--out", str(out),
            *extra]


def _wait_for_lines(path, n, proc, timeout=120):
    start = time.time()
    while time.time() - start < timeout:
        if len(read_jsonl(path)) >= n or proc.poll() is not None:
            return
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_or_interrupted_run_resumes_to_the_same_numbers(tmp_path, sig):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_cli(tmp_path / "run"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_lines(tmp_path / "run" / "metrics.jsonl", 5, proc)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    steps_logged = len(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert ckpt["step"] == steps_logged  # Ctrl-C: checkpoint at the last finished step
    else:
        assert proc.returncode == -signal.SIGKILL
        assert ckpt["step"] % 3 == 0 and ckpt["step"] <= steps_logged  # at most the steps since it are lost
    resumed = subprocess.run(_cli(tmp_path / "run", "--resume"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    full = subprocess.run(_cli(tmp_path / "full"), env=env, capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr
    a = _numbers(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    b = _numbers(read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert _same(a, b)


def test_token_log_matches_the_step_metrics(tmp_path):
    rows = train(TrainConfig(**TINY, steps=3, token_log_steps=2), out=tmp_path / "run").metrics
    tokens = read_jsonl(tmp_path / "run" / "tokens.jsonl")
    assert [t["step"] for t in tokens] == [1, 2]
    for t, r in zip(tokens, rows):
        n = len(t["alpha"])
        assert n == len(t["beta"]) == len(t["advantage"]) == len(t["clipped"]) > 0
        # the token log rounds each float64 value to 6 decimals (<= 5e-7); the means sum n values in float64
        for key in ("alpha", "beta"):
            big = max(abs(x) for x in t[key])
            tol = 5e-7 + 2 * eps(torch.float64) * big * n**0.5
            mean = r[f"mismatch/{key}_mean"]
            assert abs(sum(t[key]) / n - mean) <= tol, (key, sum(t[key]) / n, mean)
        assert sum(t["clipped"]) / n == pytest.approx(r["clip/rate"])


def test_split_runs_every_step_and_alpha_is_zero_on_policy():
    """The split is on by default. At step 1 the rollout's weights are the current ones: α = 0 exactly and
    β_kernel is the engine's whole decode-vs-prefill gap. At staleness 0, θ_old = θ_t at every step: α ≡ 0."""
    rows = train(TrainConfig(**TINY, steps=5)).metrics
    assert rows[0]["mismatch/alpha_abs_mean"] == 0
    assert rows[0]["mismatch/beta_kernel_abs_mean"] > 0  # bf16 decode vs bf16 prefill differ (tiny: about 1e-2)
    # Staleness 1: step k's α compares the shadow at θ_k with θ_{k−1}, both in bf16 with the same kernels, so it is
    # exactly 0 when step k−1's update changed no bf16 value, and nonzero when it changed some.
    moved = [r["sync/changed_share"] > 0 for r in rows[:-1]]
    assert [r["mismatch/alpha_abs_mean"] > 0 for r in rows[1:]] == moved and any(moved)
    for r in rows:  # the means add up as the tokens do (float64 sums of N values: N · eps relative)
        parts = r["mismatch/alpha_mean"] + r["mismatch/beta_kernel_mean"] + r["mismatch/beta_precision_mean"]
        assert parts == pytest.approx(r["mismatch/log_ratio_mean"], abs=1e-12)
    on_policy = train(TrainConfig(**TINY, steps=3, staleness=0)).metrics
    assert all(r["mismatch/alpha_abs_mean"] == 0 and r["clip/real_rate"] == 0 for r in on_policy)


def test_trainer_scores_at_the_sampling_temperature():
    """fp32 engine and fp32 trainer at temperature 0.7: log r is ~0 only if both divide the logits by 0.7."""
    cfg = TrainConfig(**{**TINY, "lr": 1e-9}, steps=2, staleness=0, temperature=0.7, engine_dtype="fp32")
    rows = train(cfg).metrics
    # fp32 decode against fp32 prefill of logits / 0.7: the fp32 noise of a reordered forward at 1/0.7 the logit
    # scale (context at most the model's positions). Scoring at temperature 1 instead would be off by ~0.1.
    from phantomclip.models.load import load_model

    model = load_model(TINY["model"]).model
    noise = fp32_forward_noise(model, model.config.max_position_embeddings) / 0.7
    assert all(abs(r["mismatch/log_ratio_mean"]) <= noise and r["mismatch/beta_abs_mean"] <= noise for r in rows), (
        noise, rows)


def test_icepop_bounds_reach_the_correction_and_old_runs_resume_without_them(tmp_path):
    """--icepop-low/--icepop-high set the band IcePop masks outside of: a band of ±0.1% around 1 masks most tokens
    (π/μ carries the bf16 gap, mean |β| ~1e-2 here), the default [0.5, 2] almost none. A run written before the
    fields existed (no such keys in config.json) resumes as if they had their defaults."""
    import json

    narrow = train(TrainConfig(**TINY, steps=2, intervention="icepop", icepop_low=0.999, icepop_high=1.001)).metrics
    wide = train(TrainConfig(**TINY, steps=2, intervention="icepop")).metrics
    assert narrow[0]["clip/masked_rate"] > 0.5 > wide[0]["clip/masked_rate"]
    with pytest.raises(TrainConfigError, match="icepop"):
        TrainConfig(icepop_low=1.5).validate()
    train(TrainConfig(**TINY, steps=1), out=tmp_path / "old")
    cfg_path = tmp_path / "old" / "config.json"
    old = {k: v for k, v in json.loads(cfg_path.read_text()).items() if not k.startswith("icepop")}
    cfg_path.write_text(json.dumps(old))
    as_written_before_run_ids(tmp_path / "old")  # nor did its rows carry run/id
    assert len(train(TrainConfig(**TINY, steps=2), out=tmp_path / "old", resume=True).metrics) == 2


def test_kept_snapshots_round_trip_bit_exactly(tmp_path):
    """--keep-snapshots 2 over 4 steps: weights at steps 0, 2, 4 (safetensors), the tokens sampled with θ_0 and θ_2;
    the last snapshot equals the checkpoint's master weights bit for bit."""
    from safetensors.torch import load_file

    cfg = TrainConfig(**{**TINY, "steps": 4, "keep_snapshots": 2})
    rows = train(cfg, out=tmp_path / "run").metrics
    snaps = tmp_path / "run" / "snapshots"
    assert sorted(p.name for p in snaps.iterdir()) == [
        "step-000000.safetensors", "step-000000.tokens.json", "step-000002.safetensors", "step-000002.tokens.json",
        "step-000004.safetensors"]
    master = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["master"]
    last = load_file(snaps / "step-000004.safetensors")
    assert last.keys() <= master.keys() and all(torch.equal(last[k], master[k]) for k in last)
    first = load_file(snaps / "step-000000.safetensors")
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the weights moved
    tokens = json.loads((snaps / "step-000002.tokens.json").read_text())
    assert tokens["step"] == 2 and tokens["batch"] == 3  # staleness 1: batch 3 is the first sampled with θ_2
    assert len(tokens["completion_ids"]) == 2 * 8 and len(rows) == 4  # prompts_per_step x group_size
    with pytest.raises(TrainConfigError, match="--keep-snapshots writes into the run directory: give --out"):
        train(TrainConfig(**{**TINY, "keep_snapshots": 2}))


def test_four_way_split_with_an_fp8_engine_adds_up_exactly():
    """With an FP8 engine β_precision splits into β_quant (the unquantised shadow − the FP8 shadow) and the rest. Each
    part is a difference of two fp32 values, exact in float64, and every partial sum α, α + β_kernel, ... in this order
    is again such a difference (the sum telescopes), so each addition is exact: the parts add up bit for bit."""
    g = torch.Generator().manual_seed(1)
    logp_engine = -torch.rand(64, 32, generator=g) * 12  # [B, T]
    logp_shadow_old = logp_engine + torch.randn(64, 32, generator=g) * 0.05
    logp_shadow = logp_shadow_old + torch.randn(64, 32, generator=g) * 0.1
    logp_plain = logp_shadow + torch.randn(64, 32, generator=g) * 0.05
    logp = logp_plain + torch.randn(64, 32, generator=g) * 0.05
    split = ratio_split(logp, logp_shadow, logp_shadow_old, logp_engine, logp_plain)
    total = split["alpha"] + split["beta_kernel"] + split["beta_quant"] + split["beta_precision"]
    assert torch.equal(total, split["log_ratio"])
    assert torch.equal(split["beta_quant"] + split["beta_precision"], logp.double() - logp_shadow.double())
    assert torch.equal(split["beta_quant"], logp_plain.double() - logp_shadow.double())


def test_training_with_an_fp8_engine_logs_beta_quant(tmp_path):
    """The engine samples in bf16+fp8-w8a8+fp8-kv, the shadow runs the same recipe, β_quant is logged every step
    and tokens.jsonl carries it per token; a run without FP8 logs no such key."""
    import json

    cfg = TrainConfig(**TINY, steps=2, engine_quant="fp8-w8a8,fp8-kv", token_log_steps=1)
    assert resolve_plan(cfg).engine_recipe == "bf16+fp8-w8a8+fp8-kv"
    assert resolve_plan(TrainConfig(intervention="fp16", engine_quant="fp8-w8a16")).engine_recipe == "fp16+fp8-w8a16"
    rows = train(cfg, out=tmp_path / "run").metrics
    for r in rows:
        assert math.isfinite(r["mismatch/beta_quant_abs_mean"]) and r["mismatch/beta_quant_abs_mean"] > 0
    tokens = json.loads((tmp_path / "run" / "tokens.jsonl").read_text().splitlines()[0])
    assert len(tokens["beta_quant"]) == len(tokens["beta"])
    assert "mismatch/beta_quant_mean" not in train(TrainConfig(**TINY, steps=1)).metrics[0]
    with pytest.raises(TrainConfigError, match="--engine-quant"):
        TrainConfig(**TINY, engine_quant="fp8-w8a8,fp8-block").validate()
