"""Scoring throughput, agreement and peak memory: `scoring.score` (ours) against `scoring.naive_logprobs`.

Workload: bundled SmolLM2-135M, 8 x 256 random token ids (seed 0, ids in [100, 49000)), all positions scored.
Baseline: the naive path, `model(ids).logits.float().log_softmax(-1).gather(...)`, measured in the same run.
For bf16 both paths use the emulated matmul (same kernels), so their difference is only our chunked fp32
log-softmax; "naive native" is the same naive path on PyTorch's own bf16 kernels (what a plain PyTorch user
gets on this CPU). Throughput = 8*256 / seconds, median of timed repeats after one warm-up; ours and naive
are timed alternately so machine noise hits both alike. Roofline: fp32 (and native bf16) GFLOP/s of a
2048^3 matmul; share = tokens/s * 269e6 FLOP/token / peak (emulated bf16 multiplies in fp32: fp32 peak).
Peak memory: each (path, dtype) in a fresh subprocess (`--one PATH DTYPE`): RSS with the model ready, then the
RSS high-water mark VmHWM is reset (/proc/self/clear_refs) so VmHWM after the step covers the step alone.

    python bench/bench_scoring.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from phantomclip.models import load_model
from phantomclip.recipes import RECIPES, apply_recipe
from phantomclip.scoring import _body_and_head, logprobs_from_logits, naive_logprobs, score

B, T, FLOP_PER_TOKEN = 8, 256, 269e6


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 49000, (B, T), generator=g)
    return ids, torch.ones(B, T, dtype=torch.long)


def run_path(path: str, model, recipe, ids, attn) -> torch.Tensor:
    if path == "ours":
        return score(model, recipe, ids, attn).logp
    return naive_logprobs(model, recipe, ids, attn)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def one(path: str, dtype: str) -> None:
    """Subprocess mode: peak memory of one log-prob step, printed as JSON."""
    master = load_model("smollm2-135m", progress=lambda *a: None).model
    recipe = RECIPES[dtype]
    model = apply_recipe(master, recipe, matmul="emulated")
    del master
    ids, attn = batch()
    with torch.no_grad():  # build the emulated matmul's cached fp32 weight images: part of the model, not the step
        model(input_ids=ids[:1, :4], attention_mask=attn[:1, :4], use_cache=False)
    after_load = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the RSS high-water mark VmHWM
    run_path(path, model, recipe, ids, attn)
    # VmHWM, not ru_maxrss: ru_maxrss also keeps the RSS of threads that exited during loading (the load peak).
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"after_load_kib": after_load, "peak_kib": status_kib("VmHWM"), "ru_maxrss_kib": ru}))


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """2048^3 matmul in nn.Linear's layout (F.linear: x @ w.T). torch.mm(a, b) in bf16 takes a far slower path here."""
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    F.linear(a, b)
    return 2 * 2048**3 / statistics.median(timed(lambda: F.linear(a, b), repeats)) / 1e9


