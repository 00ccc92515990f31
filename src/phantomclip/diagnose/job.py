"""The `diagnose` job: before any training, measure the trainer/engine gap β for a model and a precision
contract, and say how much of PPO's trust region it eats.

Phases (`run_diagnose` reads top to bottom): `prepare` the model and prompts -> `sample` completions with an
engine in `engine_dtype` (its own decode-path log-probs, logp_engine) -> `score_recipe` the same tokens with the
shadow (the trainer's forward in the engine's dtype, logp_shadow) and each trainer recipe (logp; and, for batch
invariance, some sequences again one at a time: `score_alone`) -> `reference` (both engine columns) -> `figures`,
comparing token by token at α = 0, where log r = logp − logp_engine = β (and what each RL framework would log for
the same tokens, maths/frameworks.py; and what each correction knob does to the first recipe's β, diagnose/knobs.py) ->
`result_dict`. With --drift K, `sample` also pushes the unchanged weights into the engine K times before closing it
and re-reads the same tokens after each push (engines/drift.py). Figures are defined in docs/metrics.md; the
verdict and the tables are diagnose/text.py's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Literal

import torch

from .. import DIAGNOSE_SCHEMA
from ..base.console import progress_bar
from ..base.devices import clock, describe_device, resolve_device, software_versions
from ..base.files import rounded
from ..base.numerics import parse_dtype
from ..engines import start_engine
from ..engines.drift import first_rows, measure_drift
from ..engines.local import Rollout
from ..engines.vllm_memory import BesideVllm
from ..maths.frameworks import FRAMEWORKS, framework_figures
from ..maths.metrics import (
    mean_or_nan,
    mismatch_stats,
    pearson,
    quantile_or_nan,
    trust_region_split,
)
from ..models.load import LoadedModel, load_model, stop_token_ids
from ..models.prompts import bundled_prompts, encode_within, read_prompts
from ..precision.recipes import apply_recipe, check_fits, cpu_description, get_recipe, without_quant
from ..precision.scoring import score
from ..routing import routes as routing
from ..routing.figures import route_figures, route_split
from .config import DiagnoseConfig
from .fp8 import fp8_figures, plain_engine_reads
from .knobs import knob_figures
from .recorded import (
    check_belongs,
    peek,
    phantom_shares,
    read_sampled,
    recorded_config,
    recorded_trainer,
    save_rollouts,
)
from .records import Figures, Prepared, Reference, Sampled, Scored, concat_batches, sampled_from_rollouts

if TYPE_CHECKING:
    from rich.console import Console


# -------------------------------------------------------------------------------------------- phases


def run_diagnose(cfg: DiagnoseConfig, console: Console | None = None, lm: LoadedModel | None = None) -> dict:
    """Run the diagnose job and return every figure as a JSON-ready dict (`files.write_json`); the words that
    say what they mean are `diagnose.text.with_verdict`'s. With --rollouts, the file's recorded settings replace the
    flags' first (recorded.recorded_config). `lm`: cfg.model already loaded (a post-mortem's steps share it)."""
    cfg = settled(cfg)
    prep, sampled, scored, ref = measure(cfg, console, lm)
    figs = figures(cfg, scored, ref, sampled.mask)
    phantom_shares(figs.recipes, {n: scored[n].logp for n in cfg.trainer}, ref.logp_engine, sampled.mask, sampled,
                   (cfg.epsilon, cfg.epsilon_high))  # where the records carry their advantages
    figs.recorded_trainer = recorded_trainer(cfg, sampled, {n: measured_pair(cfg, sampled, scored[n])
                                                            for n in cfg.trainer})  # where they carry its log-probs
    if sampled.routes:
        figs.routing, beta_rest = route_phase(cfg, prep, sampled, scored, ref)
        figs.per_token[cfg.trainer[0]]["beta_rest"] = rounded(beta_rest[sampled.mask])  # the answer's replay test
    return result_dict(cfg, prep, sampled, ref, figs)


def settled(cfg: DiagnoseConfig) -> DiagnoseConfig:
    """The config as the run measures it: validated, and with --rollouts the engine and sampling the file recorded in
    place of the flags' (their notes in `recorded_notes`)."""
    cfg.validate()
    if not cfg.rollouts:
        return cfg
    cfg, notes = recorded_config(cfg, peek(cfg.rollouts))
    cfg.recorded_notes = notes
    cfg.validate()
    return cfg


