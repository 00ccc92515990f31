"""`phantomclip trace --run DIR`: how the trainer/engine gap grows along a training run, from the weights
`train --keep-snapshots N` kept.

Phases (`run_growth` reads top to bottom): `open_run` (the run's config, its snapshots and the tokens kept with them)
-> per snapshot, `load_snapshot` into the run's model, then `measure_tokens` on two token sets: the *reference*
tokens (those sampled with the first snapshot's weights, the same at every step: only the network changes) and the
snapshot's *own* tokens (those sampled with its weights: the network and the token mix change) -> `decompose`, the
change of mean |β| from the first snapshot split into mix, within-bucket and interaction parts (metrics.shift_share).

Per token, as in the trainer (metrics.ratio_split at α = 0): β = logp − logp_engine = β_kernel + β_precision, with
logp_engine the engine's own decode path teacher-forced over the tokens (`LocalEngine.rescore`), logp_shadow a
prefill of the same weights in the engine's recipe, and logp the trainer's recipe. Buckets are of the engine's
probability (metrics.PROB_EDGES).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..base.devices import describe_device
from ..base.errors import PhantomclipError, PhantomclipWarning
from ..base.files import JSON_ERRORS, InputError, check_input, json_reason, printable, read_input
from ..engines.local import LocalEngine, Rollout, SamplingParams
from ..maths.metrics import PROB_EDGES, mean_or_nan, prob_buckets, shift_share
from ..precision.recipes import RECIPES, Recipe, apply_recipe, cpu_description, get_recipe
from ..precision.scoring import LOGIT_STATS, score
from ..runs.checks import check_snapshot
from ..runs.read import read_json_object
from ..runs.rundir import RunDir
from .depth import site_errors


class GrowthError(PhantomclipError):
    """A run directory `trace --run` cannot analyse; the message says which flag or file to fix."""


@dataclass
class RunSnapshots:
    """What `open_run` finds in a run directory."""

    path: Path
    config: dict
    """the run's config.json."""
    steps: list[int]
    """steps with a weights snapshot, ascending."""
    tokens: dict[int, dict]
    """step -> the tokens sampled with that snapshot's weights (prompt_ids, completion_ids)."""


def open_run(path: str | Path) -> RunSnapshots:
    """The run's config and its snapshots; one line naming the flag when it kept none."""
    run = RunDir(Path(path))
    config = read_json_object(run.path / "config.json", "run's config")
    check_run_config(run.path / "config.json", config)
    steps = run.snapshot_steps()
    if not steps:
        raise GrowthError(f"{run.path} holds no weight snapshots: train it with --keep-snapshots N (e.g. "
                          "--keep-snapshots 5) to analyse how β grows")
    tokens = {}
    for step in steps:
        p = run.snapshot_path(step, ".tokens.json")
        if p.exists():
            tokens[step] = read_tokens(p)
    if not tokens:
        raise GrowthError(f"{run.path}: no snapshot kept the tokens sampled with it (snapshots/step-*.tokens.json)")
    return RunSnapshots(path=run.path, config=config, steps=steps, tokens=tokens)


def check_run_config(path: Path, config: dict) -> None:
    """The keys of a run's config.json that `trace --run` reads, each of its type (a recipe a known one, the
    temperature a number > 0): one GrowthError line naming the file and key, not a KeyError later."""
    plan = config.get("plan")
    wanted = [("model", config.get("model"), str), ("temperature", config.get("temperature"), float),
              ("plan", plan, dict)]
    if isinstance(plan, dict):
        wanted += [(f"plan.{k}", plan.get(k), str) for k in ("engine_recipe", "trainer_recipe")]
    for key, value, kind in wanted:
        ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
        if ok and kind is float:
            ok = math.isfinite(value) and value > 0
        if ok and key.startswith("plan."):
            ok = value in RECIPES
        if not ok:
            want = {str: "a string", float: "a number > 0", dict: "a mapping"}[kind]
            want = f"one of {', '.join(RECIPES)}" if key.startswith("plan.") else want
            shown = "missing" if value is None else f"{value!r}"
            raise GrowthError(f"{path}: {key} is {shown}, not {want}: the run's config is damaged or not one train "
                              "wrote; restore it")


