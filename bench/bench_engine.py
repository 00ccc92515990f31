"""Sampling throughput of `engine.LocalEngine` against Hugging Face `generate` on the same weights.

Workload: bundled SmolLM2-135M, 16 prompts of 24 random token ids (seed 1), 64 sampled tokens each
(temperature 1, full vocabulary, no stop tokens: every sequence runs to 64), fp32 and bf16.
Baseline: `copy.deepcopy(master).to(dtype).generate(..., do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
max_new_tokens=64, min_new_tokens=64)`: plain PyTorch, native kernels. For bf16 also HF `generate` on the
emulated-matmul model (`apply_recipe(master, engine_recipe(dtype), matmul="emulated")`, the kernels LocalEngine
uses), which splits any gain into kernels vs engine loop. tokens/s = sampled tokens / seconds, median of
timed repeats after one warm-up, all paths of a dtype timed alternately in one process. A breakdown of one
decode step (weights read, matmuls alone, model forward, sampler) bounds what any engine loop can gain over HF
on the same kernels. Then LocalEngine at batch 64 x 64 tokens, to show batching.

    python bench/bench_engine.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from phantomclip.engine import LocalEngine, SamplingParams, sample_next_token
from phantomclip.models import load_model
from phantomclip.recipes import apply_recipe, engine_recipe

PROMPT_LEN, NEW = 24, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(100, 49000, (n, PROMPT_LEN), generator=g).tolist()


def run_engine(engine: LocalEngine, batch: list[list[int]]) -> int:
    out = engine.generate(batch, SamplingParams(max_tokens=NEW, seed=0))
    return sum(len(c) for c in out.completion_ids)


def run_hf(model, batch: list[list[int]], pad_id: int) -> int:
    ids = torch.tensor(batch)
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
        max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=pad_id,
    )
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


@torch.no_grad()
def step_ms(model, batch: list[list[int]], repeats: int = 5) -> dict[str, float]:
    """Median ms of the parts of one decode step at len(batch) rows (KV cache of ~56 tokens): reading every
    weight once, every nn.Linear's matmul alone (fp32, as both fp32 and emulated bf16 run them), the whole model
    forward, and one `sample_next_token` call."""
    from transformers import DynamicCache

    ids, cache, n = torch.tensor(batch), DynamicCache(), len(batch)
    model(input_ids=torch.cat([ids, ids[:, :32]], 1), cache=cache, use_cache=True, logits_to_keep=1)
    tok = ids[:, :1]
    weights = [m.weight.float() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}}
    logits, g = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1], torch.Generator().manual_seed(0)
    parts = {
        "read weights": lambda: [w.sum() for w in weights],
        "matmuls alone": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
        "model forward": lambda: model(input_ids=tok, cache=cache, use_cache=True),
        "sampler": lambda: sample_next_token(logits, g),
    }
    out = {}
    for k, fn in parts.items():
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[k] = 1000 * statistics.median(ts)
    return out


def measure(paths: dict, repeats: int) -> dict[str, float]:
    """tokens/s per path: one warm-up each, then `repeats` rounds timing every path in turn."""
    for fn in paths.values():
        fn()
    times = {k: [] for k in paths}
    tokens = {}
    for _ in range(repeats):
        for k, fn in paths.items():
            t0 = time.perf_counter()
            tokens[k] = fn()
            times[k].append(time.perf_counter() - t0)
    return {k: tokens[k] / statistics.median(ts) for k, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed repeat instead of three")
    args = ap.parse_args()
    reps = 1 if args.quick else 3
    lm = load_model("smollm2-135m", progress=lambda *a: None)
    master, pad_id = lm.model, lm.tokenizer.pad_token_id
    p16, p64 = prompts(16), prompts(64)
    rows, big, floor = [], {}, {}
    for name, dtype in DTYPES.items():
        engine = LocalEngine(master, dtype, matmul="emulated")
        hf_native = copy.deepcopy(master).to(dtype).eval()
        paths = {
            "LocalEngine": partial(run_engine, engine, p16),
            "HF generate, native kernels": partial(run_hf, hf_native, p16, pad_id),
        }
        if dtype != torch.float32:  # in fp32 the emulated model is the plain fp32 model
            hf_emul = apply_recipe(master, engine_recipe(dtype), matmul="emulated")
            paths["HF generate, emulated kernels"] = partial(run_hf, hf_emul, p16, pad_id)
        tps = measure(paths, reps)
        base = tps["HF generate, native kernels"]
        for k, v in tps.items():
            rows.append((name, k, v, v / base, 1000 * 16 / v))
        floor[name] = step_ms(engine.model, p16)
        big[name] = measure({"LocalEngine 64x64": partial(run_engine, engine, p64)}, reps)["LocalEngine 64x64"]
        del engine, hf_native, paths

    print(f"16 sequences x {NEW} sampled tokens, prompts of {PROMPT_LEN} tokens; median of {reps} after warm-up\n")
    print("| dtype | path | tokens/s | vs HF generate (native, same dtype) | ms per step (wall / 64, 16 rows) |")
    print("|---|---|---:|---:|---:|")
    for name, k, v, r, ms in rows:
        print(f"| {name} | {k} | {v:.0f} | {r:.2f}x | {ms:.0f} |")
    for name, k, v, r, _ in rows:
        if k == "LocalEngine":
            print(f"\n{name}: LocalEngine / HF generate = {r:.2f}x "
                  f"(target >= 1.5x: {'met' if r >= 1.5 else 'NOT met'})", end="")
    print("\n\n| dtype | read all weights (ms) | all matmuls alone (ms) | model forward (ms) | sampler (ms) "
          "| LocalEngine step (ms) | HF generate step (ms) | ceiling vs HF (HF step / forward) |\n|---|" + "---:|" * 7)
    for name in DTYPES:
        ms, f = {k: m for n, k, _, _, m in rows if n == name}, floor[name]
        hf = ms["HF generate, native kernels"]
        print(f"| {name} | {f['read weights']:.0f} | {f['matmuls alone']:.0f} | {f['model forward']:.0f} "
              f"| {f['sampler']:.0f} | {ms['LocalEngine']:.0f} | {hf:.0f} | {hf / f['model forward']:.2f}x |")
    print("\n\n| dtype | LocalEngine 16 x 64 tokens/s | LocalEngine 64 x 64 tokens/s | gain from batching |"
          "\n|---|---:|---:|---:|")
    for name in DTYPES:
        small = next(v for n, k, v, _, _ in rows if n == name and k == "LocalEngine")
        print(f"| {name} | {small:.0f} | {big[name]:.0f} | {big[name] / small:.2f}x |")


if __name__ == "__main__":
    main()