def measure(
    cfg: DiagnoseConfig, console: Console | None = None, lm: LoadedModel | None = None,
) -> tuple[Prepared, Sampled, dict[str, Scored], Reference]:
    """The phases before the figures: the prepared model, the sampled tokens, every recipe's scores (the shadow's
    included) and the reference columns, as unrounded tensors (what the figures and the tests compare)."""
    cfg.validate()
    say = console.print if console is not None else (lambda *a, **k: None)
    prep = prepare(cfg, say, lm)
    with progress_bar(console) as progress:
        sampled = read_sampled(cfg, prep.lm) if cfg.rollouts else sample(cfg, prep, progress, say)
        names = scored_recipes(cfg)
        shadow = names[0]
        scored = {}
        for name in names:
            scored[name] = score_recipe(cfg, prep, sampled, name, name == shadow, progress)
            if len(scored) == 1:  # the shadow: recorded tokens of another checkpoint stop here; the pace is known
                if cfg.rollouts and cfg.checkpoint_lag == 0:
                    check_belongs(cfg, *measured_pair(cfg, sampled, scored[name]), sampled.mask, name)
                say(cost_line(sampled, scored[name], len(names)), markup=False)
    plain = without_quant(get_recipe(shadow)).name  # an FP8 engine's shadow without its quantisers (β_quant)
    return prep, sampled, scored, reference(sampled, scored[shadow], shadow, scored[plain] if plain != shadow else None)


def measured_pair(cfg: DiagnoseConfig, sampled: Sampled, shadow: Scored) -> tuple[torch.Tensor, torch.Tensor]:
    """(the shadow's, the engine's) log-probs [n, T] in the column the engine measured: processed ones are
    renormalised over the kept tokens (logp − log S)."""
    if cfg.logprobs_mode == "processed":
        return shadow.logp - shadow.log_kept, sampled.logp_engine_processed
    return shadow.logp, sampled.logp_engine


def scored_recipes(cfg: DiagnoseConfig) -> list[str]:
    """The recipes a run scores, in order: the shadow (the engine dtype's plain recipe) first, since every recipe's
    split needs it, then --trainer's; a recipe that is the shadow is scored once."""
    shadow = cfg.engine_recipe()  # an FP8 engine's shadow carries its quantisers; the plain one comes second
    return list(dict.fromkeys([shadow.name, without_quant(shadow).name, *cfg.trainer]))


def cost_line(sampled: Sampled, first: Scored, recipes: int) -> str:
    """What the run has cost and what is left, at the pace measured on the first recipe: every recipe scores the same
    tokens, so each costs about as much as the first (batch invariance's rows alone included)."""
    tokens = int(sampled.mask.sum())
    each = first.seconds + first.seconds_alone
    return (f"cost: sampled {tokens} tokens in {sampled.seconds:.0f} s; scored recipe 1 of {recipes} in {each:.0f} s, "
            f"about {(recipes - 1) * each:.0f} s to go")


def prepare(cfg: DiagnoseConfig, say: Callable[..., None], lm: LoadedModel | None = None) -> Prepared:
    """Load the model (unless `lm` is it) and the prompts, refuse a prompt that cannot fit the context, resolve dtype
    and kernels (with --rollouts the prompts are the records', checked as they are read: recorded.read_sampled)."""
    prompts_text = (read_prompts(cfg.prompts, limit=cfg.n) if cfg.prompts  # n are used
                    else [] if cfg.rollouts else bundled_prompts())
    device = resolve_device(cfg.device)
    lm = lm or load_model(cfg.model, progress=say)
    check_fits(lm.model.to(device), scored_recipes(cfg))  # a recipe the model's shapes refuse: before sampling
    limit, what = lm.context_length, "the model's context"
    if cfg.engine == "vllm" and cfg.max_model_len and cfg.max_model_len < limit:
        limit, what = cfg.max_model_len, "--max-model-len"
    prompt_ids = [] if cfg.rollouts else encode_within(lm.tokenizer, prompts_text, cfg.max_tokens, limit, what)
    return Prepared(
        lm=lm, prompt_ids=[prompt_ids[i % len(prompt_ids)] for i in range(cfg.n if prompt_ids else 0)],
        engine_dtype=parse_dtype(cfg.engine_dtype), matmul=cfg.matmul,
        truncation=(cfg.top_k, cfg.top_p, cfg.min_p) if cfg.sampling(0).truncated else None, device=device,
    )