def read_tokens(path: Path) -> dict:
    """A snapshot's tokens file: prompt_ids and completion_ids, as many rows of each, lists of token ids (whole
    numbers >= 0), at least one completion token; one GrowthError line naming the file otherwise."""
    try:
        record = json.loads(read_input(path))
    except (InputError, *JSON_ERRORS) as e:
        why = e.reason if isinstance(e, InputError) else json_reason(e)
        raise GrowthError(f"{printable(str(path))} is not readable JSON ({why}): "
                          "restore it or remove it (its snapshot is then measured on the reference tokens only)"
                          ) from None
    rows = {k: record.get(k) if isinstance(record, dict) else None for k in ("prompt_ids", "completion_ids")}
    ids = lambda r: isinstance(r, list) and all(type(t) is int and t >= 0 for t in r)  # noqa: E731
    bad = [k for k, v in rows.items() if not isinstance(v, list) or not v or not all(ids(r) for r in v)]
    if not bad and (len(rows["prompt_ids"]) != len(rows["completion_ids"]) or not any(rows["completion_ids"])):
        bad = ["completion_ids"]
    if bad:
        raise GrowthError(f"{path}: {bad[0]} is missing or not rows of token ids (one per prompt, a completion token "
                          "at least): the file is damaged; restore it or remove it")
    empty = next((i for i, r in enumerate(rows["prompt_ids"]) if not r), None)
    if empty is not None:  # every prompt the engine sampled from has a token: scoring the row would fail deep down
        raise GrowthError(f"{path}: prompt_ids row {empty} is empty, where the engine's prompt was: the file is "
                          "damaged; restore it or remove it")
    return record