@torch.no_grad()
def breakdown(model, ids, attn, repeats: int) -> dict[str, float]:
    """Seconds (median) of the parts: decoder body, head on all rows, naive post-processing, ours post-processing."""
    body, head = _body_and_head(model)
    h = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state.reshape(B * T, -1)  # [BT, H]
    logits, tgt = head(h), ids.reshape(-1)  # [BT, V]
    parts = {
        "body": lambda: body(input_ids=ids, attention_mask=attn, use_cache=False),
        "head (all rows)": lambda: head(h),
        "naive post: float+log_softmax+gather": lambda: logits.float().log_softmax(-1).gather(-1, tgt[:, None]),
        "ours post: logp+entropy, chunks of 256": lambda: [logprobs_from_logits(logits[s : s + 256], tgt[s : s + 256])
                                                           for s in range(0, B * T, 256)],
    }
    return {k: statistics.median(timed(f, repeats)) for k, f in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "DTYPE"), help="internal: memory of one (ours|naive, fp32|bf16)")
    args = ap.parse_args()
    if args.one:
        return one(*args.one)
    reps, reps_native = (2, 1) if args.quick else (5, 2)
    torch.manual_seed(0)
    peak32, peak16 = gflops(torch.float32), gflops(torch.bfloat16, 3)
    master = load_model("smollm2-135m", progress=lambda *a: None).model
    ids, attn = batch()
    rows, speed, parts = [], {}, {}
    for dtype in ("fp32", "bf16"):
        recipe = RECIPES[dtype]
        model = apply_recipe(master, recipe, matmul="emulated")
        lp = {p: run_path(p, model, recipe, ids, attn) for p in ("ours", "naive")}  # warm-up
        diff = (lp["ours"] - lp["naive"])[:, 1:].abs().max().item()
        times = {"ours": [], "naive": []}
        for _ in range(reps):  # alternate so noise hits both paths alike
            for p in times:
                times[p] += timed(lambda: run_path(p, model, recipe, ids, attn), 1)
        for p, ts in times.items():
            speed[p, dtype] = B * T / statistics.median(ts)
            rows.append((p, dtype, "emulated" if dtype == "bf16" else "fp32", speed[p, dtype], peak32, diff))
        parts[dtype] = breakdown(model, ids, attn, max(reps // 2, 1))
        del model
    model = apply_recipe(master, RECIPES["bf16"], matmul="native")
    run_path("naive", model, RECIPES["bf16"], ids, attn)
    ts = timed(lambda: run_path("naive", model, RECIPES["bf16"], ids, attn), reps_native)
    speed["naive-native", "bf16"] = B * T / statistics.median(ts)
    rows.append(("naive", "bf16", "native", speed["naive-native", "bf16"], peak16, float("nan")))
    del model, master

    print(f"matmul 2048^3 (F.linear): fp32 {peak32:.1f} GFLOP/s, native bf16 {peak16:.1f} GFLOP/s ({peak32 / peak16:.1f}x slower)\n")
    print("| path | dtype | matmul | tokens/s | relative to naive (fp32 / emulated kernels) | share of roofline | max abs diff ours-naive |")
    print("|---|---|---|---:|---:|---:|---:|")
    for p, dtype, mm, tps, peak, diff in rows:
        roof = f"{100 * tps * FLOP_PER_TOKEN / (peak * 1e9):.0f}% of {'fp32' if mm != 'native' else 'bf16'} peak"
        d = "-" if diff != diff else f"{diff:.2e}"
        print(f"| {p} | {dtype} | {mm} | {tps:.0f} | {tps / speed['naive', dtype]:.2f}x | {roof} | {d} |")
    for dtype, target in (("fp32", 1.0), ("bf16", 1.3)):
        r = speed["ours", dtype] / speed["naive", dtype]
        print(f"\n{dtype}: ours/naive = {r:.2f}x (target >= {target}x: {'met' if r >= target else 'NOT met'})", end="")
    print(f"\nbf16: ours (emulated) / naive native = {speed['ours', 'bf16'] / speed['naive-native', 'bf16']:.1f}x\n")
    print("| part (seconds, median) | fp32 | bf16 emulated |\n|---|---:|---:|")
    for k in parts["fp32"]:
        print(f"| {k} | {parts['fp32'][k]:.2f} | {parts['bf16'][k]:.2f} |")
    print()

    print("| path | dtype | RSS model ready (MiB) | peak RSS (MiB) | increment (MiB) |")
    print("|---|---|---:|---:|---:|")
    inc = {}
    for dtype in ("fp32", "bf16"):
        for p in ("ours", "naive"):
            out = subprocess.run([sys.executable, __file__, "--one", p, dtype], capture_output=True, text=True, check=True,
                                 env=dict(os.environ))
            m = json.loads(out.stdout.strip().splitlines()[-1])
            inc[p, dtype] = (m["peak_kib"] - m["after_load_kib"]) / 1024
            print(f"| {p} | {dtype} | {m['after_load_kib'] / 1024:.0f} | {m['peak_kib'] / 1024:.0f} | {inc[p, dtype]:.0f} |")
    for dtype in ("fp32", "bf16"):
        r = inc["ours", dtype] / inc["naive", dtype]
        print(f"\n{dtype}: increment ours/naive = {r:.3f} (target <= 0.25: {'met' if r <= 0.25 else 'NOT met'})", end="")
    print()


if __name__ == "__main__":
    main()
