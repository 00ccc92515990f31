"""The async fix's ratio, compared (integrations.trl_async_ratio): TRL's own ratio ("trl", no fix), "shadow" (α from
two bf16 copies), "trainer" (α in the trainer's fp32) and "decoupled" (AReaL/verl decoupled PPO), each trained in
TRL 1.16's real AsyncGRPOTrainer on the bundled SmolLM2-135M (fp32 trainer, the bf16 LocalEngine standing in for the
vLLM server: integrations.trl_async_cpu), reward −length, 8 completions of up to 64 tokens per step, two groups
sampled per fill (staleness 0, 1, 1, 2, 1, 2, ...), lr 1e-4, ε 0.2, max_staleness 2, one thread.

Every run measures, on its own trained tokens, each ratio's clip decision against the clip on the policy's move in
the trainer's precision (the reference: exp(logp(θ_t) − logp(θ_v)), both fp32 forwards of the trainer's code, the
old side from an fp32 copy of version v's weights), and the bf16 α's error against it; and it records the mean
completion length of every group sampled (learning). Paired by seed: the same seed draws the same prompts and, for
the first step, the same completions in every arm.

Run: nice -n 15 python bench/experiments/exp_async_ratio.py [--out results/trl-async-ratio] [--steps 14] [--seeds 3]
(rerun to continue: each finished run is one JSON file, written atomically; a killed run restarts from its start;
each run is its own process: a trainer's memory, about 6 GB here with its copies, is returned when it ends);
--summary only reads what is there and prints the comparison.

Writes one JSON per arm and seed and summary.json under --out (results/trl-async-ratio), which docs/results.md "The
async fix's ratio, compared over seeds" and docs/trl.md "The async trainer: monitor and fix" (why "decoupled" is the
default) read.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # the cost bench, a helper here
from bench_trl_async_monitor import cpu_kind  # noqa: E402  (the same CPU line as the cost bench)

ARMS = ("trl", "shadow", "trainer", "decoupled")
DECISIONS = ("trl", "shadow", "trainer", "decoupled")
"""whose clip decision is held against the reference on every token: TRL's exp(α + β), exp(α_bf16), exp(α_fp32)
(the reference itself: a check), decoupled PPO's exp(logp − π_prox) = 1 (never fires with one step per sample)."""
FINAL_GROUPS = 4
"""final length: the mean completion length of the last FINAL_GROUPS groups sampled (the last two fills); beside it
the mean length over every group the run sampled (the whole run, no window chosen)."""
EPS = 0.2


def token_counts(rec, eps: float = EPS) -> dict[str, float]:
    """One micro-batch's counts: tokens with every log-prob finite, the reference's clips, each decision's
    disagreements with it, and sums for the bf16 α's error and its two roundings' correlation (stale tokens)."""
    import torch

    from phantomclip.maths.metrics import phantom_clip_mask

    ok = torch.ones_like(rec.logp, dtype=torch.bool)  # [M]
    for x in (rec.logp, rec.logp_engine, rec.logp_shadow, rec.logp_shadow_old, rec.logp_trainer_old):
        ok &= torch.isfinite(x)
    lp, mu, now16, old16, old32 = (x.double()[ok] for x in (rec.logp, rec.logp_engine, rec.logp_shadow,
                                                             rec.logp_shadow_old, rec.logp_trainer_old))
    adv, stale = rec.advantages.double()[ok], rec.staleness[ok]
    alpha32, alpha16 = lp - old32, now16 - old16  # [n] the policy's move in fp32, in bf16
    reference = phantom_clip_mask(alpha32, adv, eps, eps)
    fires = {"trl": phantom_clip_mask(lp - mu, adv, eps, eps), "shadow": phantom_clip_mask(alpha16, adv, eps, eps),
             "trainer": reference.clone(), "decoupled": torch.zeros_like(reference)}
    x, y = (now16 - lp)[stale > 0], (old16 - old32)[stale > 0]  # the bf16 roundings at θ_t and at θ_v
    out = {"tokens": float(ok.sum()), "stale_tokens": float((stale > 0).sum()),
           "reference_clips": float(reference.sum()), "alpha32_abs_sum": float(alpha32.abs()[stale > 0].sum()),
           "alpha_err_abs_sum": float((alpha16 - alpha32).abs()[stale > 0].sum()),
           "corr_sums": [float(v) for v in (x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum())]}
    out.update({f"disagree_{k}": float((v != reference).sum()) for k, v in fires.items()})
    return out


