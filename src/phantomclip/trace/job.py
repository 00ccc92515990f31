"""Where β is born: the error of a precision recipe against a reference, module by module along the depth, how a
logit error becomes a log-prob error, how much of β rounding the weights alone causes, and which modules kept in
fp32 remove most of it.

All comparisons run the recipe and the reference on the same tokens (completions sampled once by an fp32 engine).
Activations are reduced to statistics as they are produced: the batch runs in sub-batches, the reference's
outputs of one sub-batch are held until the recipe's forward of that sub-batch has consumed them.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from .. import SCHEMA_VERSION
from ..base.devices import clock, describe_device, resolve_device, synchronize
from ..base.errors import check_field_types, check_number, check_seed
from ..base.numerics import round_to
from ..engines.local import LocalEngine, SamplingParams
from ..maths.loss import KNOBS
from ..maths.metrics import pearson, trust_region_split
from ..models.load import LoadedModel, load_model, stop_token_ids
from ..models.prompts import bundled_prompts, encode_within
from ..precision.recipes import (
    ATTENTION_FP32,
    MODULE_ROLES,
    Recipe,
    apply_recipe,
    check_fits,
    cpu_description,
    get_recipe,
    lm_head,
    resolve_matmul,
)
from ..precision.scoring import score
from ..routing.depth import trace_routing
from .depth import ErrorStats, SiteHooks, TraceError, full_logits, trace_sites

KEEP_FP32 = {"lm_head": "lm_head", "norm": "norm", "final-norm": "final_norm", "attention-softmax": ATTENTION_FP32,
             "all": "all"}
"""--keep-fp32 names -> recipe module roles ('all': the whole model in fp32, a check that β then vanishes)."""
PROB_BUCKETS = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)
"""edges of the reference-probability buckets for the first-order analysis."""
Say = Callable[..., None]
"""where progress lines go (the console's print, or nowhere)."""


@dataclass
class TraceConfig:
    """One `phantomclip trace` run."""

    model: str = "smollm2-135m"
    """bundled 'smollm2-135m', 'tiny-random[:seed[:init_std]]', 'tiny-moe[:seed[:init_std]]' (a random 2-layer MoE),
    a model directory or a hub id."""
    recipe: str = "bf16"
    """the precision recipe to trace (fp32, bf16, fp16, bf16-autocast, fp32-head)."""
    against: str = "fp32"
    """the reference recipe."""
    keep_fp32: str = ""
    """comma-separated modules the traced recipe keeps in fp32: lm_head, norm, final-norm, attention-softmax."""
    n: int = 8
    """prompts (one completion each)."""
    max_tokens: int = 32
    """completion tokens per prompt."""
    seed: int = 0
    """sampling seed."""
    sub_batch: int = 2
    """sequences per forward pass (bounds the memory of held reference activations)."""
    what_if: bool = True
    """also rank the keep-fp32 options by gain per extra memory."""
    epsilon: float = KNOBS["epsilon"].default
    """trust region for the share of tokens outside it."""
    matmul: str = "auto"
    """low-precision matmul kernels: auto, native or emulated."""
    run: str | None = None
    """a run directory made with `train --keep-snapshots N`: trace how β grows along it instead (its model, recipes
    and kept tokens; of the other flags only --matmul applies)."""
    device: str = "auto"
    """where the model, its sampling and the hooked forwards run: auto, cpu, cuda or cuda:N (devices.resolve_device);
    with --run the analysis runs on the CPU (give cpu or auto on a machine without CUDA)."""

    def keep_roles(self) -> tuple[str, ...]:
        names = [k.strip() for k in self.keep_fp32.split(",") if k.strip()]
        unknown = [k for k in names if k not in KEEP_FP32]
        if unknown:
            raise TraceError(f"--keep-fp32: unknown module {', '.join(unknown)}; valid names: {', '.join(KEEP_FP32)}")
        return tuple(KEEP_FP32[k] for k in names)

    def validate(self) -> None:
        check_field_types(self, TraceError)
        self.keep_roles()
        for flag, name in (("--recipe", self.recipe), ("--against", self.against)):
            try:
                get_recipe(name)
            except ValueError as e:
                raise TraceError(f"{flag}: {e}") from None
        for flag, value in (("--n", self.n), ("--max-tokens", self.max_tokens), ("--sub-batch", self.sub_batch)):
            check_number(flag, value, 1, integer=True, error=TraceError)
        check_seed("--seed", self.seed, error=TraceError)
        KNOBS["epsilon"].check("--epsilon", self.epsilon, TraceError)
        resolve_device(self.device)  # a device this machine lacks: one line before anything loads


def with_fp32(recipe: Recipe, roles: tuple[str, ...]) -> Recipe:
    """`recipe` with extra modules kept in fp32."""
    if not roles:
        return recipe
    if "all" in roles:
        return Recipe(f"{recipe.name}+fp32:all", torch.float32)
    merged = tuple(dict.fromkeys((*recipe.fp32_modules, *roles)))
    return replace(recipe, name=f"{recipe.name}+fp32:{','.join(roles)}", fp32_modules=merged)  # FP8 quantisers kept


# ------------------------------------------------------------------------------------------ analyses


def first_order_logprob_change(z: torch.Tensor, z_ref: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Exact and first-order change of log p(target) when logits move from z_ref to z ([N, V], float64 inside).

    log p_y = z_y − logsumexp(z), so d log p_y = dz_y − Σ_i p_i dz_i: a common shift of all logits cancels, and
    for a confident token (p_y ≈ 1) the two terms nearly cancel too, while a rare token keeps its own dz_y
    against the average dz of the likely ones. Returns [N] tensors: exact, first_order, dz_target,
    dz_expected (Σ p_ref dz), p_ref.
    """
    z, z_ref = z.double(), z_ref.double()
    dz = z - z_ref  # [N, V]
    logp_ref_all = torch.log_softmax(z_ref, -1)  # [N, V]
    p_ref = logp_ref_all.exp()  # [N, V]
    dz_y = dz.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    dz_expected = (p_ref * dz).sum(-1)  # [N]
    logp = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)  # [N]
    exact = logp - logp_ref_all.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    return {"exact": exact, "first_order": dz_y - dz_expected, "dz_target": dz_y, "dz_expected": dz_expected,
            "p_ref": p_ref.gather(-1, targets[:, None]).squeeze(-1)}


def _beta_summary(beta: torch.Tensor, eps: float) -> dict[str, float]:
    below, above = trust_region_split(beta.double(), eps, eps)
    return {"beta_abs_mean": beta.abs().mean().item(), "beta_mean": beta.mean().item(),
            "outside_trust_region": (below | above).double().mean().item()}


def _rms(beta: torch.Tensor) -> float:
    return beta.double().square().mean().sqrt().item()


def _rounded_weights_model(master: nn.Module, dtype: torch.dtype) -> nn.Module:
    """fp32 arithmetic on weights rounded to `dtype` (the weights-only part of the gap)."""
    model = copy.deepcopy(master)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(round_to(p, dtype))
    return model.eval()


def _logp(model: nn.Module, recipe: Recipe, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probs [N] of the completion tokens, through scoring's chunked fp32 head (the path the tools measure)."""
    s = score(model, recipe, packed["input_ids"], packed["attention_mask"], packed["completion_mask"], entropy=False)
    return s.logp[s.mask]  # [N]


def _param_mib(roles: tuple[str, ...], model: nn.Module, low: torch.dtype) -> float:
    """Extra memory of keeping `roles` in fp32 instead of `low`: (4 − bytes of low) per parameter, and the full
    4 bytes for a head tied to the embeddings (the recipe gives it its own fp32 copy; the embedding stays low)."""
    seen, total = set(), 0.0
    finders = {**MODULE_ROLES, "all": lambda m: [m]}
    tied = lm_head(model).weight is model.get_input_embeddings().weight and "all" not in roles
    for role in roles:
        for m in finders.get(role, lambda _: [])(model):
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * (4 if (tied and role == "lm_head") else 4 - torch.finfo(low).bits // 8)
    return total / 2**20


# ------------------------------------------------------------------------------------------ the job


@dataclass
class TraceSetup:
    """What every phase reads: the master, the tokens sampled once, and the two recipes laid out on the master."""

    cfg: TraceConfig
    master: nn.Module
    """fp32 master weights (eval mode); every recipe is laid out from them."""
    sites: list[tuple[str, int, nn.Module]]
    """`trace_sites(master)`: (name, depth, module) in forward order."""
    packed: dict[str, torch.Tensor]
    """`Rollout.pack`: input_ids, attention_mask, completion_mask, each [B, T]."""
    recipe: Recipe
    """the traced recipe, with the modules of --keep-fp32."""
    reference: Recipe
    """the recipe it is compared against (--against)."""
    model: nn.Module
    """the master laid out for `recipe`."""
    ref_model: nn.Module
    """the master laid out for `reference`."""


@dataclass
class DepthErrors:
    """Phases 1 + 2: the error of every site along the depth and the change of every completion token's log-prob."""

    stats: dict[str, ErrorStats]
    """site name -> its error statistics, in forward order, then 'logprobs'."""
    terms: dict[str, torch.Tensor]
    """`first_order_logprob_change` over all completion tokens: [N] each; terms['exact'] is β."""
    hook_overhead: float
    """time of the hooked forwards of the traced model over the same forwards without hooks, minus 1."""

    @property
    def beta(self) -> torch.Tensor:
        """β = log p_recipe − log p_reference of every completion token: [N]."""
        return self.terms["exact"]


def sample_tokens(lm: LoadedModel, master: nn.Module, cfg: TraceConfig, say: Say) -> dict[str, torch.Tensor]:
    """Completions sampled once by an fp32 engine, packed [B, T]: every comparison runs on these tokens."""
    prompts = encode_within(lm.tokenizer, bundled_prompts()[: cfg.n], cfg.max_tokens, lm.context_length)
    say(f"sampling {cfg.n} completions of up to {cfg.max_tokens} tokens (fp32 engine)")
    stops = stop_token_ids(lm)
    rollout = LocalEngine(master, torch.float32).generate(
        prompts, SamplingParams(max_tokens=cfg.max_tokens, seed=cfg.seed, stop_token_ids=stops))
    return rollout.pack(stops[0] if stops else 0, device=next(master.parameters()).device)


def errors_along_depth(st: TraceSetup) -> DepthErrors:
    """1 + 2. Both models on the same sub-batches, hooked: the error at every site and the logit -> log-prob link."""
    stats = {name: ErrorStats() for name, _, _ in st.sites}
    stats["logprobs"] = ErrorStats()
    hooks = SiteHooks(st.model, st.ref_model, stats)
    parts: dict[str, list[torch.Tensor]] = {}
    t_traced = 0.0
    for ids, attn, comp in _sub_batches(st):
        hooks.mask = attn.bool()
        z_ref = full_logits(st.ref_model, st.reference, ids, attn)  # [b, T, V]; its sites are held for the next forward
        t0 = clock(ids.device)
        z = full_logits(st.model, st.recipe, ids, attn)  # [b, T, V]
        t_traced += clock(ids.device) - t0
        pred = torch.zeros_like(comp)  # [b, T]
        pred[:, :-1] = comp[:, 1:]  # logits at t-1 predict completion token t
        fo = first_order_logprob_change(z[pred], z_ref[pred], ids[comp])  # [n] each
        logp_ref = torch.log_softmax(z_ref[pred].double(), -1).gather(-1, ids[comp][:, None])  # [n, 1]
        stats["logprobs"].add(logp_ref + fo["exact"][:, None], logp_ref)
        for k, v in fo.items():
            parts.setdefault(k, []).append(v)
    hooks.remove()
    t0 = time.perf_counter()
    for ids, attn, _ in _sub_batches(st):  # the same forwards without hooks
        full_logits(st.model, st.recipe, ids, attn)
    t_plain = clock(st.packed["input_ids"].device) - t0
    overhead = t_traced / t_plain - 1 if t_plain > 0 else float("nan")
    return DepthErrors(stats=stats, terms={k: torch.cat(v) for k, v in parts.items()}, hook_overhead=overhead)


def _sub_batches(st: TraceSetup) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, completion_mask) [b, T] of each sub-batch of `cfg.sub_batch` rows."""
    p, b = st.packed, st.cfg.sub_batch
    for s in range(0, p["input_ids"].shape[0], b):
        yield p["input_ids"][s : s + b], p["attention_mask"][s : s + b], p["completion_mask"][s : s + b]


def site_rows(st: TraceSetup, depth: DepthErrors) -> list[dict]:
    """One row per site (and one for the log-probs, at the head's depth): its error along the depth."""
    depth_of = {name: d for name, d, _ in st.sites} | {"logprobs": st.sites[-1][1]}
    return [{"site": name, "depth": depth_of[name], **s.summary()} for name, s in depth.stats.items()]


def first_order_link(depth: DepthErrors) -> dict:
    """How much of β the first-order term Δz_y − Σ p Δz explains: overall, and by the reference probability."""
    beta, fo = depth.beta, depth.terms  # [N] each
    residual = (beta - fo["first_order"]).abs().sum() / beta.abs().sum().clamp_min(1e-30)
    buckets = []
    for lo, hi in zip(PROB_BUCKETS, PROB_BUCKETS[1:]):
        m = (fo["p_ref"] >= lo) & (fo["p_ref"] < hi) if hi < 1 else (fo["p_ref"] >= lo)  # [N]; the last edge is closed
        if m.any():
            buckets.append({"p_low": lo, "p_high": hi, "tokens": int(m.sum()),
                            "beta_abs_mean": beta[m].abs().mean().item(),
                            "dz_target_abs_mean": fo["dz_target"][m].abs().mean().item(),
                            "dz_expected_abs_mean": fo["dz_expected"][m].abs().mean().item(),
                            "first_order_abs_mean": fo["first_order"][m].abs().mean().item()})
    return {"explained_share": 1 - residual.item(), "corr": pearson(beta, fo["first_order"]), "buckets": buckets}


def weights_vs_compute(st: TraceSetup, logp_ref: torch.Tensor, say: Say) -> dict:
    """3. β split into rounding the weights alone and the recipe's arithmetic on unrounded weights: {'split': ...},
    or {} when the reference is not plain fp32 or the recipe computes in fp32 (nothing to split)."""
    recipe, reference, eps = st.recipe, st.reference, st.cfg.epsilon
    if reference.weight_dtype != torch.float32 or reference.autocast_dtype or recipe.compute_dtype == torch.float32:
        return {}
    say("splitting β into weights and compute")
    emulated = resolve_matmul(st.cfg.matmul, dtype=recipe.compute_dtype) == "emulated"

    def beta(model: nn.Module, r: Recipe) -> torch.Tensor:  # [N]; the model is dropped once scored
        return _logp(model, r, st.packed) - logp_ref

    beta_w = beta(_rounded_weights_model(st.master, recipe.compute_dtype), reference)  # autocast rounds weights too
    beta_c = beta(apply_recipe(st.master, recipe, "emulated", exact_weights=True), recipe)
    # The whole recipe through the same emulated kernel as the compute-only part, so the parts compare like for like.
    beta_all = beta(st.model if emulated else apply_recipe(st.master, recipe, "emulated"), recipe)
    rms_w, rms_c, rms_all = _rms(beta_w), _rms(beta_c), _rms(beta_all)
    # The two parts are rounding noise from different places: they add in quadrature (independent errors),
    # not token by token (rounding the weights changes which activations round which way).
    tokenwise = (beta_w + beta_c - beta_all).abs().mean() / beta_all.abs().mean().clamp_min(1e-30)
    return {"split": {
        "weights_only": {**_beta_summary(beta_w, eps), "rms": rms_w},
        "compute_only": {**_beta_summary(beta_c, eps), "rms": rms_c},
        "whole": {**_beta_summary(beta_all, eps), "rms": rms_all},
        "weights_share_of_variance": rms_w**2 / max(rms_w**2 + rms_c**2, 1e-300),
        "quadrature_ratio": math.hypot(rms_w, rms_c) / max(rms_all, 1e-300),
        "tokenwise_residual": tokenwise.item(),
    }}


def what_if_recipes(st: TraceSetup, logp_ref: torch.Tensor, say: Say) -> dict:
    """4. Each keep-fp32 option on its own, then all of them, ranked by gain per extra MiB: {'what_if': rows},
    {'what_if_note': why not} for autocast recipes, {} when not asked."""
    cfg, base = st.cfg, get_recipe(st.cfg.recipe)
    if not cfg.what_if:
        return {}
    if base.autocast_dtype is not None:
        return {"what_if_note": "what-if is not run for autocast recipes: autocast would cast the kept modules back "
                                "to its dtype"}
    say("what-if recipes")
    single = [v for v in KEEP_FP32.values() if v != "all"]
    options = [(k,) for k in single] + [tuple(single), ("all",)]
    rows = []
    for roles in [()] + options:
        r = with_fp32(base, roles)
        m = st.model if r == st.recipe else apply_recipe(st.master, r, cfg.matmul)  # the traced model, hooks removed
        t0 = time.perf_counter()
        lp = _logp(m, r, st.packed)  # [N]
        synchronize(lp.device)
        rows.append({"keep_fp32": [k for k, v in KEEP_FP32.items() if v in roles] or ["(none)"],
                     **_beta_summary(lp - logp_ref, cfg.epsilon), "forward_s": time.perf_counter() - t0,
                     "extra_mib": _param_mib(roles, st.master, base.weight_dtype)})
    plain = rows[0]
    for row in rows:
        row["gain"] = plain["beta_abs_mean"] - row["beta_abs_mean"]
        row["gain_per_mib"] = row["gain"] / row["extra_mib"] if row["extra_mib"] > 0 else float("nan")
    # An option that costs no memory (attention-softmax) ranks as if it cost a millionth of a MiB.
    ranked = sorted(rows[1:], key=lambda r: -(r["gain_per_mib"] if r["extra_mib"] > 0 else r["gain"] * 1e6))
    return {"what_if": [plain] + ranked}


def quant_order_noise(st: TraceSetup, logp_ref: torch.Tensor) -> dict:
    """How much the FP8 recipe's figures hang on the fp32 summation order of its exact E4M3 products: the whole recipe
    scored in each of fp8.SUM_ORDERS; per order its mean |β| and share outside the trust region, `noise` = the
    spread (max − min) of mean |β| over the orders, and `token_correlation` = the lowest Pearson r of per-token β
    between two orders (1 where single tokens do not move)."""
    from ..precision.fp8 import SUM_ORDERS
    from ..precision.fp8_layers import set_sum_order

    betas = {}
    for order in SUM_ORDERS:
        model = apply_recipe(st.master, st.recipe, st.cfg.matmul)
        set_sum_order(model, order)
        betas[order] = _logp(model, st.recipe, st.packed) - logp_ref  # [N], as the what-if rows compute it
        del model
        gc.collect()  # an FP8 copy is a reference cycle (quant_what_if's row)
    orders = {o: _beta_summary(b, st.cfg.epsilon) for o, b in betas.items()}
    means = [o["beta_abs_mean"] for o in orders.values()]
    pairs = [(a, b) for i, a in enumerate(SUM_ORDERS) for b in SUM_ORDERS[i + 1:]]
    corr = min(torch.corrcoef(torch.stack([betas[a], betas[b]]).double())[0, 1].item() for a, b in pairs)
    return {"orders": orders, "noise": max(means) - min(means), "token_correlation": corr}


def quant_what_if(st: TraceSetup, logp_ref: torch.Tensor, say: Say) -> dict:
    """5. For an FP8 recipe (--recipe bf16+fp8-w8a8[+fp8-kv], best --against its plain recipe): which part of the
    quantisation kept in the engine's dtype buys the most. Rows: the whole FP8 recipe; the weights kept (activations
    alone quantised, `fp8-a8`), the activations kept (`fp8-w8a16`), the KV cache kept; each Linear kind (q_proj, ...)
    kept in every layer; each layer's Linears kept. Ranked past their noise (rank_what_if: the spread of the whole
    recipe's mean |β| over summation orders, or the largest loss of a row, whichever is larger): a row whose gain is
    no larger is marked `within_noise` and ranked after every row that beats it. {'quant_what_if': rows,
    'quant_order_noise': ...}, or {}."""
    from ..precision.fp8_layers import KV_QUANT, KVQ_QUANT, LINEAR_QUANTS, quantised_linears, unquantise

    recipe = st.recipe
    linear = next((q for q in recipe.quant if q in LINEAR_QUANTS), None)
    if not recipe.quant or not st.cfg.what_if:
        return {}
    say("what-if: parts of the FP8 quantisation kept in the engine's dtype")
    base = replace(recipe, quant=tuple(q for q in recipe.quant if q not in LINEAR_QUANTS))

    def row(label: str, r: Recipe, keep=lambda name: False) -> dict:
        model = apply_recipe(st.master, r, st.cfg.matmul)
        for name, m in quantised_linears(model, {id(lm_head(model))}).items():
            if getattr(m, "_pc_fp8_spec", None) is not None and keep(name):
                unquantise(m)
        out = {"keep": label, **_beta_summary(_logp(model, r, st.packed) - logp_ref, st.cfg.epsilon)}
        del model  # free the copy now: FP8 Linears refer to their merged siblings (a reference cycle), so a copy
        gc.collect()  # waits for the cycle collector, and forty of the bundled model's held 10 GB in one run
        return out

    rows = [row("(nothing: the whole FP8 recipe)", recipe)]
    if linear:
        acts = ("fp8-a8",) if LINEAR_QUANTS[linear].activation else ()  # a weight-only recipe keeps nothing else
        rows.append(row("weights (per-token FP8 activations only)", replace(base, quant=(*acts, *base.quant))))
        if acts:
            rows.append(row("activations (FP8 weights only)", replace(base, quant=("fp8-w8a16", *base.quant))))
    kv = next((q for q in recipe.quant if q in (KV_QUANT, KVQ_QUANT)), None)
    if kv:
        rows.append(row("KV cache", replace(recipe, quant=tuple(q for q in recipe.quant if q != kv))))
    if linear:
        names = list(quantised_linears(st.master, {id(lm_head(st.master))}))
        for kind in dict.fromkeys(n.rpartition(".")[2] for n in names):
            rows.append(row(f"every {kind}", recipe, lambda n, k=kind: n.rpartition(".")[2] == k))
        layers = dict.fromkeys(n.split(".layers.")[1].split(".")[0] for n in names if ".layers." in n)
        for i in layers:
            rows.append(row(f"layer {i}", recipe, lambda n, i=i: f".layers.{i}." in n))
    for r in rows:
        r["gain"] = rows[0]["beta_abs_mean"] - r["beta_abs_mean"]
    return rank_what_if(rows, quant_order_noise(st, logp_ref))


def rank_what_if(rows: list[dict], noise: dict) -> dict:
    """The what-if rows (the whole recipe first, each with its `gain`) ranked past their noise. The noise floor is
    the larger of the summation orders' spread (quant_order_noise) and the largest loss of any row: keeping part of
    the quantisation in the engine's dtype brings the recipe towards the plain one, so a row that moves it away
    measures how far noise alone moves a row. A row whose |gain| is no larger is `within_noise`, ranked after every
    row that beats it; each group by gain."""
    loss = max((-r["gain"] for r in rows[1:] if r["gain"] < 0), default=0.0)
    floor = max(noise["noise"], loss)
    for r in rows[1:]:
        r["within_noise"] = abs(r["gain"]) <= floor
    ranked = sorted(rows[1:], key=lambda r: (r["within_noise"], -r["gain"]))
    return {"quant_what_if": [rows[0], *ranked],
            "quant_order_noise": {**noise, "floor": floor, "floor_from": "orders" if floor == noise["noise"] else
                                  "the largest loss of a row"}}


def run_trace(cfg: TraceConfig, console=None) -> dict:
    """`phantomclip trace`: every figure `trace.text.render_trace` prints and --json writes."""
    cfg.validate()
    say = console.print if console is not None else (lambda *a, **k: None)
    lm = load_model(cfg.model)
    master = lm.model.float().eval().to(resolve_device(cfg.device))
    sites = trace_sites(master)  # fails early, with the module tree, on unsupported architectures
    recipe, reference = with_fp32(get_recipe(cfg.recipe), cfg.keep_roles()), get_recipe(cfg.against)
    check_fits(master, (cfg.recipe, cfg.against))  # a recipe the model's shapes refuse: before the sampling
    packed = sample_tokens(lm, master, cfg, say)  # [B, T] each
    st = TraceSetup(cfg=cfg, master=master, sites=sites, packed=packed, recipe=recipe, reference=reference,
                    model=apply_recipe(master, recipe, cfg.matmul),
                    ref_model=apply_recipe(master, reference, cfg.matmul))

    depth = errors_along_depth(st)
    result = {
        "schema": SCHEMA_VERSION, "config": asdict(cfg), "recipe": recipe.name, "against": reference.name,
        "tokens": int(depth.beta.numel()), "device": describe_device(next(master.parameters()).device),
        "cpu": cpu_description(cfg.matmul),  # the machine, as diagnose records it: the error depends on the kernel
        "sites": site_rows(st, depth),
        "beta": _beta_summary(depth.beta, cfg.epsilon),
        "first_order": first_order_link(depth),
        "hook_overhead": depth.hook_overhead,
    }
    logp_ref = _logp(st.ref_model, reference, packed)  # [N], shared by the split and the what-if table
    result |= weights_vs_compute(st, logp_ref, say)
    result |= what_if_recipes(st, logp_ref, say)
    result |= quant_what_if(st, logp_ref, say)
    result |= trace_routing(st.model, recipe, st.ref_model, reference, packed)  # MoE: where routing flips start
    return result
