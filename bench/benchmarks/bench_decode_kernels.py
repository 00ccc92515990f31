"""The kernel choices of the local engine's decode step, timed as CPU time of one thread (load-robust, relative).

Three tables on the bundled model's shapes, fp32 and bf16 (the kernel `auto` picks here), 16 and 64 rows:
1. each Linear shape through `F.linear` against oneDNN's packed layout (`decode.pack_linears`): the per-shape packing
   rule, with '*' where the packed output is not bit-identical to F.linear (expected in fp32: another summation order);
2. q/k/v and gate/up as one fused packed product against their parts (`decode.FusedLinears`), '*' where not
   bit-identical (where the decoder then keeps the parts);
3. one decode step with 56 cached tokens: the static decoder fused, the same unfused (each Linear alone) and the
   model's own HF forward, on the engine's packed weights; calls alternated, medians of rounds.
One thread and `time.thread_time` because on a shared 2-core VM a 2-thread wall time mostly measures OpenMP barriers
waiting for a descheduled thread; read the ratios, not the absolute times, and note the load printed beside them.

    python bench/benchmarks/bench_decode_kernels.py [--rounds 5] [--dtypes fp32,bf16] [--rows 16,64]

Feeds bench/RESULTS.md "2026-12-03: the local engine's decode step profiled, fused products, the bench's load guard" and
the packing rule in engines/decode.py's docstring.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from phantomclip.engines import decode
from phantomclip.engines.local import LocalEngine
from phantomclip.models.load import load_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
CTX = 56


def cpu_ms(fns: dict, calls: int) -> dict[str, float]:
    """Median thread-CPU ms per call of each fn, the fns alternated call by call after one warm-up each."""
    for fn in fns.values():
        fn()
    ts = {k: [] for k in fns}
    for _ in range(calls):
        for k, fn in fns.items():
            t0 = time.thread_time()
            fn()
            ts[k].append(1000 * (time.thread_time() - t0))
    return {k: statistics.median(v) for k, v in ts.items()}


def packed(w: torch.Tensor, x: torch.Tensor):
    p = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


def shapes_table(dtype: torch.dtype, rows: int) -> str:
    g, cells = torch.Generator().manual_seed(0), []
    for n, k in SHAPES:
        w, x = (torch.randn(n, k, generator=g) * 0.05).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
        fns = {"F": lambda: F.linear(x, w), "packed": packed(w, x)}
        same = torch.equal(fns["F"](), fns["packed"]())
        t = cpu_ms(fns, 5 if n > 10000 else 30)
        cells.append(f"{t['F']:.3f} / {t['packed']:.3f}{'' if same else '*'}")
    return " | ".join(cells)


def fused_table(dtype: torch.dtype, rows: int) -> str:
    g, cells = torch.Generator().manual_seed(0), []
    for parts in ([576, 192, 192], [1536, 1536]):
        ws = [torch.randn(n, 576, generator=g).to(dtype) for n in parts]
        x = torch.randn(rows, 576, generator=g).to(dtype)
        one, split = packed(torch.cat(ws), x), [packed(w, x) for w in ws]
        same = torch.equal(one(), torch.cat([f() for f in split], -1))
        t = cpu_ms({"fused": one, "parts": lambda: [f() for f in split]}, 20)
        cells.append(f"{t['fused']:.3f} / {t['parts']:.3f}{'' if same else '*'}")
    return " | ".join(cells)


@torch.no_grad()
def step_table(engine: LocalEngine, rows: int, rounds: int) -> str:
    from transformers import DynamicCache

    ids = torch.randint(100, 49000, (rows, CTX), generator=torch.Generator().manual_seed(1))  # [rows, CTX]
    mask = torch.ones(rows, CTX + 1, dtype=torch.long)
    pos = torch.arange(CTX + 1)[None].expand(rows, -1)  # [rows, CTX + 1]

    def static(fuse: bool):
        dec = decode.StaticDecoder(engine.model, rows, CTX + 1)
        if not fuse:
            dec.qkv, dec.gate_up = [None] * len(dec.qkv), [None] * len(dec.gate_up)
        dec(ids, pos[:, :CTX], mask[:, :CTX])

        def step():
            dec.filled = CTX
            return dec(ids[:, :1], pos[:, CTX:], mask)
        return step

    cache = DynamicCache()
    engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def hf():
        if cache.get_seq_length() > CTX:
            cache.crop(-(cache.get_seq_length() - CTX))
        return engine.model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1).logits

    fns = {"fused": static(True), "unfused": static(False), "HF forward": hf}
    same = torch.equal(fns["fused"](), fns["unfused"]())
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, v in cpu_ms(fns, 3).items():
            per[k].append(v)
    med = {k: statistics.median(v) for k, v in per.items()}
    cells = [f"{med[k]:.1f} [{min(v):.0f}-{max(v):.0f}]" for k, v in per.items()]
    return " | ".join(cells) + f" | {med['fused'] / med['unfused']:.2f} | {med['fused'] / med['HF forward']:.2f}" + (
        "" if same else " | NOT bit-identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the whole-step table (median over them)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--rows", default="16,64")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtypes, rows = args.dtypes.split(","), [int(n) for n in args.rows.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; CPU ms of one thread, medians")
    print("\n| dtype, rows | " + " | ".join(f"{n}x{k} F.linear / packed" for n, k in SHAPES) + " |\n|---|"
          + "---:|" * len(SHAPES))
    for d in dtypes:
        for n in rows:
            print(f"| {d}, {n} | {shapes_table(DTYPES[d], n)} |", flush=True)
    print("\n| dtype, rows | q/k/v fused / parts | gate/up fused / parts |\n|---|---:|---:|")
    for d in dtypes:
        for n in rows:
            print(f"| {d}, {n} | {fused_table(DTYPES[d], n)} |", flush=True)
    lm = load_model("smollm2-135m", progress=lambda *a: None)
    print("\n| dtype, rows | static fused | static unfused | HF forward | fused / unfused | fused / HF |\n|---|"
          + "---:|" * 5)
    for d in dtypes:
        engine = LocalEngine(lm.model, DTYPES[d])
        for n in rows:
            print(f"| {d}, {n} | {step_table(engine, n, args.rounds)} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
