"""Regenerate the report's bundled demo data (src/phantomclip/report/demo/) on the bundled model.

    python scripts/make_demo_data.py --sanity runs/sanity      # after `phantomclip experiment sanity --out runs/sanity`

Writes diagnose.json (16 prompts x up to 32 tokens, all recipes), trace.json (default trace) and copies the
sanity experiment's summary.json and each run's config.json + metrics.jsonl (no checkpoints, no samples).
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
    ap.add_argument("--sanity", required=True, help="a finished `phantomclip experiment sanity` directory")
    ap.add_argument("--skip-measure", action="store_true", help="only copy the sanity runs")
    args = ap.parse_args()
    DEMO.mkdir(parents=True, exist_ok=True)
    if not args.skip_measure:
        cli = [sys.executable, "-m", "phantomclip.cli"]
        subprocess.run([*cli, "diagnose", "--n", "16", "--max-tokens", "32", "--json", str(DEMO / "diagnose.json")], check=True)
        subprocess.run([*cli, "trace", "--json", str(DEMO / "trace.json")], check=True)
    src = Path(args.sanity)
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
    size = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    print(f"demo data: {size / 2**20:.2f} MiB in {DEMO}")


if __name__ == "__main__":
    main()
