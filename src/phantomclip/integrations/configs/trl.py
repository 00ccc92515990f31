"""`phantomclip diagnose --from-trl-config`: the diagnose settings matching a TRL GRPOConfig (a YAML file, a dict or
a GRPOConfig object). A pure mapping that imports nothing of TRL. Field names and defaults are trl 1.16's
(trl/trainer/grpo_config.py); each part below reads one group of fields, as the verl reader does.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...base.errors import LENGTH_LIMIT, ConfigError, brief
from ...base.files import JSON_ERRORS, json_reason
from ...maths.loss import clip_range
from ...precision.recipes import DEFAULT_TRAINERS
from .load import (
    CONFIG_DTYPES,
    SAMPLING,
    VLLM_QUANT,
    known_keys,
    mapping,
    naming_file,
    number,
    read_mapping,
    text,
    trainer_note,
    unknown_keys_note,
    unmapped,
)

FLAG = "--from-trl-config"
TRL_IS_CLIP_MAX = 3.0
"""GRPOConfig.vllm_importance_sampling_clip_max's default (trl 1.16 grpo_config.py)."""
TRL_EPSILON = 0.2
"""GRPOConfig.epsilon's default."""
TOKEN_MODES = ("token_truncate", "token_mask")
SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")
"""GRPOConfig.vllm_importance_sampling_mode's values (trl 1.16; default sequence_mask), by the level they act at."""


def diagnose_settings_from_trl(config) -> tuple[dict, list[str]]:
    """`phantomclip diagnose` settings (DiagnoseConfig field names) matching a TRL GRPO config, and notes on what
    could not be matched. Reads no TRL internals, so it works without trl installed."""
    with naming_file(FLAG, config):
        repeated: list[str] = []
        cfg = _as_mapping(config, repeated)
        settings: dict = {}
        notes = [f"{r}: TRL's YAML reader (PyYAML) keeps the last value, as here" for r in repeated]
        if isinstance(config, (str, Path, dict)):  # a GRPOConfig object holds its own fields (and properties)
            said = unknown_keys_note(list(cfg), known_keys("trl"), "trl 1.16's GRPOConfig, AsyncGRPOConfig, "
                                     "ModelConfig or ScriptArguments (TRL refuses it)")
            notes += [said] if said else []
        for part in (_deprecated, _trainer_and_engine, _setup, _quantization, _sampling, _clip, _length,
                     _correction_cap, _model):
            part(cfg, settings, notes)
    return settings, notes


ASYNC_KEYS = ("max_staleness", "weight_sync_steps", "max_inflight_tasks", "queue_maxsize", "token_budget",
              "fork_threshold_tokens", "heartbeat_stale_after_s", "request_timeout", "weight_sync_timeout")
"""fields AsyncGRPOConfig has and GRPOConfig lacks (trl 1.16 trl/experimental/async_grpo/async_grpo_config.py; its
`dtype` is left out: ModelConfig, which `trl grpo` reads beside GRPOConfig, has it too): a config holding one is the
asynchronous trainer's."""


DEPRECATED = {"vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",
              "use_transformers_paged": "use_transformers_continuous_batching"}
"""GRPOConfig's deprecated fields and the fields TRL names in their place (trl 1.16 grpo_config.py, <Deprecated> in
the docstring and the FutureWarning of __post_init__, which copies vllm_importance_sampling_cap over clip_max)."""


def _deprecated(cfg: dict, settings: dict, notes: list[str]) -> None:
    """A note per deprecated field the config gives, naming TRL's replacement; each is still read as TRL reads it."""
    for old, new in DEPRECATED.items():
        if cfg.get(old) is not None:
            notes.append(f"{old} is deprecated in trl 1.16 (removed in v2.0.0): use {new}; read as TRL reads it, "
                         f"in place of {new}")


def _setup(cfg: dict, settings: dict, notes: list[str]) -> None:
    """Which TRL trainer the config is for (setups.SETUPS): AsyncGRPOTrainer, which clips against vLLM's log-probs,
    where an AsyncGRPOConfig field is given; else GRPOTrainer, which clips against its own and meets β in its vLLM
    importance-sampling weight."""
    given = [k for k in ASYNC_KEYS if k in cfg]
    settings["setup"] = "trl-async" if given else "trl-grpo"
    notes.append(f"{'AsyncGRPOTrainer (' + given[0] + ' is its field)' if given else 'GRPOTrainer'}: the answer "
                 "judges the ratio it clips (--setup to say otherwise)")


