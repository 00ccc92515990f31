"""`phantomclip diagnose --from-trl-config`: the diagnose settings matching a TRL GRPOConfig (a YAML file, a dict or
a GRPOConfig object). A pure mapping that imports nothing of TRL. Field names and defaults are trl 1.16's
(trl/trainer/grpo_config.py); each part below reads one group of fields, as the verl reader does.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LENGTH_LIMIT, ConfigError
from ..loss import clip_range
from ..recipes import RECIPES
from .config_files import SAMPLING, naming_file, number, read_mapping, trainer_note

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
        cfg = _as_mapping(config)
        settings: dict = {}
        notes: list[str] = []
        for part in (_trainer_and_engine, _quantization, _sampling, _clip, _length, _correction_cap, _model):
            part(cfg, settings, notes)
    return settings, notes


def _as_mapping(config) -> dict:
    """A YAML path, a dict, or a GRPOConfig (an object with its fields) as a dict of fields; anything else is one
    line."""
    if isinstance(config, (str, Path)):
        return read_mapping(Path(config), FLAG, "GRPOConfig fields")
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
    raise ConfigError(f"{FLAG}: {key} is {value!r}, not a boolean (true/false, yes/no, 1/0)")


def _trainer_and_engine(cfg: dict, settings: dict, notes: list[str]) -> None:
    """Trainer recipe: cast_lm_head_to_fp32 -> fp32-head; fp16 -> fp16; a model loaded in bf16 (model_init_kwargs
    dtype) -> bf16; bf16 (TRL's default when fp16 is off) -> bf16-autocast; otherwise fp32; the other recipes are
    measured beside it. Engine: bf16 (vLLM's 'auto' dtype on bf16 checkpoints; GRPOConfig has no field for it, so a
    `vllm_dtype` key of our own may say otherwise)."""
    fp16 = _flag(cfg, "fp16", False)
    bf16 = _flag(cfg, "bf16", not fp16)  # TRL's default: bf16 unless fp16
    init = cfg.get("model_init_kwargs") or {}
    model_dtype = str(init.get("dtype", init.get("torch_dtype", "")) if isinstance(init, dict) else "")
    model_dtype = model_dtype.replace("torch.", "")
    if _flag(cfg, "cast_lm_head_to_fp32"):
        trainer = "fp32-head"
    elif fp16:
        trainer = "fp16"
    elif model_dtype in ("bfloat16", "bf16"):
        trainer = "bf16"
    elif bf16:
        trainer = "bf16-autocast"
    else:
        trainer = "fp32"
    notes.append(trainer_note(trainer, "bf16, fp16, cast_lm_head_to_fp32, model_init_kwargs.dtype"))
    if model_dtype == "auto":
        settings["unmapped"] = "model_init_kwargs.dtype 'auto' (the checkpoint's own dtype)"
        notes.append("model_init_kwargs dtype 'auto' loads the checkpoint's dtype: if it is bf16, the trainer is bf16 "
                     "(pass --trainer bf16)")
    if _flag(cfg, "use_vllm") is False:
        notes.append("use_vllm is false: TRL samples with the trainer's own model, so trainer and engine share a "
                     "precision")
    engine_dtype = str(cfg.get("vllm_dtype") or "bf16").replace("bfloat16", "bf16").replace("float16", "fp16")
    settings["trainer"] = ",".join([trainer, *(r for r in RECIPES if r != trainer)])
    settings["engine_dtype"] = engine_dtype
    settings["answer_in"] = "trl"


VLLM_QUANT = {("quantization", "fp8"): "fp8-w8a8", ("kv_cache_dtype", "fp8"): "fp8-kv",
              ("kv_cache_dtype", "fp8_e4m3"): "fp8-kv"}
"""vLLM's own FP8 settings -> --engine-quant: `quantization="fp8"` on a bf16 checkpoint is vLLM's online FP8 (per-tensor
weights, per-token activations: fp8-w8a8), `kv_cache_dtype="fp8"` (E4M3) its FP8 KV cache (fp8.py)."""


def _quantization(cfg: dict, settings: dict, notes: list[str]) -> None:
    """vLLM's FP8 settings, where the config gives them: `vllm_kwargs` (a mapping handed to vLLM's LLM, as some TRL
    trainers take; trl 1.16's GRPOConfig has no such field) and `kv_cache_dtype` (`trl vllm-serve`'s ScriptArguments
    field, trl 1.16 scripts/vllm_serve.py, for a server's config written beside the trainer's)."""
    kwargs = cfg.get("vllm_kwargs") if isinstance(cfg.get("vllm_kwargs"), dict) else {}
    given = {k: kwargs.get(k, cfg.get(k)) for k in ("quantization", "kv_cache_dtype")}
    quant = []
    for key, value in given.items():
        if value in (None, "", "auto"):
            continue
        name = VLLM_QUANT.get((key, str(value).lower()))
        if name is None:
            notes.append(f"vLLM {key} {value!r}: not an FP8 setting phantomclip emulates; the engine is measured "
                         "without it")
        else:
            quant.append(name)
            notes.append(f"vLLM {key} = {value}: the engine samples with {name}")
    if quant:
        settings["engine_quant"] = ",".join(quant)


def _sampling(cfg: dict, settings: dict, notes: list[str]) -> None:
    for key, cast, bounds in SAMPLING:
        if cfg.get(key) is not None:
            settings[key] = number(FLAG, key, cfg[key], cast, **bounds)
    if settings.get("top_k") == -1:  # vLLM's "off", diagnose's 0
        settings["top_k"] = 0
    if cfg.get("min_p"):
        notes.append(f"min_p = {cfg['min_p']} is not measured (diagnose supports top-p and top-k)")


def _clip(cfg: dict, settings: dict, notes: list[str]) -> None:
    """ε (TRL's default 0.2) and ε_high (TRL: ε unless set)."""
    epsilon = number(FLAG, "epsilon", cfg["epsilon"]) if cfg.get("epsilon") is not None else TRL_EPSILON
    high = number(FLAG, "epsilon_high", cfg["epsilon_high"]) if cfg.get("epsilon_high") is not None else None
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
    drops). Nothing when the correction is off."""
    if _flag(cfg, "vllm_importance_sampling_correction") is False:
        notes.append("vllm_importance_sampling_correction is false: no correction; the knob advice shows what each "
                     "would do")
        return
    mode = str(cfg.get("vllm_importance_sampling_mode") or "sequence_mask")
    key = "vllm_importance_sampling_cap"
    if cfg.get(key) is None:
        key = "vllm_importance_sampling_clip_max"
    cap = TRL_IS_CLIP_MAX if cfg.get(key) is None else number(FLAG, key, cfg[key])
    if mode in TOKEN_MODES:
        settings["token_cap"] = cap
    elif mode in SEQUENCE_MODES:
        settings["seq_mask_cap"] = cap
    else:
        known = ", ".join(TOKEN_MODES + SEQUENCE_MODES)
        notes.append(f"vllm_importance_sampling_mode {mode!r} is not one of TRL's ({known}): the cap is not read")


def _model(cfg: dict, settings: dict, notes: list[str]) -> None:
    if cfg.get("model_name_or_path"):
        settings["model"] = str(cfg["model_name_or_path"])
