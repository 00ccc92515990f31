"""The trainer's fp32 GEMMs through PyTorch's default path against oneDNN with packed weights, at a training step's
shape: what an fp32 trainer step could gain on this CPU (the trainer's throughput target is bound by that step).

Workload: the bundled model's Linear shapes (per layer q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536,
30 layers, and the 49152x576 head), M = 640 rows (a 1 prompt x 8 step: 8 sequences of about 80 tokens). Per shape:
forward y = x W^T, input gradient dx = g W, weight gradient dW = g^T x. Default: `F.linear` and `@` (MKL on an x86
CPU without AMX bf16, whichever PyTorch picks). oneDNN: `torch.ops.mkldnn._linear_pointwise` on a weight laid out
with `_reorder_linear_weight`, once per optimizer step (its cost is included, once per shape per step), for the
forward and for dx (the transposed weight laid out too); dW has no fixed operand, so both operands are laid out per
call (included). Median of 10 after 2 warm-ups; totals weighted by how many Linears have each shape.

    python bench/bench_trainer_gemm.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

M = 640
SHAPES = [(576, 576, 60), (192, 576, 60), (1536, 576, 60), (576, 1536, 30), (49152, 576, 1)]
"""(N, K, how many Linears of the bundled model have that weight shape)."""


def ms(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import cpu_kind

    g = torch.Generator().manual_seed(0)
    rows, total = [], {"default": 0.0, "onednn": 0.0}
    for n, k, count in SHAPES:
        x, w, grad = (torch.randn(M, k, generator=g), torch.randn(n, k, generator=g), torch.randn(M, n, generator=g))
        pack = ms(lambda: (torch.ops.mkldnn._reorder_linear_weight(w, M),
                           torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), M)))
        w_packed = torch.ops.mkldnn._reorder_linear_weight(w, M)
        wt_packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), M)
        default = {"forward": ms(lambda: F.linear(x, w)), "dx": ms(lambda: grad @ w), "dW": ms(lambda: grad.t() @ x)}
        ours = {"forward": ms(lambda: onednn(x, w_packed)), "dx": ms(lambda: onednn(grad, wt_packed)),
                "dW": ms(lambda: onednn(grad.t().contiguous(),
                                        torch.ops.mkldnn._reorder_linear_weight(x.t().contiguous(), n)))}
        worst = max((onednn(x, w_packed) - F.linear(x, w)).abs().max().item(),
                    (onednn(grad, wt_packed) - grad @ w).abs().max().item())
        rows.append((n, k, count, default, ours, pack, worst))
        total["default"] += count * sum(default.values())
        total["onednn"] += count * (sum(ours.values()) + pack)
    print(f"CPU kind: {cpu_kind()}; M = {M} rows, fp32, {torch.get_num_threads()} threads; ms, median of 10\n")
    print("| weight N x K | Linears | forward default / oneDNN | dx default / oneDNN | dW default / oneDNN "
          "| lay-out per step | max abs diff |\n|---|---:|---|---|---|---:|---:|")
    for n, k, count, d, o, pack, worst in rows:
        cells = " | ".join(f"{d[p]:.2f} / {o[p]:.2f}" for p in ("forward", "dx", "dW"))
        print(f"| {n} x {k} | {count} | {cells} | {pack:.2f} | {worst:.1e} |")
    print(f"\nall Linears of one step, forward + dx + dW: default {total['default'] / 1000:.2f} s, oneDNN "
          f"{total['onednn'] / 1000:.2f} s (lay-out included): {total['default'] / total['onednn']:.2f}x")


if __name__ == "__main__":
    main()
