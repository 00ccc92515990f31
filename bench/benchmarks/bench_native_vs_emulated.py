"""The same `phantomclip diagnose` under both low-precision matmul kernels, on one machine: what the CPU kind changes.

`--matmul auto` picks PyTorch's native bf16 kernels (oneDNN) on CPUs with AVX-512-BF16 or AMX, and the emulated ones
(bf16 operands, fp32 accumulation; precision/recipes.py) on AVX2-only CPUs. On a native-capable CPU both can run, so
this script runs the default diagnose (bundled model, bf16 engine, 64 x 48 tokens, every trainer recipe) once per kernel
and prints, side by side: the engine's sampling speed, and per recipe the mean |β| with its split into β_kernel (the
engine's decode path against a prefill of the same weights in the same kernels) and β_precision.

Different kernels sample different tokens (the same seed, other rounding), so the two runs score different
completions; the figures compare two measurements of the same quantity, not token for token.

    python bench/benchmarks/bench_native_vs_emulated.py [--n 64] [--max-tokens 48]

Feeds bench/RESULTS.md (2026-12-01, second session) "Native against emulated bf16 kernels on one machine",
docs/results.md "How long `diagnose` takes" and "What diagnose measured on the bundled model", and docs/diagnose.md
"Matmul kernels on CPUs without native bf16".
"""

from __future__ import annotations

import argparse
import time

import torch

torch.set_num_threads(2)


def main() -> None:
    from phantomclip.diagnose.job import DiagnoseConfig, run_diagnose
    from phantomclip.precision.recipes import cpu_description

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    cpu = cpu_description("auto")
    if not cpu["native"]["bf16"]:
        raise SystemExit(f"this CPU ({cpu.get('model')}) has no native bf16 kernels: only the emulated path can run")
    results = {}
    for matmul in ("native", "emulated"):
        t0 = time.perf_counter()
        results[matmul] = run_diagnose(DiagnoseConfig(matmul=matmul, n=args.n, max_tokens=args.max_tokens))
        results[matmul]["wall_s"] = time.perf_counter() - t0
    print(f"\ndiagnose defaults (bundled model, bf16 engine, {args.n} x {args.max_tokens} tokens), CPU: {cpu['model']}")
    print("| kernels | engine tok/s | diagnose wall s | shadow β_kernel mean \\|.\\| | β_kernel p99 \\|.\\| |")
    print("|---|---:|---:|---:|---:|")
    for matmul, r in results.items():
        k = r["shadow"]["kernel"]
        print(f"| {matmul} | {r['engine']['tokens_per_s']:.0f} | {r['wall_s']:.0f} | {k['beta_abs_mean']:.5f} "
              f"| {k['beta_abs_p99']:.4f} |")
    print("\n| recipe | kernels | mean \\|β\\| | β_kernel mean \\|.\\| | β_precision mean \\|.\\| "
          "| outside trust region % |")
    print("|---|---|---:|---:|---:|---:|")
    for name in results["native"]["recipes"]:
        for matmul, r in results.items():
            rec = r["recipes"][name]
            split = rec["split"]
            print(f"| {name} | {matmul} | {rec['beta_abs_mean']:.5f} | {split['kernel']['beta_abs_mean']:.5f} "
                  f"| {split['precision']['beta_abs_mean']:.5f} | {100 * rec['outside_trust_region']:.3f} |")
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, CPU flags: "
          f"native bf16 {cpu['native']['bf16']}, native fp16 {cpu['native']['fp16']}")


if __name__ == "__main__":
    main()