def _as_mapping(config, repeated: list[str]) -> dict:
    """A YAML path, a dict, or a GRPOConfig (an object with its fields) as a dict of fields; anything else is one
    line. A key a YAML file gives twice goes into `repeated`."""
    if isinstance(config, (str, Path)):
        return read_mapping(Path(config), FLAG, "GRPOConfig fields", repeated)
    if isinstance(config, dict):
        return config
    if not hasattr(config, "epsilon") or not hasattr(config, "max_completion_length"):
        raise ConfigError(f"{FLAG}: expected a YAML path, a dict or a GRPOConfig, got {type(config).__name__}")
    return {k: getattr(config, k) for k in dir(config) if not k.startswith("_") and not callable(getattr(config, k))}


TRUE, FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")
"""how transformers' HfArgumentParser reads a boolean written as a string (`string_to_bool`): TRL's YAML config files
go through it, so `fp16: "false"` is False there, as here."""


def _flag(cfg: dict, key: str, default: bool | None = None) -> bool | None:
    """A boolean GRPOConfig field as TRL reads it: a YAML bool, or a string spelled as HfArgumentParser accepts;
    anything else is one line naming the key."""
    value = cfg.get(key)
    if value is None or isinstance(value, bool):
        return default if value is None else value
    text = str(value).strip().lower()
    if isinstance(value, str) and text in TRUE + FALSE:
        return text in TRUE
    raise ConfigError(f"{FLAG}: {key} is {brief(value)}, not a boolean (true/false, yes/no, 1/0)")


def _trainer_and_engine(cfg: dict, settings: dict, notes: list[str]) -> None:
    """Trainer recipe: cast_lm_head_to_fp32 -> `_fp32_head`'s; fp16 (autocast over TRL's fp32 weights) ->
    fp16-autocast; a model loaded in bf16 (`_model_dtype`: model_init_kwargs.dtype, else dtype) -> bf16, in fp16
    without bf16 autocast -> fp16;
    bf16 (TRL's default when fp16 is off) -> bf16-autocast; otherwise fp32; the other recipes are measured beside it.
    Engine: bf16 (vLLM's 'auto' dtype on bf16 checkpoints; GRPOConfig has no field for it, so a `vllm_dtype` key of
    our own may say otherwise)."""
    fp16 = _flag(cfg, "fp16", False)
    bf16 = _flag(cfg, "bf16", not fp16)  # TRL's default: bf16 unless fp16
    model_dtype, dtype_key = _model_dtype(cfg, notes)
    if _flag(cfg, "cast_lm_head_to_fp32"):
        trainer = _fp32_head(model_dtype, bf16, fp16, settings, notes)
    elif fp16:
        trainer = "fp16" if model_dtype == "fp16" else "fp16-autocast"  # TRL loads fp32 weights: fp16 autocast
    elif model_dtype == "bf16":
        trainer = "bf16"
    elif model_dtype == "fp16" and not bf16:
        trainer = "fp16"
    elif bf16:
        trainer = "bf16-autocast"
    else:
        trainer = "fp32"
    notes.append(trainer_note(trainer, "bf16, fp16, cast_lm_head_to_fp32, model_init_kwargs.dtype, dtype"))
    if model_dtype == "fp16" and bf16 and trainer == "bf16-autocast":  # fp16 weights, bf16 matmuls: no recipe
        unmapped(settings, f"{dtype_key} float16 under bf16 autocast")
        notes.append(f"{dtype_key} float16 with bf16 autocast (TRL's default bf16: true): fp16 weights "
                     "whose matmuls run in bf16, a mix no recipe measures; bf16-autocast is the nearest (pass "
                     "--trainer fp16 with `bf16: false` in your config for a pure fp16 trainer)")
    if model_dtype == "auto":
        unmapped(settings, f"{dtype_key} 'auto' (the checkpoint's own dtype)")
        notes.append(f"{dtype_key} 'auto' loads the checkpoint's dtype: if it is bf16, the trainer is bf16 "
                     "(pass --trainer bf16)")
    if _flag(cfg, "use_vllm") is False:
        notes.append("use_vllm is false: TRL samples with the trainer's own model, so trainer and engine share a "
                     "precision")
    settings["trainer"] = ",".join([trainer, *(r for r in DEFAULT_TRAINERS if r != trainer)])
    settings["engine_dtype"] = _engine_dtype(cfg)
    settings["answer_in"] = "trl"