def sample(cfg: DiagnoseConfig, prep: Prepared, progress, say: Callable[..., None]) -> Sampled:
    """Sample the completions batch by batch (each batch with its own seed), with --drift measure the engine's drift
    on its first batch (engines/drift.py), then close the engine."""
    stop = stop_token_ids(prep.lm)
    batches = [prep.prompt_ids[i : i + cfg.batch_size] for i in range(0, cfg.n, cfg.batch_size)]
    if cfg.engine == "vllm":
        say(f"starting vLLM ({cfg.engine_dtype}, {cfg.logprobs_mode} log-probs); about 30 s on a CPU")
    longest = max(len(p) for p in prep.prompt_ids) + cfg.max_tokens
    # MoE models: the engine's routes as it decodes (an MoE family without an adapter is refused here, in one line)
    routes = [] if cfg.routing and cfg.engine == "local" and routing.routers(prep.lm.model) else None
    if cfg.routing and cfg.engine != "local" and routing.is_moe(prep.lm.model):
        say(routing.no_engine_routes(cfg.engine), markup=False, soft_wrap=True)  # one line, as the terminal wraps it
    beside = BesideVllm(batch_tokens=cfg.batch_size * longest, training=False, share=cfg.vllm_memory_share)
    engine = start_engine(cfg.engine, prep.lm, prep.engine_dtype, matmul=prep.matmul, logprobs_mode=cfg.logprobs_mode,
                          max_model_len=cfg.max_model_len or None, seed=cfg.seed, weight_sync=bool(cfg.drift),
                          beside=beside, recipe=cfg.engine_recipe())
    try:
        task = progress.add_task(f"sampling ({cfg.engine} {cfg.engine_dtype} engine)", total=cfg.n)
        rollouts: list[Rollout] = []
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            if routes is None:
                rollouts.append(engine.generate(batch, cfg.sampling(i, stop)))
            else:
                rollout, batch_routes = routing.generate_with_routes(engine, batch, cfg.sampling(i, stop))
                rollouts.append(rollout), routes.append(batch_routes)
            progress.advance(task, len(batch))
        seconds = clock(prep.device) - t0
        info = engine.describe()
        # drift runs on the engine already started (vLLM's start-up is about 30 s) and before anything is scored
        drift = (measure_drift(engine, prep.lm.model, first_rows(rollouts[0]), cfg.sampling(0, stop), cfg.drift,
                               progress) if cfg.drift else None)
    finally:  # a real engine holds a process and its KV cache: free them before scoring, or on any error
        engine.close()
    # an FP8 engine's samples read by the plain engine: the local engine's forced decode; vLLM has none, so the
    # engines' own gap goes unmeasured there (β's split needs only the shadows: diagnose.fp8.fp8_figures)
    reads_plain = cfg.engine_recipe().quant and cfg.engine == "local"
    plain = (concat_batches([r.pack(prep.lm.tokenizer.pad_token_id)["logp_engine"] for r in plain_engine_reads(
             cfg, prep.lm.model, prep.matmul, rollouts, stop, progress)]) if reads_plain else None)
    if cfg.save_rollouts:
        save_rollouts(cfg, prep, rollouts, routes, info)
    return sampled_from_rollouts(rollouts, prep.lm.tokenizer.pad_token_id, measured_column(info, prep.truncation),
                                 info, seconds, drift=drift, logp_engine_plain=plain, routes=routes)


