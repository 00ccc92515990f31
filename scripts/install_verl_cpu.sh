#!/usr/bin/env bash
# A separate environment with verl for phantomclip inside verl (src/phantomclip/integrations/verl.py) and its tests
# (tests/test_integrations_verl_inside.py). Usage: bash scripts/install_verl_cpu.sh [VENV]   (default: .venv-verl)
#
# Why apart from the main install: verl 0.9.1 requires transformers <5.11 and phantomclip >=5.16, so pip cannot
# install the two together; phantomclip goes in with --no-deps beside the few of its own requirements this needs.
# torch is the local CPU build (2.13.0), installed first so that verl's resolve keeps it. verl 0.9.1's trainer
# imports cachetools, fastapi and uvicorn without declaring them (verl/workers/rollout/router.py and
# rollout/utils.py, reached from ray_trainer.py); they are the `verl` extra's other pins in pyproject.toml.
# On a GPU machine: pip install verl==0.9.1 into the environment that has your CUDA torch, the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-verl}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q torch==2.13.0 verl==0.9.1 cachetools==8.0.3 fastapi==0.165.0 uvicorn==0.55.0 'pytest>=8'
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" install -q gguf jinja2 markdown-it-py platformdirs
"$venv/bin/python" -c "import verl, phantomclip.integrations.verl; print('verl', verl.__version__, 'ready in $venv')"