def _fp32_head(model_dtype: str, bf16: bool, fp16: bool, settings: dict, notes: list[str]) -> str:
    """cast_lm_head_to_fp32 (trl 1.16 grpo_trainer.py _cast_lm_head_to_fp32): the head's matmul in fp32, its input
    cast to fp32, autocast off, over the body as the other fields set it. fp32 weights under bf16 autocast (TRL's
    default): bf16-autocast-fp32-head; without autocast the head is fp32 anyway: fp32; bf16 weights: fp32-head is the
    nearest (TRL's cast head holds the bf16-rounded weights and its final norm stays bf16; fp32-head keeps both in
    fp32, said in a note); under fp16 autocast no recipe matches (unmapped)."""
    if model_dtype == "bf16":
        notes.append("cast_lm_head_to_fp32 over bf16 weights: TRL casts the bf16 head to fp32 and keeps the final norm "
                     "bf16; fp32-head (final norm and head in fp32 from fp32 masters) is the nearest recipe")
        return "fp32-head"
    if fp16:
        unmapped(settings, "cast_lm_head_to_fp32 under fp16 autocast")
        return "fp16-autocast"
    return "bf16-autocast-fp32-head" if bf16 else "fp32"


def _model_dtype(cfg: dict, notes: list[str]) -> tuple[str, str]:
    """(the trainer's load dtype as 'bf16', 'fp16', 'fp32', 'auto', or '' when not given; the field it came from):
    model_init_kwargs' dtype (or torch_dtype), else the top-level `dtype` (AsyncGRPOConfig's own field, trl 1.16
    experimental/async_grpo/async_grpo_config.py, and ModelConfig's, which the `trl grpo` script copies into
    model_init_kwargs, scripts/grpo.py; both default to float32, and a dtype in model_init_kwargs takes precedence in
    both). A dtype no recipe has (int8, float64) is named in a note. TRL takes model_init_kwargs as a mapping (or a
    JSON string on the command line, which a YAML file has no need of)."""
    init = cfg.get("model_init_kwargs")
    if isinstance(init, str):  # a JSON string, as TrainingArguments reads its _VALID_DICT_FIELDS
        try:
            init = json.loads(init)
        except JSON_ERRORS as e:
            raise ConfigError(f"{FLAG}: model_init_kwargs is a string that is not a JSON mapping ({json_reason(e)})"
                              ) from None
    init = mapping(FLAG, "model_init_kwargs", init)
    key = "dtype" if "dtype" in init else "torch_dtype"
    if init.get(key) is not None:
        key, value = f"model_init_kwargs.{key}", init[key]
    elif cfg.get("dtype") is not None:
        key, value = "dtype", cfg["dtype"]
    else:
        return "", ""
    given = text(FLAG, key, value)
    name = CONFIG_DTYPES.get(given.lower().removeprefix("torch."), "auto" if given == "auto" else None)
    if name is None:
        notes.append(f"{key} {brief(given)} is not a dtype phantomclip measures (fp32, bf16, "
                     "fp16): the trainer recipe is read from bf16 / fp16 alone")
        return "", key
    return name, key


def _engine_dtype(cfg: dict) -> str:
    """`vllm_dtype` (our own key; vLLM's dtype names, 'auto' being bf16 on the bf16 checkpoints measured) as an
    engine dtype, bf16 when absent; a value that names no dtype is refused: it is only ever ours to read."""
    if cfg.get("vllm_dtype") is None:
        return "bf16"
    given = text(FLAG, "vllm_dtype", cfg["vllm_dtype"])
    name = "bf16" if given.lower() == "auto" else CONFIG_DTYPES.get(given.lower().removeprefix("torch."))
    if name is None:
        raise ConfigError(f"{FLAG}: vllm_dtype {brief(given)} is not a dtype: use auto, bfloat16, float16 or float32")
    return name


def _quantization(cfg: dict, settings: dict, notes: list[str]) -> None:
    """vLLM's FP8 settings, where the config gives them: `vllm_kwargs` (a mapping handed to vLLM's LLM, as some TRL
    trainers take; trl 1.16's GRPOConfig has no such field) and `kv_cache_dtype` (`trl vllm-serve`'s ScriptArguments
    field, trl 1.16 scripts/vllm_serve.py, for a server's config written beside the trainer's). vLLM's own names map
    to the quantisers they select (configs.load.VLLM_QUANT); a setting vLLM takes that phantomclip does not emulate
    (awq, gptq, an E5M2 cache) is named in a note and leaves the result unjudged."""
    kwargs = mapping(FLAG, "vllm_kwargs", cfg.get("vllm_kwargs"))
    quant = []
    for key in ("quantization", "kv_cache_dtype"):
        where = f"vllm_kwargs.{key}" if kwargs.get(key) is not None else key
        value = kwargs.get(key, cfg.get(key))
        if value is None:
            continue
        value = text(FLAG, where, value)
        if value.lower() in ("", "auto", "none"):
            continue
        name = VLLM_QUANT.get((key, value.lower()))
        if name is None:
            unmapped(settings, f"vLLM {where} {brief(value)}")
            notes.append(f"vLLM {where} {brief(value)}: not a setting phantomclip emulates "
                         f"({', '.join(v for k, v in VLLM_QUANT if k == key)}); the engine is measured without it")
        else:
            quant.append(name)
            notes.append(f"vLLM {where} = {value}: the engine samples with {name}")
    if quant:
        settings["engine_quant"] = ",".join(dict.fromkeys(quant))


