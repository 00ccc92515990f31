"""`phantomclip engines`: what the real engine costs. The in-process engine and vLLM sample the same prompts
with the same seeds in the same dtype; start-up and sampling throughput are reported apart.

Every sequence runs to max_tokens (no stop token), so both engines sample the same number of tokens. Each
engine gets one warm-up call (vLLM's first call pays for its kernels' first use), then `repeats` timed calls:
tokens/s is the median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from ..base.devices import describe_device, resolve_device
from ..base.errors import PhantomclipError, check_field_types, check_number, check_seed
from ..base.numerics import dtype_name, parse_dtype
from ..models.load import BUNDLED_NAME
from ..models.prompts import bundled_prompts, encode_within
from . import ENGINE_KINDS, start_engine
from .local import SamplingParams

COMPARE_SCHEMA = 1
"""the version of `compare --json`'s layout (its first key, as every phantomclip result's: files.OWN_OUTPUT)."""


class CompareError(PhantomclipError):
    """A bad `engines` setting; the message says what to do."""


@dataclass
class CompareConfig:
    """What `phantomclip engines` times."""

    model: str = BUNDLED_NAME
    """model to sample from (as for diagnose)."""
    engines: list[str] = field(default_factory=lambda: list(ENGINE_KINDS))
    """engines to time: local and/or vllm."""
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    """engine dtypes to time."""
    n: int = 16
    """prompts per call (the first n bundled prompts)."""
    max_tokens: int = 64
    """tokens sampled per prompt; every row runs to the end."""
    repeats: int = 3
    """timed calls per engine and dtype, after one warm-up call."""
    seed: int = 0
    """sampling seed, the same for every engine."""
    device: str = "auto"
    """where the local engine runs: auto, cpu, cuda or cuda:N (devices.resolve_device). Its calls return host token
    lists, so each timed call ends with the device's work done."""

    def __post_init__(self):
        for name in ("engines", "dtypes"):
            if isinstance(getattr(self, name), str):
                setattr(self, name, [x.strip() for x in getattr(self, name).split(",") if x.strip()])

    def validate(self) -> None:
        """Refuse an unknown engine or dtype, or a count below 1, before any model loads."""
        check_field_types(self, CompareError)
        bad = [e for e in self.engines if e not in ENGINE_KINDS]
        if not self.engines or bad:
            raise CompareError(f"--engines {','.join(self.engines)!r}: use one or both of {', '.join(ENGINE_KINDS)}")
        for d in self.dtypes:
            try:
                parse_dtype(d)
            except ValueError as e:
                raise CompareError(f"--dtypes: {e}") from None
        if not self.dtypes:
            raise CompareError("--dtypes is empty: give e.g. fp32,bf16")
        for flag, v in (("--n", self.n), ("--max-tokens", self.max_tokens), ("--repeats", self.repeats)):
            check_number(flag, v, 1, integer=True, error=CompareError)
        check_seed("--seed", self.seed, error=CompareError)
        resolve_device(self.device)
        if "vllm" in self.engines:
            from .vllm import require_vllm

            require_vllm()


def compare_engines(cfg: CompareConfig, lm, say=print) -> list[dict]:
    """One row per (dtype, engine): start-up seconds, tokens per call, median seconds and tokens/s."""
    cfg.validate()
    prompts = encode_within(lm.tokenizer, bundled_prompts()[: cfg.n], cfg.max_tokens, lm.context_length)
    params = SamplingParams(max_tokens=cfg.max_tokens, seed=cfg.seed)
    rows = []
    for dname in cfg.dtypes:
        dtype = parse_dtype(dname)
        for kind in cfg.engines:
            say(f"{kind} engine, {dtype_name(dtype)}: starting")
            t0 = time.perf_counter()
            engine = start_engine(kind, lm, dtype)
            startup = time.perf_counter() - t0
            try:
                engine.generate(prompts, params)  # warm-up
                times, tokens = [], 0
                for _ in range(cfg.repeats):
                    t0 = time.perf_counter()
                    ro = engine.generate(prompts, params)
                    times.append(time.perf_counter() - t0)
                    tokens = sum(len(c) for c in ro.completion_ids)
            finally:
                engine.close()
            seconds = statistics.median(times)
            rows.append({"engine": kind, "dtype": dtype_name(dtype), "startup_seconds": startup, "tokens": tokens,
                         "seconds": seconds, "tokens_per_s": tokens / seconds, "all_seconds": times})
    for row in rows:  # each engine against the local engine of the same dtype
        base = next((r for r in rows if r["engine"] == "local" and r["dtype"] == row["dtype"]), None)
        row["vs_local"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def run_compare(cfg: CompareConfig, console=None) -> dict:
    """The `engines` job: load the model, time the engines; {"config": ..., "rows": compare_engines(...)}."""
    from ..models.load import load_model

    say = console.print if console is not None else (lambda *a, **k: None)
    device = resolve_device(cfg.device)
    lm = load_model(cfg.model, progress=say)
    lm.model.to(device)
    return {"schema": COMPARE_SCHEMA, "config": asdict(cfg), "device": describe_device(device),
            "rows": compare_engines(cfg, lm, say=say)}
