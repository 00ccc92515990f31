"""How far the packed emulated kernel moves the engine's numbers: log-probs of the same tokens under the emulated bf16
forward on F.linear (MKL's fp32 sums) and on packed weights (oneDNN's), each against fp32, and the share of one
Linear's outputs that land on another bf16 value.

Workload: bundled SmolLM2-135M, 4 x 64 random token ids (seed 1), teacher-forced through the whole model
(`apply_recipe(master, bf16, matmul="emulated")`, then `decode.pack_linears` on one copy); the flip share on 16 random
rows through each distinct Linear shape of the model. Prints the CPU kind: the sums, and so the flips, depend on it.

    python bench/benchmarks/bench_packed_agreement.py

Feeds bench/RESULTS.md (2026-12-02, fifth session) "What packing does to the emulated engine's numbers": the mean |Δ|
0.070 that engines/decode.py's docstring and docs/diagnose.md "Engines" cite.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from phantomclip.engines import decode
from phantomclip.models.load import load_model
from phantomclip.precision.recipes import apply_recipe, engine_recipe


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p of ids[:, 1:] under `model`, fp32 [B, T - 1]."""
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)  # [B, T, V]
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind

    master = load_model("smollm2-135m", progress=lambda *a: None).model.eval()
    ids = torch.randint(100, 49000, (4, 64), generator=torch.Generator().manual_seed(1))
    recipe = engine_recipe(torch.bfloat16)
    plain, packed = (apply_recipe(master, recipe, matmul="emulated") for _ in range(2))
    count = decode.pack_linears(packed)
    lp = {"fp32": token_logprobs(master, ids), "emulated, F.linear": token_logprobs(plain, ids),
          "emulated, packed": token_logprobs(packed, ids)}
    print(f"CPU kind: {cpu_kind()}; {count} Linears packed; mean / max |Δ log p| over {lp['fp32'].numel()} tokens\n")
    print("| pair | mean | max |\n|---|---:|---:|")
    for a, b in [("emulated, packed", "emulated, F.linear"), ("emulated, packed", "fp32"),
                 ("emulated, F.linear", "fp32")]:
        d = (lp[a] - lp[b]).abs()
        print(f"| {a} vs {b} | {d.mean():.4f} | {d.max():.4f} |")
    print("\n| Linear shape | outputs on another bf16 value (16 rows) |\n|---|---:|")
    seen = set()
    g = torch.Generator().manual_seed(0)
    for p_mod, q_mod in zip(plain.modules(), packed.modules()):
        if isinstance(p_mod, torch.nn.Linear) and tuple(p_mod.weight.shape) not in seen:
            seen.add(tuple(p_mod.weight.shape))
            x = torch.randn(16, p_mod.in_features, generator=g)
            with torch.no_grad():
                share = (p_mod(x) != q_mod(x)).float().mean().item()
            print(f"| {p_mod.out_features} x {p_mod.in_features} | {share:.2e} |")


if __name__ == "__main__":
    main()