def load_snapshot(model: torch.nn.Module, run: RunSnapshots, step: int) -> bool:
    """The snapshot's weights into `model`, in place; False (with a warning naming it) for a missing or truncated
    file; one line naming both models when its tensors are another model's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = RunDir(run.path).snapshot_path(step)
    try:
        check_input(path)  # safetensors opens the path itself: a FIFO there would block it
    except InputError as e:
        raise GrowthError(f"{e}: restore the snapshot or remove it") from None
    try:
        weights = load_file(str(path))
    except (OSError, SafetensorError) as e:
        warnings.warn(f"{path}: cannot be read ({e}): skipped", PhantomclipWarning, stacklevel=2)
        return False
    check_snapshot(path, weights, model, str(run.config.get("model")))
    own = model.state_dict()
    with torch.no_grad():
        for k, v in weights.items():
            own[k].copy_(v)
    return True


def measure_tokens(master: torch.nn.Module, tokens: dict, config: dict, matmul: str, depth: bool = False) -> dict:
    """Per completion token [N] (float64): logp_engine (the engine's decode path, teacher-forced), β, β_kernel,
    β_precision, the engine-probability bucket, and the trainer's entropy and logit statistics (scoring.LOGIT_STATS:
    std, max, the token's margin) at that position; with `depth`, also `depth_errors` of the same two models on the
    same tokens (key 'depth')."""
    plan = config["plan"]
    engine = LocalEngine(master, recipe=get_recipe(plan["engine_recipe"]), matmul=matmul)
    params = SamplingParams(max_tokens=max(len(c) for c in tokens["completion_ids"]),
                            temperature=config["temperature"])
    given = Rollout(prompt_ids=tokens["prompt_ids"], completion_ids=tokens["completion_ids"], logp_engine=[],
                    logp_engine_processed=[])
    rescored = engine.rescore(given, params)
    packed = rescored.pack(0, device=next(master.parameters()).device)
    mask = packed["completion_mask"]  # [B, T]
    args = (packed["input_ids"], packed["attention_mask"], mask)
    # one head formula for both sides of β_precision (entropy on, as the trainer's call below: scoring's log-softmax
    # then gather; without the entropy it computes gather − logsumexp, another rounding of the same number)
    shadow = score(engine.model, engine.recipe, *args, temperature=config["temperature"])
    trainer_recipe = get_recipe(plan["trainer_recipe"])
    trainer_model = apply_recipe(master, trainer_recipe, matmul=matmul)
    trainer = score(trainer_model, trainer_recipe, *args, temperature=config["temperature"], logit_stats=True)
    eng = packed["logp_engine"][mask].double()  # [N]
    sh, lp = shadow.logp[mask].double(), trainer.logp[mask].double()  # [N] each
    out = {"logp_engine": eng, "beta": lp - eng, "beta_kernel": sh - eng, "beta_precision": lp - sh,
           "bucket": prob_buckets(eng), "entropy": trainer.entropy[mask].double(),
           **{name: col.double() for name, col in zip(LOGIT_STATS, trainer.logit_stats[mask].unbind(-1))}}
    if depth:
        out["depth"] = depth_errors(engine.model, engine.recipe, trainer_model, trainer_recipe,
                                    packed["input_ids"], packed["attention_mask"])
    return out


DEPTH_SITES = ("embed", "residual", "final_norm", "logits")
"""the sites `depth_errors` keeps (every layer's residual stream and the ends): the depth profile, not every module."""


DEPTH_SUB_BATCH = 8
"""rows per hooked forward: each holds a sub-batch's full logits [b, T, V] of both models at once."""


def depth_errors(engine_model: torch.nn.Module, engine_recipe: Recipe, trainer_model: torch.nn.Module,
                 trainer_recipe: Recipe, ids: torch.Tensor, attn: torch.Tensor) -> list[dict]:
    """Along the depth, on tokens ids / attn [B, T]: each kept site's relative error of the engine's recipe against
    the trainer's, ‖x_engine − x_trainer‖ / ‖x_trainer‖ over real tokens, and the trainer's largest activation there
    (depth.site_errors; the sites of `phantomclip trace`)."""
    b = DEPTH_SUB_BATCH
    errors = site_errors(engine_model, engine_recipe, trainer_model, trainer_recipe,
                         [(ids[s : s + b], attn[s : s + b]) for s in range(0, ids.shape[0], b)])
    return [{"site": name, "rel_error": e["rel_error"], "ref_max_abs": e["ref_max_abs"]} for name, e in errors.items()
            if name.split(".")[-1] in DEPTH_SITES]


def summarize_tokens(t: dict[str, torch.Tensor]) -> dict:
    """A token set's figures: mean |β| and of each part, the bucket mix and mean |β| per bucket, mean entropy and
    mean logit statistics."""
    k = len(PROB_EDGES) - 1
    counts = torch.bincount(t["bucket"], minlength=k).double()
    by_bucket = [mean_or_nan(t["beta"].abs()[t["bucket"] == i]) for i in range(k)]
    return {"tokens": int(t["beta"].numel()), "beta_abs_mean": mean_or_nan(t["beta"].abs()),
            "beta_kernel_abs_mean": mean_or_nan(t["beta_kernel"].abs()),
            "beta_precision_abs_mean": mean_or_nan(t["beta_precision"].abs()),
            "entropy_mean": mean_or_nan(t["entropy"]), **{f"{n}_mean": mean_or_nan(t[n]) for n in LOGIT_STATS},
            "bucket_share": (counts / counts.sum()).tolist(),
            "bucket_beta_abs_mean": by_bucket}


def decompose(first: dict[str, torch.Tensor], later: dict[str, torch.Tensor]) -> dict[str, float]:
    """The change of mean |β| from `first` to `later`, split into mix, within-bucket and interaction parts."""
    return shift_share(first["beta"].abs(), first["bucket"], later["beta"].abs(), later["bucket"], len(PROB_EDGES) - 1)


def weight_drift(model: torch.nn.Module, start: dict[str, torch.Tensor]) -> dict[str, float]:
    """‖θ‖ and ‖θ − θ_start‖ / ‖θ_start‖ over all floating-point weights (float64 sums)."""
    now = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    norm = math.sqrt(sum(v.double().square().sum().item() for v in now.values()))
    base = math.sqrt(sum(v.double().square().sum().item() for v in start.values()))
    moved = math.sqrt(sum((now[k].double() - start[k].double()).square().sum().item() for k in start))
    return {"norm": norm, "relative_drift": moved / base if base > 0 else float("nan")}


def run_growth(path: str | Path, matmul: str = "auto", device: torch.device | str = "cpu", console=None) -> dict:
    """Every snapshot of the run at `path`: β and its parts on the reference and own tokens, the weights' drift, and
    the shift-share decomposition of mean |β|'s change since the first snapshot, computed on `device`."""
    from ..models.load import load_model

    run = open_run(path)
    lm = load_model(run.config["model"], progress=console.print if console else (lambda *a: None))
    vocab = lm.model.get_input_embeddings().num_embeddings
    for step, tokens in run.tokens.items():
        top = max(t for rows in (tokens["prompt_ids"], tokens["completion_ids"]) for r in rows for t in r)
        longest = max(len(p) + len(c) for p, c in zip(tokens["prompt_ids"], tokens["completion_ids"]))
        if top >= vocab or longest > lm.context_length:
            what = (f"token id {top} is past {run.config['model']}'s vocabulary of {vocab}" if top >= vocab else
                    f"a row of {longest} tokens is longer than {run.config['model']}'s context of {lm.context_length}")
            raise GrowthError(f"{RunDir(run.path).snapshot_path(step, '.tokens.json')}: {what}: the file is another "
                              "model's or damaged")
    master = lm.model.float().to(device)
    reference_step = min(run.tokens)
    rows, first, start = [], {}, None
    for step in run.steps:
        if not load_snapshot(master, run, step):
            continue
        if start is None:
            start = {k: v.clone() for k, v in master.state_dict().items() if v.is_floating_point()}
        row = {"step": step, "weights": weight_drift(master, start)}
        sets = {"reference": run.tokens[reference_step], "own": run.tokens.get(step)}
        for name, tokens in sets.items():
            if tokens is None:
                continue
            t = measure_tokens(master, tokens, run.config, matmul, depth=name == "reference")
            first.setdefault(name, t)
            row[name] = {**summarize_tokens(t), "change_since_first": decompose(first[name], t)}
            if "depth" in t:
                row[name]["depth"] = t["depth"]
        rows.append(row)
    return {"run": str(run.path), "model": run.config["model"], "reference_step": reference_step,
            "prob_edges": list(PROB_EDGES), "device": describe_device(device),
            "cpu": cpu_description(matmul), "snapshots": rows}  # the machine, as diagnose records it