def _sampling(cfg: dict, settings: dict, notes: list[str]) -> None:
    for key, cast, bounds in SAMPLING:
        if cfg.get(key) is not None:
            settings[key] = number(FLAG, key, cfg[key], cast, **bounds)
    if settings.get("top_k") == -1:  # vLLM's "off", diagnose's 0
        settings["top_k"] = 0
    min_p = number(FLAG, "min_p", cfg["min_p"], low=0, high=1) if cfg.get("min_p") is not None else 0
    if min_p:
        notes.append(f"min_p = {min_p:g} is not measured (diagnose supports top-p and top-k)")


def _clip(cfg: dict, settings: dict, notes: list[str]) -> None:
    """ε (TRL's default 0.2) and ε_high (TRL: ε unless set)."""
    given = {k: number(FLAG, k, cfg[k], knob=k) for k in ("epsilon", "epsilon_high") if cfg.get(k) is not None}
    epsilon, high = given.get("epsilon", TRL_EPSILON), given.get("epsilon_high")
    settings["epsilon"], settings["epsilon_high"] = clip_range(epsilon, high)


def _length(cfg: dict, settings: dict, notes: list[str]) -> None:
    """max_completion_length -> max_tokens (the CLI lets an explicit --max-tokens win and sends the length to the
    knob advice's --knob-length too)."""
    if cfg.get("max_completion_length") is not None:
        settings["max_tokens"] = number(FLAG, "max_completion_length", cfg["max_completion_length"], int, low=1,
                                        high=LENGTH_LIMIT)


def _correction_cap(cfg: dict, settings: dict, notes: list[str]) -> None:
    """The knob advice's cap from TRL's vLLM importance-sampling correction: the cap C (clip_max, or the deprecated
    vllm_importance_sampling_cap, which TRL copies over clip_max when set) as --token-cap for the token modes, as
    --seq-mask-cap for the sequence modes (a sequence mode that truncates touches the same sequences a mask at C
    drops). Nothing when the correction is off. A mode TRL does not have is refused (TRL raises at its first step);
    clip_max given as null (no upper bound) and a lower bound clip_min are named in notes: the advice models an
    upper cap only."""
    if settings.get("setup") == "trl-async":  # AsyncGRPOTrainer has no IS correction: β is in its clip
        given = sorted(k for k in cfg if str(k).startswith("vllm_importance_sampling"))
        if given:
            notes.append(f"{', '.join(given)}: not read; AsyncGRPOConfig has no vLLM importance-sampling correction "
                         "(trl 1.16 trl/experimental/async_grpo/async_grpo_config.py derives from _BaseConfig, not "
                         "GRPOConfig), so its clip meets β uncorrected")
        return
    if _flag(cfg, "vllm_importance_sampling_correction") is False:
        settings["is_mode"] = "none"
        notes.append("vllm_importance_sampling_correction is false: no correction; the knob advice shows what each "
                     "would do")
        return
    mode_key = "vllm_importance_sampling_mode"
    mode = "sequence_mask" if cfg.get(mode_key) is None else text(FLAG, mode_key, cfg[mode_key])
    if mode not in TOKEN_MODES + SEQUENCE_MODES:
        raise ConfigError(f"{FLAG}: {mode_key} {brief(mode)} is not one of TRL's "
                          f"({', '.join(TOKEN_MODES + SEQUENCE_MODES)}): TRL refuses it at its first step")
    key = "vllm_importance_sampling_cap"
    if cfg.get(key) is None:
        key = "vllm_importance_sampling_clip_max"
    if key in cfg and cfg[key] is None:  # TRL: no upper bound (only clip_min, if any)
        notes.append(f"{key} is null: no upper bound on the IS ratio; the knob advice judges diagnose's default cap")
        cap = None
    else:
        cap = TRL_IS_CLIP_MAX if cfg.get(key) is None else number(FLAG, key, cfg[key], knob="cap")
    low_key = "vllm_importance_sampling_clip_min"
    if cfg.get(low_key) is not None:
        low = number(FLAG, low_key, cfg[low_key], low=0)
        notes.append(f"{low_key} = {low:g}: a lower bound the knob advice does not model (it reads the upper cap)")
    settings["is_mode"] = mode
    if cap is not None:
        settings["token_cap" if mode in TOKEN_MODES else "seq_mask_cap"] = cap


def _model(cfg: dict, settings: dict, notes: list[str]) -> None:
    if cfg.get("model_name_or_path") is not None:
        settings["model"] = text(FLAG, "model_name_or_path", cfg["model_name_or_path"], empty=False)