def build(arm: str, seed: int, steps: int, out_dir: str, lengths: list):
    import torch
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from phantomclip.engines.local import LocalEngine
    from phantomclip.integrations.trl_async.cpu import LocalRolloutWorker, LocalWeightTransfer, use_cpu_stand_ins
    from phantomclip.integrations.trl_async.monitor import AsyncPrecisionMonitor, with_async_shadow_ratio
    from phantomclip.models.load import load_model
    from phantomclip.models.prompts import bundled_prompts

    use_cpu_stand_ins()
    lm = load_model("smollm2-135m")
    engine = LocalEngine(copy.deepcopy(lm.model), torch.bfloat16)

    def neglen(prompts, completions, ids):
        lengths.append({"version": worker.model_version, "length": sum(map(len, ids)) / len(ids)})
        return [-float(len(c)) for c in ids]

    worker = LocalRolloutWorker(engine, lm.tokenizer, bundled_prompts(), neglen, num_generations=8, max_tokens=64,
                                groups_per_fill=2, seed=seed)
    cls = AsyncGRPOTrainer if arm == "trl" else with_async_shadow_ratio(AsyncGRPOTrainer, ratio=arm)
    config = AsyncGRPOConfig(output_dir=out_dir, per_device_train_batch_size=8, num_generations=8,
                             max_completion_length=64, learning_rate=1e-4, max_steps=steps, logging_steps=1,
                             report_to=[], save_strategy="no", bf16=False, use_cpu=True, token_budget=0,
                             max_staleness=2, seed=seed)
    monitor = AsyncPrecisionMonitor(engine_dtype="bfloat16", epsilon=EPS)
    trainer = cls(model=lm.path, args=config, reward_funcs=[], processing_class=lm.tokenizer,
                  train_dataset=Dataset.from_dict({"prompt": bundled_prompts()}), rollout_worker=worker,
                  weight_transfer=LocalWeightTransfer(engine), callbacks=[monitor])
    trainer._pc_async.want("trainer")  # the reference's fp32 copies, in every arm
    return trainer, monitor


def run_one(arm: str, seed: int, steps: int) -> dict:
    lengths, counts = [], []
    with tempfile.TemporaryDirectory() as out:
        trainer, monitor = build(arm, seed, steps, out, lengths)
        record = monitor._record

        def counting(rec):
            counts.append({"step": trainer.state.global_step + 1, **token_counts(rec)})
            record(rec)

        monitor._record = counting
        t0, c0 = time.perf_counter(), time.process_time()
        trainer.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    keys = ("sample/trained_tokens_mean", "reward_std", "ratio", "clip_ratio/region_mean", "precision/alpha_abs_mean",
            "precision/beta_abs_mean", "precision/phantom_rate", "precision/alpha_clip_rate",
            "precision/staleness_share_1", "precision/staleness_share_2", "precision/no_shadow_total")
    rows = [{"step": h["step"], **{k: h.get(k) for k in keys}} for h in trainer.state.log_history if "loss" in h]
    return {"arm": arm, "seed": seed, "steps": steps, "wall_s": wall, "cpu_s": cpu, "rows": rows, "counts": counts,
            "lengths": lengths, "final_length": sum(g["length"] for g in lengths[-FINAL_GROUPS:]) / FINAL_GROUPS}


