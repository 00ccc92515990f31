"""Scoring throughput, agreement and peak memory: `scoring.score` (ours) against `scoring.naive_logprobs`.

Workload: bundled SmolLM2-135M, 8 x 256 random token ids (seed 0, ids in [100, 49000)), all positions scored.
Baseline: the naive path, `model(ids).logits.float().log_softmax(-1).gather(...)`, measured in the same run.
Both use the bf16 kernel `--matmul auto` picks on this CPU (native where it has bf16 instructions, else emulated:
what a user runs; the same kernels on both sides), so they differ only in what follows the body: ours runs
the head in chunks of 128 rows and computes the log-prob in fp32 ("ours": logsumexp + gather; "ours+entropy":
also the entropy, as diagnose does); naive does one [B, T, V] fp32 log_softmax. "ours, last 64 scored" scores
only the last 64 of the 256 positions (a prompt of 192 + a completion of 64, what diagnose and a trainer do),
still against the naive path, which cannot skip the prompt's head. The last bf16 row is the naive path on the
other bf16 kernel, labelled (not what auto picks here). Throughput = 8*256 / seconds, median of 5 timed repeats
after one warm-up, ours and naive timed alternately so machine noise hits both alike; a per-part breakdown
explains the ratio.
Roofline: GFLOP/s of a 2048^3 matmul, 5 times at the start and 5 at the end of the run (the host is noisy and
noise only slows, so the peak is the best of 10); share = tokens/s * 269e6 FLOP/token / peak (emulated bf16
multiplies in fp32, so its peak is the fp32 one; native bf16's is the bf16 one).
Peak memory: each (path, dtype) in a fresh subprocess (`--one PATH DTYPE [CHUNK]`): RSS with the model ready,
then the high-water mark VmHWM is reset (/proc/self/clear_refs) so VmHWM after the step covers the step alone
(ru_maxrss cannot be reset; printed for comparison).

    python bench/benchmarks/bench_scoring.py [--quick]

Feeds bench/RESULTS.md §1 ("Scoring: `score()` (ours) vs `naive_logprobs()` (naive)") and its "Scoring memory" entries,
and docs/results.md "Scoring against a naive log-softmax".
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from phantomclip.base.numerics import dtype_name
from phantomclip.models.load import load_model
from phantomclip.precision.recipes import RECIPES, apply_recipe, decoder_body, kernel_name, lm_head
from phantomclip.precision.scoring import logprobs_from_logits, naive_logprobs, score

B, T, FLOP_PER_TOKEN = 8, 256, 269e6


def batch():
    ids = torch.randint(100, 49000, (B, T), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones(B, T, dtype=torch.long)


COMPLETION = 64


def run_path(path: str, model, recipe, ids, attn, chunk: int = 128) -> torch.Tensor:
    if path == "ours":
        return score(model, recipe, ids, attn, chunk_size=chunk, entropy=False).logp
    if path == "ours+entropy":
        return score(model, recipe, ids, attn, chunk_size=chunk).logp
    if path == "ours, last 64 scored":
        last = torch.zeros_like(attn, dtype=torch.bool)
        last[:, -COMPLETION:] = True
        return score(model, recipe, ids, attn, last, chunk_size=chunk, entropy=False).logp
    return naive_logprobs(model, recipe, ids, attn)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def one(path: str, dtype: str, chunk: str = "128") -> None:
    """Subprocess mode: peak memory of one log-prob step, printed as JSON."""
    recipe, ids, attn = RECIPES[dtype], *batch()
    model = apply_recipe(load_model("smollm2-135m", progress=lambda *a: None).model, recipe, matmul="auto")
    with torch.no_grad():  # build an emulated matmul's cached fp32 weight images: part of the model, not the step
        model(input_ids=ids[:1, :4], attention_mask=attn[:1, :4], use_cache=False)
    after_load = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the RSS high-water mark VmHWM
    run_path(path, model, recipe, ids, attn, int(chunk))
    # VmHWM, not ru_maxrss: clear_refs does not reset ru_maxrss's other input, the high-water mark kept at exec,
    # which for a child forked from a big parent is the parent's RSS.
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"after_load_kib": after_load, "peak_kib": status_kib("VmHWM"), "ru_maxrss_kib": ru}))


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gflops(dtype: torch.dtype, repeats: int = 5) -> list[float]:
    """GFLOP/s of 2048^3 matmuls in nn.Linear's layout (F.linear: x @ w.T; torch.mm(a, b) in bf16 is far slower
    here)."""
    a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    F.linear(a, b)
    return [2 * 2048**3 / t / 1e9 for t in timed(lambda: F.linear(a, b), repeats)]


@torch.no_grad()
def breakdown(model, ids, attn, repeats: int) -> dict[str, float]:
    """Seconds (median) of the parts: decoder body, head on all rows, naive post-processing, ours post-processing."""
    body, head = decoder_body(model), lm_head(model)
    h = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state.reshape(B * T, -1)  # [BT, H]
    logits, tgt = head(h), ids.reshape(-1)  # [BT, V]
    parts = {
        "body": lambda: body(input_ids=ids, attention_mask=attn, use_cache=False),
        "head (all rows)": lambda: head(h),
        "naive post: float+log_softmax+gather": lambda: logits.float().log_softmax(-1).gather(-1, tgt[:, None]),
        "ours post: logp only, chunks of 128": lambda: [logprobs_from_logits(logits[s : s + 128], tgt[s : s + 128],
                                                                             False)
                                                        for s in range(0, B * T, 128)],
        "ours post: logp+entropy, chunks of 128": lambda: [logprobs_from_logits(logits[s : s + 128], tgt[s : s + 128])
                                                           for s in range(0, B * T, 128)],
    }
    return {k: statistics.median(timed(f, repeats)) for k, f in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--one", nargs="+", metavar="ARG",
                    help="internal: memory of one step: ours|naive fp32|bf16 [CHUNK]")
    args = ap.parse_args()
    if args.one:
        return one(*args.one)
    reps, reps_native = (2, 1) if args.quick else (5, 2)
    torch.manual_seed(0)
    g_start = {d: gflops(d) for d in (torch.float32, torch.bfloat16)}  # 5 at the start, 5 at the end of the run
    master = load_model("smollm2-135m", progress=lambda *a: None).model
    ids, attn = batch()
    rows, speed, parts = [], {}, {}
    auto = {"fp32": "fp32", "bf16": kernel_name("auto", torch.bfloat16)}  # what each recipe runs here
    peak_of = {"fp32": torch.float32, "emulated": torch.float32, "native": torch.bfloat16}
    for dtype in ("fp32", "bf16"):
        recipe = RECIPES[dtype]
        model = apply_recipe(master, recipe, matmul="auto")
        lp = {p: run_path(p, model, recipe, ids, attn) for p in ("ours", "naive")}  # warm-up
        for p in ("ours+entropy", "ours, last 64 scored"):
            run_path(p, model, recipe, ids, attn)
        dd = (lp["ours"] - lp["naive"])[:, 1:].abs()  # scored positions
        diff = f"{dd.max():.2e} ({dd.median():.1e}; {(dd / lp['naive'][:, 1:].abs()).max():.1e})"
        times = {"ours": [], "ours+entropy": [], "ours, last 64 scored": [], "naive": []}
        for _ in range(reps):  # alternate so noise hits both paths alike
            for p in times:
                times[p] += timed(partial(run_path, p, model, recipe, ids, attn), 1)
        for p, ts in times.items():
            speed[p, dtype] = B * T / statistics.median(ts)
            rows.append((p, dtype, auto[dtype], speed[p, dtype], peak_of[auto[dtype]], diff))
        parts[dtype] = breakdown(model, ids, attn, reps)
        del model
    other = "emulated" if auto["bf16"] == "native" else "native"
    model = apply_recipe(master, RECIPES["bf16"], matmul=other)
    run_path("naive", model, RECIPES["bf16"], ids, attn)
    ts = timed(partial(run_path, "naive", model, RECIPES["bf16"], ids, attn), reps_native)
    speed["naive-other", "bf16"] = B * T / statistics.median(ts)
    rows.append(("naive, not what auto picks here", "bf16", other, speed["naive-other", "bf16"], peak_of[other], "-"))
    del model, master
    g = {}  # dtype -> (median of 5 at start, median of 5 at end, best of 10)
    for d, start in g_start.items():
        end = gflops(d)
        g[d] = (statistics.median(start), statistics.median(end), max(start + end))

    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind

    print(f"CPU kind: {cpu_kind()}; bf16 kernel that auto picks here: {auto['bf16']}")
    for d, (m0, m1, best) in g.items():
        print(f"matmul 2048^3 (F.linear) {d}: median of 5 at start {m0:.1f}, at end {m1:.1f}, "
              f"best of 10 {best:.1f} GFLOP/s")
    print(f"native bf16 is {g[torch.float32][2] / g[torch.bfloat16][2]:.1f}x slower than fp32 (best of 10)\n")
    print("| path | dtype | matmul | tokens/s | relative to naive (same dtype, the kernel auto picks) "
          "| share of roofline (best-of-10 matmul peak) | max abs diff ours-naive (median; max relative) |")
    print("|---|---|---|---:|---:|---:|---:|")
    for p, dtype, mm, tps, peak, diff in rows:
        flops = tps * FLOP_PER_TOKEN / 1e9
        roof = f"{100 * flops / g[peak][2]:.0f}% of {dtype_name(peak)} best ({flops:.0f} GFLOP/s)"
        print(f"| {p} | {dtype} | {mm} | {tps:.0f} | {tps / speed['naive', dtype]:.2f}x | {roof} | {diff} |")
    for dtype, target in (("fp32", 1.0), ("bf16", 1.3)):
        r = speed["ours", dtype] / speed["naive", dtype]
        print(f"\n{dtype}: ours/naive = {r:.2f}x (target >= {target}x: {'met' if r >= target else 'NOT met'})", end="")
        r64 = speed["ours, last 64 scored", dtype] / speed["naive", dtype]
        print(f"\n{dtype}: ours scoring the last 64 of 256 positions / naive = {r64:.2f}x "
              f"(target >= {target}x: {'met' if r64 >= target else 'NOT met'})", end="")
    print(f"\nbf16: ours ({auto['bf16']}) / naive {other} = "
          f"{speed['ours', 'bf16'] / speed['naive-other', 'bf16']:.1f}x\n")
    print(f"| part (seconds, median) | fp32 | bf16 {auto['bf16']} |\n|---|---:|---:|")
    for k in parts["fp32"]:
        print(f"| {k} | {parts['fp32'][k]:.2f} | {parts['bf16'][k]:.2f} |")
    print()

    print("| path | dtype | RSS model ready (MiB) | peak RSS VmHWM (MiB) | increment (MiB) | ru_maxrss (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    inc = {}
    for dtype, p, chunk in [(d, p, "128") for d in ("fp32", "bf16") for p in ("ours", "ours+entropy", "naive")]:
        cmd = [sys.executable, __file__, "--one", p, dtype, chunk]
        m = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        inc[p, dtype, chunk] = (m["peak_kib"] - m["after_load_kib"]) / 1024
        name = p
        print(f"| {name} | {dtype} | {m['after_load_kib'] / 1024:.0f} | {m['peak_kib'] / 1024:.0f} "
              f"| {inc[p, dtype, chunk]:.0f} | {m['ru_maxrss_kib'] / 1024:.0f} |")
    for dtype, chunk in (("fp32", "128"), ("bf16", "128")):
        r = inc["ours", dtype, chunk] / inc["naive", dtype, "128"]
        print(f"\n{dtype}, chunk_size={chunk}: increment ours/naive = {r:.3f} "
              f"(target <= 0.25: {'met' if r <= 0.25 else 'NOT met'})", end="")
    print()


if __name__ == "__main__":
    main()