def measured_column(info: dict, truncation: tuple | None) -> Literal["raw", "processed"] | None:
    """Which engine column is the engine's own: an engine with a `logprobs_mode` (vLLM) computes only that one;
    without truncation the two columns are the same numbers (S = 1), so both are measured. None: both."""
    return info.get("logprobs_mode") if truncation else None


def score_recipe(cfg: DiagnoseConfig, prep: Prepared, sampled: Sampled, name: str, shadow: bool, progress) -> Scored:
    """Re-score the sampled tokens with the model laid out for recipe `name`, at the sampling temperature."""
    recipe = get_recipe(name)
    task = progress.add_task(f"scoring ({name}{', shadow' if shadow else ''})", total=len(sampled.packed))
    t0 = time.perf_counter()
    model = apply_recipe(prep.lm.model, recipe, matmul=prep.matmul)
    logp, entropy, log_kept, routes = [], [], [], []
    nuclei = sampled.recorded.nuclei if sampled.recorded is not None else None  # the engine's own, where recorded
    for i, host in enumerate(sampled.packed):
        p = {k: v.to(prep.device) for k, v in host.items()}  # the batch on the device; its scores back on the host
        with routing.capture(model) if sampled.routes else contextlib.nullcontext() as recorder:
            sc = score(model, recipe, p["input_ids"], p["attention_mask"], p["completion_mask"],
                       temperature=cfg.temperature, truncation=prep.truncation,
                       nucleus=nuclei[i].to(prep.device) if nuclei else None)
        if recorder is not None:
            routes.append(recorder.routes(routing.full_layout(p["input_ids"].shape[1]), *p["input_ids"].shape))
        logp.append(sc.logp.cpu())  # [B_i, T_i]
        entropy.append(sc.entropy.cpu())  # [B_i, T_i]
        log_kept.append(sc.log_kept.cpu() if prep.truncation else torch.zeros_like(logp[-1]))  # [B_i, T_i]
        progress.advance(task)
    seconds = clock(prep.device) - t0
    alone = (score_alone(cfg, sampled, model, name, progress, prep.device)
             if cfg.batch_invariance and name in cfg.trainer else {})
    return Scored(logp=concat_batches(logp), entropy=concat_batches(entropy), log_kept=concat_batches(log_kept),
                  seconds=seconds, routes=routes or None, **alone)


BATCH_INVARIANCE_SEQUENCES = 12
"""at most this many sequences are scored alone for split.batch: every one scored alone costs a forward of its own,
and all n of them would cost about as much as the batched scoring again. 16 cost 29.6-30.8% of the bundled model's
default run on an AMX Xeon, where sampling is fast (bench/benchmarks/bench_diagnose_parts.py), against a target of
30%; 12 (about 500 tokens) measure β_batch's mean and tail at three quarters of that."""


