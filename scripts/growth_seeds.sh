#!/usr/bin/env bash
# How β grows, over seeds: the baseline and force-r1 on the bundled model, seeds 0-2, each trained for 30 steps with
# weight snapshots every 5 steps, then read by `phantomclip trace --run`. Resumable: a run is resumed where its
# checkpoint stopped, a finished analysis (results/growth-bundled/ARM-seedS.json) is skipped, and a run's snapshots
# (525 MB each for the bundled model) are deleted once its analysis is written.
#   bash scripts/growth_seeds.sh [WORKDIR]     (default WORKDIR: runs/growth)
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-runs/growth}"
mkdir -p results/growth-bundled "$work"
for seed in 0 1 2; do
  for arm in none force-r1; do
    out="results/growth-bundled/$arm-seed$seed.json"
    [ -f "$out" ] && { echo "$out: done"; continue; }
    run="$work/$arm-seed$seed"
    if [ ! -f "$run/snapshots/step-000030.safetensors" ]; then
      if [ -f "$run/config.json" ]; then resume=(--resume); else resume=(); fi
      phantomclip train --steps 30 --keep-snapshots 5 --intervention "$arm" --seed "$seed" --out "$run" "${resume[@]}"
    fi
    phantomclip trace --run "$run" --json "$out"
    rm -rf "$run/snapshots"
  done
done