def summary(out: Path, seeds: int) -> dict:
    """Per seed: each decision's disagreement share with the reference (pooled over the seed's four runs: the
    same tokens judged by every decision) and each arm's final length; then paired differences against "shadow"
    (today's default), as 95% t intervals over seeds (metrics.t_interval)."""
    from phantomclip.maths.metrics import t_interval

    runs = {(r["arm"], r["seed"]): r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*/seed-*.json")))}
    done = sorted({s for (_, s) in runs if all((a, s) in runs for a in ARMS)})[:seeds]
    per_seed = {}
    for s in done:
        c = [x for a in ARMS for x in runs[(a, s)]["counts"]]
        n, stale = sum(x["tokens"] for x in c), sum(x["stale_tokens"] for x in c)
        sx, sy, sxx, syy, sxy = (sum(x["corr_sums"][i] for x in c) for i in range(5))
        cov = sxy / stale - sx * sy / stale**2
        corr = cov / ((sxx / stale - (sx / stale) ** 2) * (syy / stale - (sy / stale) ** 2)) ** 0.5
        per_seed[s] = {**{f"disagree_{d}": sum(x[f"disagree_{d}"] for x in c) / n for d in DECISIONS},
                       "reference_clip_rate": sum(x["reference_clips"] for x in c) / n, "tokens": n,
                       "alpha32_abs_mean": sum(x["alpha32_abs_sum"] for x in c) / stale,
                       "alpha_err_abs_mean": sum(x["alpha_err_abs_sum"] for x in c) / stale, "rounding_corr": corr,
                       **{f"final_length_{a}": runs[(a, s)]["final_length"] for a in ARMS},
                       **{f"run_length_{a}": statistics.fmean(g["length"] for g in runs[(a, s)]["lengths"])
                          for a in ARMS}}
    figures = sorted({k for v in per_seed.values() for k in v})
    result = {"seeds": done, "per_seed": per_seed,
              "mean": {k: t_interval([per_seed[s][k] for s in done]) for k in figures},
              "paired_vs_shadow": {
                  **{f"disagree_{d}": t_interval([per_seed[s][f"disagree_{d}"] - per_seed[s]["disagree_shadow"]
                                                   for s in done]) for d in DECISIONS if d != "shadow"},
                  **{f"{k}_{a}": t_interval([per_seed[s][f"{k}_{a}"] - per_seed[s][f"{k}_shadow"] for s in done])
                     for k in ("final_length", "run_length") for a in ARMS if a != "shadow"}}}
    return result


def _ci(x: dict, scale: float = 1.0, digits: int = 1) -> str:
    if x["n"] < 2:
        return f"{scale * x['mean']:.{digits}f}"
    return f"{scale * x['mean']:.{digits}f} [{scale * x['low']:.{digits}f}, {scale * x['high']:.{digits}f}]"


def markdown(s: dict) -> str:
    """The comparison as the tables docs/results.md holds: means over seeds with 95% t intervals, and each arm's
    paired difference from "shadow"."""
    m, d = s["mean"], s["paired_vs_shadow"]
    lines = [f"Seeds {s['seeds']}; clip decisions on {sum(v['tokens'] for v in s['per_seed'].values()):.0f} tokens.",
             "", "| ratio | clip decisions ≠ the fp32 policy-move clip, % of tokens | − shadow's, points | "
             "final length (tokens) | − shadow's | mean length over the run | − shadow's |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a in ARMS:
        cells = [_ci(m[f"disagree_{a}"], 100, 2), "—" if a == "shadow" else _ci(d[f"disagree_{a}"], 100, 2)]
        for k in ("final_length", "run_length"):
            cells += [_ci(m[f"{k}_{a}"]), "—" if a == "shadow" else _ci(d[f"{k}_{a}"])]
        lines.append(f"| {a} | {' | '.join(cells)} |")
    lines += ["", f"Reference clip rate {_ci(m['reference_clip_rate'], 100, 2)}%; on stale tokens mean |α_fp32| "
              f"{_ci(m['alpha32_abs_mean'], 1, 4)}, mean |α_bf16 − α_fp32| {_ci(m['alpha_err_abs_mean'], 1, 4)}, "
              f"correlation of the two bf16 roundings {_ci(m['rounding_corr'], 1, 2)}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/trl-async-ratio")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--summary", action="store_true", help="only summarise the runs already there")
    ap.add_argument("--one", nargs=2, metavar=("ARM", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    from phantomclip.base.files import atomic_write

    out = Path(args.out)
    if args.one:
        import torch

        torch.set_num_threads(1)
        arm, seed = args.one[0], int(args.one[1])
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        result = {**run_one(arm, seed, args.steps), "commit": os.environ.get("EXP_COMMIT", "?"), "started": started,
                  "cpu": cpu_kind(), "loadavg_end": os.getloadavg()}
        path = out / arm / f"seed-{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1)))
        print(f"{arm} seed {seed}: final length {result['final_length']:.1f}, {result['wall_s']:.0f} s", flush=True)
        return
    if not args.summary:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        for seed in range(args.seeds):  # seed-major: every arm of a seed before the next seed (pairs complete early)
            for arm in args.arms.split(","):
                if not (out / arm / f"seed-{seed}.json").exists():
                    subprocess.run([sys.executable, __file__, "--one", arm, str(seed), "--out", str(out), "--steps",
                                    str(args.steps)], check=True, env={**os.environ, "EXP_COMMIT": commit})
    s = summary(out, args.seeds)
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(s, indent=1)))
    print(markdown(s))


if __name__ == "__main__":
    main()