def alone_rows(n: int, k: int = BATCH_INVARIANCE_SEQUENCES) -> list[int]:
    """The rows scored alone: all n when n ≤ k, else k spread evenly over them (row i·n // k), so every batch of
    the run is represented."""
    return list(range(n)) if n <= k else [i * n // k for i in range(k)]


def score_alone(cfg: DiagnoseConfig, sampled: Sampled, model, name: str, progress,
                device: torch.device | str = "cpu") -> dict:
    """Scored's `logp_alone` and `seconds_alone`: each of the `alone_rows` scored as a batch of one without its
    padding (micro-batch 1), by the same `score` call as the batch, with `model` laid out for recipe `name`."""
    recipe, rows = get_recipe(name), alone_rows(sampled.mask.shape[0])
    task = progress.add_task(f"scoring alone ({name}, batch invariance)", total=len(rows))
    t0 = time.perf_counter()
    logp = torch.zeros(sampled.mask.shape)  # [n, T]
    for row in rows:
        p, b = sampled.packed[row // cfg.batch_size], row % cfg.batch_size
        cols = p["attention_mask"][b].nonzero().squeeze(-1)  # [L] the row's own tokens (contiguous), no padding
        ids = p["input_ids"][b, cols][None].to(device)  # [1, L]
        sc = score(model, recipe, ids, torch.ones_like(ids), p["completion_mask"][b, cols][None].to(device),
                   temperature=cfg.temperature)
        logp[row, cols] = sc.logp[0].cpu()  # [L]
        progress.advance(task)
    return {"logp_alone": logp, "seconds_alone": clock(device) - t0}


def route_phase(cfg: DiagnoseConfig, prep: Prepared, sampled: Sampled, scored: dict[str, Scored],
                ref: Reference) -> tuple[dict, torch.Tensor]:
    """MoE models: every scored recipe's routes against the engine's, and the first trainer recipe's β split into
    β_route (its own routes against the engine's, one more forward with the engine's replayed) and β_rest
    (figures.route_figures; keys in docs/metrics.md); with β_rest [n, T] itself."""
    first = cfg.trainer[0]
    recipe = get_recipe(first)
    model = apply_recipe(prep.lm.model, recipe, matmul=prep.matmul)
    replayed = concat_batches(routing.replayed_logprobs(model, recipe, sampled.packed, sampled.routes, cfg.temperature,
                                                 prep.device))  # [n, T]
    split = route_split(scored[first].logp, replayed, ref.logp_engine)  # [n, T] each
    where = concat_batches([p["attention_mask"] for p in sampled.packed]).bool()  # [n, T] real tokens
    own = {name: routing.concat(s.routes) for name, s in scored.items() if s.routes}
    figures = route_figures(routing.concat(sampled.routes), own, where=where,
                                    experts=_num_experts(prep.lm.model), split_recipe=first, split=split,
                                    mask=sampled.mask, eps_low=cfg.epsilon, eps_high=cfg.epsilon_high,
                                    source="recorded with the tokens" if cfg.rollouts else "local engine decode")
    return figures, split["beta_rest"]


def _num_experts(model) -> int:
    cfg = model.config
    return int(next(getattr(cfg, k) for k in routing.EXPERT_KEYS if getattr(cfg, k, None)))


def reference(sampled: Sampled, shadow: Scored, shadow_name: str, plain: Scored | None = None) -> Reference:
    """Both engine columns in full: the one the engine did not measure is rebuilt with the shadow's kept mass S
    (processed = full − log S). `plain`: an FP8 engine's shadow without the quantisers."""
    raw, processed = sampled.logp_engine, sampled.logp_engine_processed  # [n, T] each
    if sampled.measured == "raw":
        processed = raw - shadow.log_kept  # [n, T]
    elif sampled.measured == "processed":
        raw = processed + shadow.log_kept  # [n, T]
    rebuilt = {"raw": "logp_engine_processed", "processed": "logp_engine"}.get(sampled.measured)
    return Reference(logp_engine=raw, logp_engine_processed=processed, logp_shadow=shadow.logp, shadow=shadow_name,
                     rebuilt=rebuilt, logp_plain_shadow=None if plain is None else plain.logp,
                     logp_engine_plain=sampled.logp_engine_plain)


def figures(cfg: DiagnoseConfig, scored: dict[str, Scored], ref: Reference, mask: torch.Tensor) -> Figures:
    """The kernel part once, then every trainer recipe's statistics and per-token arrays."""
    kernel = _stats(cfg, ref.logp_shadow, ref.logp_engine, mask)
    recipes, per_token = {}, {}
    for name in cfg.trainer:
        recipes[name], per_token[name] = recipe_figures(cfg, scored[name], ref, kernel, mask)
    first = cfg.trainer[0]
    knobs = knob_figures(scored[first].logp - ref.logp_engine, mask, cfg.knob_settings(), cfg.keep_share,
                         cfg.knob_length or cfg.max_tokens)  # β [n, T] of the user's recipe
    fp8 = (fp8_figures(cfg, {name: scored[name].logp for name in cfg.trainer}, engine=ref.logp_engine,
                       shadow=ref.logp_shadow, plain_shadow=ref.logp_plain_shadow, plain_engine=ref.logp_engine_plain,
                       shadow_name=ref.shadow, mask=mask, stats=lambda a, b: _pick(_stats(cfg, a, b, mask)))
           if ref.logp_plain_shadow is not None else None)
    return Figures(kernel=kernel, recipes=recipes, per_token=per_token, knobs={"recipe": first, **knobs}, fp8=fp8)


def recipe_figures(
    cfg: DiagnoseConfig, s: Scored, ref: Reference, kernel: dict, mask: torch.Tensor
) -> tuple[dict, dict]:
    """One recipe: its mismatch statistics with the precision/kernel split (and the batch layout's part, where the
    rows were scored alone), each selected framework's own figures on the same tokens (maths/frameworks.py),
    truncation's bias when sampling truncated, and its per-token β, entropy and β_precision."""
    stats = _stats(cfg, s.logp, ref.logp_engine, mask)
    stats["seconds"] = s.seconds
    # an FP8 engine: precision against the shadow without the quantisers, β_quant between the two shadows
    base = ref.logp_shadow if ref.logp_plain_shadow is None else ref.logp_plain_shadow
    stats["split"] = {"precision": _pick(_stats(cfg, s.logp, base, mask)), "kernel": _pick(kernel)}
    if ref.logp_plain_shadow is not None:
        stats["split"]["quant"] = _pick(_stats(cfg, ref.logp_plain_shadow, ref.logp_shadow, mask))
    if s.logp_alone is not None:
        rows = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)  # [n]
        rows[alone_rows(mask.shape[0])] = True
        stats["split"]["batch"] = _pick(_stats(cfg, s.logp, s.logp_alone, mask & rows[:, None]))
        stats["seconds_alone"] = s.seconds_alone
    stats["split"]["correlation"] = _correlation(s.logp - ref.logp_shadow, ref.logp_shadow - ref.logp_engine, mask)
    stats["frameworks"] = framework_figures(s.logp, ref.logp_engine, mask, cfg.framework)
    if cfg.sampling(0).truncated and "trl" in stats["frameworks"]:
        # TRL's figures compare its trainer's log-probs (temperature, full vocabulary: the fused head's) with vLLM's
        # processed ones, which it asks for (trl 1.16 generation/vllm_generation.py logprobs_mode=
        # "processed_logprobs"; grpo_trainer.py: old_per_token_logps − sampling_per_token_logps): top-p's log S is in
        # its IS ratio and its logp difference, as here
        stats["frameworks"]["trl"] = FRAMEWORKS["trl"](s.logp, ref.logp_engine_processed, mask)
    tokens = {"beta": rounded((s.logp - ref.logp_engine)[mask]), "entropy": rounded(s.entropy[mask]),
              "beta_precision": rounded((s.logp - base)[mask])}
    if cfg.sampling(0).truncated:
        stats["truncation"] = truncation_stats(cfg, s, ref, mask)
        tokens["log_kept"] = rounded(s.log_kept[mask])
    return stats, tokens


def result_dict(cfg: DiagnoseConfig, prep: Prepared, sampled: Sampled, ref: Reference, figs: Figures) -> dict:
    """Everything as one JSON-ready dict (keys in docs/metrics.md)."""
    lm, mask = prep.lm, sampled.mask
    seq_index, position = _token_index(mask)
    tokens = int(mask.sum())
    return {
        "schema": DIAGNOSE_SCHEMA,
        "config": asdict(cfg),
        "versions": software_versions(),
        "cpu": cpu_description(cfg.matmul),
        "device": describe_device(prep.device),
        "model": {
            "name": lm.name, "source": lm.source, "parameters": sum(p.numel() for p in lm.model.parameters()),
            "layers": getattr(lm.model.config, "num_hidden_layers", None),
            "vocab": lm.model.get_input_embeddings().weight.shape[0],
        },
        "engine": {
            **sampled.info, "sequences": sampled.mask.shape[0], "tokens": tokens,
            "nonfinite_logprobs": sampled.nonfinite,
            "rebuilt_column": ref.rebuilt, "seconds": sampled.seconds, "tokens_per_s": tokens / sampled.seconds,
        },
        "trust_region": {"epsilon_low": cfg.epsilon, "epsilon_high": cfg.epsilon_high,
                         "log_low": math.log1p(-cfg.epsilon), "log_high": math.log1p(cfg.epsilon_high)},
        "shadow": {"recipe": ref.shadow, "kernel": figs.kernel},
        "recipes": figs.recipes,
        "knobs": figs.knobs,
        **({"drift": sampled.drift.as_dict()} if sampled.drift else {}),
        **({"fp8": figs.fp8} if figs.fp8 else {}),
        **({"routing": figs.routing} if figs.routing else {}),
        **({"recorded_trainer": figs.recorded_trainer} if figs.recorded_trainer else {}),
        "tokens": {
            "sequence": seq_index, "position": position, "logp_engine": rounded(ref.logp_engine[mask]),
            "logp_engine_processed": rounded(ref.logp_engine_processed[mask]),
            "beta_kernel": rounded((ref.logp_shadow - ref.logp_engine)[mask]),
            **({"beta_quant": rounded((ref.logp_plain_shadow - ref.logp_shadow)[mask])} if figs.fp8 else {}),
            **({"logp_engine_plain": rounded(ref.logp_engine_plain[mask])}
               if figs.fp8 and ref.logp_engine_plain is not None else {}),
            "per_recipe": figs.per_token,
        },
    }


# ------------------------------------------------------------------------------------------- helpers

SPLIT_KEYS = ("tokens", "beta_mean", "beta_abs_mean", "beta_abs_p99", "beta_abs_max", "outside_trust_region")
"""the figures kept for each part of the split and for the truncation comparisons."""


def _stats(cfg: DiagnoseConfig, logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict:
    """mismatch_stats of logp against ref [n, T], with this run's trust region and sequence-mask cap."""
    return mismatch_stats(logp, ref, mask, cfg.epsilon, cfg.epsilon_high, cfg.seq_mask_cap)


def _correlation(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Pearson correlation of a and b [B, T] over the finite masked tokens (NaN if either is constant)."""
    ok = mask & torch.isfinite(a) & torch.isfinite(b)  # [B, T]
    return pearson(a[ok], b[ok])


def _pick(stats: dict) -> dict:
    return {k: stats[k] for k in SPLIT_KEYS}


def truncation_stats(cfg: DiagnoseConfig, s: Scored, ref: Reference, mask: torch.Tensor) -> dict:
    """What top-p / top-k / min-p do to the ratio when the engine reports processed log-probs.

    logp_engine_processed = logp_engine − log S, so the naive ratio logp − logp_engine_processed = β + log S:
    every token is pushed down by −log S ≥ 0 although nothing changed. Renormalising the trainer's log-probs
    over its own kept set (logp − log S_trainer) removes that bias up to the difference of the two kept masses.
    """
    eps = (cfg.epsilon, cfg.epsilon_high)
    ok = mask & torch.isfinite(ref.logp_engine) & torch.isfinite(ref.logp_engine_processed) & torch.isfinite(s.logp)
    log_kept = s.log_kept[ok].double()  # [N] log S per token, trainer side
    out_naive = trust_region_split((s.logp - ref.logp_engine_processed).double()[ok], *eps)  # [N] each
    out_beta = trust_region_split((s.logp - ref.logp_engine).double()[ok], *eps)  # [N] each
    pushed = (out_naive[0] | out_naive[1]) & ~(out_beta[0] | out_beta[1])  # [N] outside only because of log S
    return {
        "log_kept_mean": mean_or_nan(log_kept),
        "kept_mass_p10": math.exp(quantile_or_nan(log_kept, 0.1)),
        "kept_mass_min": math.exp(log_kept.min().item()) if log_kept.numel() else math.nan,
        "pushed_out": mean_or_nan(pushed),
        "naive": _pick(_stats(cfg, s.logp, ref.logp_engine_processed, mask)),
        "corrected": _pick(_stats(cfg, s.logp - s.log_kept, ref.logp_engine_processed, mask)),
    }


def _token_index(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """For each True of mask [B, T]: its row and its position within the row's completion."""
    rows, cols = mask.nonzero(as_tuple=True)  # [N] each
    first = mask.float().argmax(-1)  # [B] first completion column
    return rows.tolist(), (cols - first[rows]).tolist()
