"""`phantomclip diagnose --from-verl-config`: the diagnose settings matching a verl PPO/GRPO trainer config.

A pure mapping, YAML -> (settings, notes), that imports nothing of verl. Key names and defaults are verl's own, read
from volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29):
  verl/trainer/config/_generated_ppo_trainer.yaml   the flattened default config (every key below, its default)
  verl/trainer/config/engine/fsdp.yaml              fsdp_config.model_dtype ("model dtype of fsdp", fp32) and
                                                    fsdp_config.dtype ("Mixed precision training param dtype", bf16)
  verl/workers/fsdp_workers.py                      the actor's FSDP MixedPrecision: param_dtype =
                                                    fsdp_config.mixed_precision.param_dtype if that block is given,
                                                    else fsdp_config.dtype; every parameter is cast to it for the
                                                    forward, so the loss's log-probs come from a forward in that dtype
  verl/trainer/ppo/core_algos.py                    clip_ratio_low / clip_ratio_high, each falling back to clip_ratio
  verl/trainer/config/algorithm.py                  RolloutCorrectionConfig: rollout_is (None/token/sequence),
                                                    rollout_is_threshold (the upper truncation C), rollout_rs,
                                                    rollout_rs_threshold, bypass_mode
  verl/trainer/ppo/rollout_corr_helper.py           rejection sampling: token_k1 keeps a token where
                                                    log(lower) <= −log r <= log(upper), i.e. r in [1/upper, 1/lower]
                                                    (a single number U means lower = 1/U); thresholds are one spec
                                                    per option or one shared by all
The mapping, key by key, with what is not mapped, is in docs/metrics.md ("Reading a trainer's config").
"""

from __future__ import annotations

from pathlib import Path

from ...base.errors import LENGTH_LIMIT, ConfigError, brief
from ...precision.recipes import DEFAULT_TRAINERS
from .load import (
    CONFIG_DTYPES,
    SAMPLING,
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

FLAG = "--from-verl-config"
CORRECTION = "algorithm.rollout_correction"
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
"""the verl commit every key here was read at (module docstring; data/verl_b178a3c_keys.txt)."""
SECTIONS = ("actor_rollout_ref", "algorithm", "data")
"""a verl trainer config has at least one of these at its top level; a mapping with none of them is another file."""
TOKEN_RS = "token_k1"
"""the one rejection-sampling option the knob advice models: token masking outside a ratio band (IcePop's band)."""


def diagnose_settings_from_verl(config: str | Path | dict) -> tuple[dict, list[str]]:
    """`phantomclip diagnose` settings (DiagnoseConfig field names) matching a verl config (a YAML path or a
    dict), and notes on what was missing or could not be matched. Keys absent from the file keep diagnose's own
    defaults and are named in a note; a file that is not a YAML mapping with a verl section is a ConfigError, and so
    is a key given twice in one mapping (verl reads its YAML through OmegaConf, which refuses it: omegaconf/_utils.py
    get_yaml_loader @0019bcac)."""
    with naming_file(FLAG, config):
        cfg = read_mapping(config, FLAG, "verl config sections")
        if not any(section in cfg for section in SECTIONS):
            raise ConfigError(f"{FLAG}: no {', '.join(SECTIONS)} at the top level: not a verl trainer config (give "
                              "the YAML verl was run with, e.g. one written from its resolved config)")
        settings: dict = {}
        notes: list[str] = []
        for part in (_trainer_and_engine, _quantization, _sampling, _clip, _length, _correction, _model, _unknown):
            part(cfg, settings, notes)
    return settings, notes


CHECKED_BLOCKS = ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", CORRECTION)
"""the blocks whose keys are checked against verl's own (configs.load.known_keys): the ones the reader takes ε,
sampling and the correction from, where a misspelt key (clip_ratio_hgh) would fall back to verl's default unsaid."""


def _unknown(cfg: dict, settings: dict, notes: list[str]) -> None:
    """One note naming the keys of CHECKED_BLOCKS that verl's config at b178a3c does not have."""
    keys = [f"{block}.{k}" for block in CHECKED_BLOCKS if isinstance(get(cfg, block), dict) for k in get(cfg, block)]
    said = unknown_keys_note(keys, known_keys("verl"), f"verl's trainer config at {VERL_COMMIT[:7]}")
    if said:
        notes.append(said)


def get(cfg: dict, dotted: str):
    """The value at a dotted path of nested mappings, or None where a part is missing. An OmegaConf interpolation
    ('${...}', resolved by Hydra only when verl runs) reads as None too: its value is not in the file."""
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return None if isinstance(node, str) and "${" in node else node


def _number(dotted: str, value, cast=float, **bounds):
    """A config value as a number (in `bounds`, configs.load.number's), or ConfigError naming its key."""
    return number(FLAG, dotted, value, cast, **bounds)


def _dtype(dotted: str, value, notes: list[str]) -> str | None:
    """A verl dtype spelling as phantomclip's (configs.load.CONFIG_DTYPES: verl's PrecisionType lists, vLLM's
    'half'), or None with a note for one it does not know; a value that is not a string (verl's own `32` aside) is
    refused."""
    given = str(value) if isinstance(value, int) and not isinstance(value, bool) else text(FLAG, dotted, value)
    name = CONFIG_DTYPES.get(given.lower().removeprefix("torch."))
    if name is None:
        notes.append(f"{dotted} = {brief(given)} is not a dtype phantomclip knows (fp32, bf16, fp16): ignored")
    return name


ACTOR_FSDP = "actor_rollout_ref.actor.fsdp_config"


def _trainer_and_engine(cfg: dict, settings: dict, notes: list[str]) -> None:
    """The actor's forward dtype (FSDP's param_dtype) as the first trainer recipe, the rollout dtype as the engine's.
    verl's defaults when absent: fsdp_config.dtype bfloat16, rollout.dtype bfloat16 (_generated_ppo_trainer.yaml)."""
    strategy = get(cfg, "actor_rollout_ref.actor.strategy")
    strategy = None if strategy is None else text(FLAG, "actor_rollout_ref.actor.strategy", strategy)
    if strategy not in (None, "fsdp", "fsdp2"):
        unmapped(settings, f"actor_rollout_ref.actor.strategy {brief(strategy)}")
        notes.append(f"actor strategy {brief(strategy)}: only the FSDP actor's dtype keys are read; pass --trainer "
                     "yourself if its forward dtype differs")
    mixed = get(cfg, f"{ACTOR_FSDP}.mixed_precision")
    if mixed is not None:
        mapping(FLAG, f"{ACTOR_FSDP}.mixed_precision", mixed)
    where = f"{ACTOR_FSDP}.mixed_precision.param_dtype" if isinstance(mixed, dict) else f"{ACTOR_FSDP}.dtype"
    raw = mixed.get("param_dtype", "bf16") if isinstance(mixed, dict) else get(cfg, f"{ACTOR_FSDP}.dtype")
    if raw is None:
        notes.append(f"{where} not set: verl's default bfloat16 assumed (FSDP casts every parameter to it for the "
                     "forward)")
        raw = "bfloat16"
    trainer = _dtype(where, raw, notes)
    if trainer is None:
        unmapped(settings, f"{where} {brief(raw)}")
        trainer = "bf16"
    master = get(cfg, f"{ACTOR_FSDP}.model_dtype")
    if master is not None and _dtype(f"{ACTOR_FSDP}.model_dtype", master, notes) not in (None, "fp32"):
        notes.append(f"model_dtype {brief(master)}: the actor's master weights are in it too, so the optimizer's "
                     "updates are rounded as well; the forward is what diagnose measures")
    settings["trainer"] = ",".join([trainer, *(r for r in DEFAULT_TRAINERS if r != trainer)])
    settings["answer_in"] = "verl"
    notes.append(trainer_note(trainer, f"{where}: FSDP runs the actor's forward in it"))
    rollout = get(cfg, "actor_rollout_ref.rollout.dtype")
    if rollout is None:
        notes.append("actor_rollout_ref.rollout.dtype not set: verl's default bfloat16 assumed")
    engine = _dtype("actor_rollout_ref.rollout.dtype", rollout or "bfloat16", notes)
    if engine is None:
        unmapped(settings, f"actor_rollout_ref.rollout.dtype {brief(rollout)}")
    settings["engine_dtype"] = engine or "bf16"
    name = get(cfg, "actor_rollout_ref.rollout.name")
    name = None if name is None else text(FLAG, "actor_rollout_ref.rollout.name", name)
    if name not in (None, "vllm", "???"):
        notes.append(f"rollout engine {brief(name)}: measured against phantomclip's engine in "
                     f"{settings['engine_dtype']} (--engine local or vllm); its own kernels differ")


VERL_FP8 = {"fp8": "fp8-block", "fp8_per_block": "fp8-block"}
"""actor_rollout_ref.rollout.quantization -> --engine-quant. verl's FP8 rollout quantises weights in 128 x 128 blocks
and activations in 1 x 128 groups (DeepSeek's scheme: verl docs/advance/fp8.md, 'FP8 rollout for verl', updated
2025-12-04, 'Support Matrix'), which is precision/fp8.py's fp8-block."""


def _quantization(cfg: dict, settings: dict, notes: list[str]) -> None:
    """The rollout's FP8 quantisation (verl's `actor_rollout_ref.rollout.quantization`) as the engine's quantisers."""
    key = "actor_rollout_ref.rollout.quantization"
    value = get(cfg, key)
    value = None if value is None else text(FLAG, key, value)
    if value in (None, "", "none", "null"):
        return
    quant = VERL_FP8.get(value.lower())
    if quant is None:
        unmapped(settings, f"{key} {brief(value)}")
        notes.append(f"{key} = {brief(value)}: not an FP8 scheme phantomclip emulates ({', '.join(VERL_FP8)}): the "
                     "engine is measured unquantised")
        return
    settings["engine_quant"] = quant
    notes.append(f"{key} = {value}: the engine samples with {quant} (128 x 128 weight blocks, 1 x 128 activation "
                 "groups, as verl's FP8 rollout); a model whose layers the block does not divide is refused")


def _sampling(cfg: dict, settings: dict, notes: list[str]) -> None:
    """Rollout temperature, top_p, top_k (verl's −1 = off is diagnose's 0) and the log-prob mode vLLM reports."""
    rollout = "actor_rollout_ref.rollout"
    for key, cast, bounds in SAMPLING:
        value = get(cfg, f"{rollout}.{key}")
        if value is None:
            notes.append(f"{rollout}.{key} not set: diagnose's default")
            continue
        number = _number(f"{rollout}.{key}", value, cast, **bounds)
        settings[key] = 0 if key == "top_k" and number < 0 else number
    mode = get(cfg, f"{rollout}.logprobs_mode")
    mode = None if mode is None else text(FLAG, f"{rollout}.logprobs_mode", mode)
    if mode in ("raw_logprobs", "processed_logprobs"):
        settings["logprobs_mode"] = mode.removesuffix("_logprobs")
    elif mode is not None:
        notes.append(f"{rollout}.logprobs_mode {brief(mode)}: only raw_logprobs and processed_logprobs are measured")


def _clip(cfg: dict, settings: dict, notes: list[str]) -> None:
    """PPO's ε: clip_ratio_low / clip_ratio_high, each falling back to clip_ratio (verl core_algos.py), then to
    verl's default 0.2."""
    actor = "actor_rollout_ref.actor"
    both = get(cfg, f"{actor}.clip_ratio")
    for key, side in (("epsilon", "low"), ("epsilon_high", "high")):
        name, value = f"{actor}.clip_ratio_{side}", get(cfg, f"{actor}.clip_ratio_{side}")
        if value is None:
            name, value = f"{actor}.clip_ratio", both
        if value is None:
            notes.append(f"{actor}.clip_ratio_{side} and clip_ratio not set: verl's default 0.2")
            value = 0.2
        settings[key] = _number(name, value, knob=key)


def _length(cfg: dict, settings: dict, notes: list[str]) -> None:
    """The completion budget: data.max_response_length (rollout.response_length interpolates it by default)."""
    value = get(cfg, "data.max_response_length")
    value = get(cfg, "actor_rollout_ref.rollout.response_length") if value is None else value
    if value is None:
        notes.append("data.max_response_length not set: the knob advice is judged at --max-tokens")
        return
    settings["max_tokens"] = _number("data.max_response_length", value, int, low=1, high=LENGTH_LIMIT)



VERL_IS_LEVELS = ("token", "sequence")
"""rollout_is's values besides null (verl 0.9.1 verl/trainer/ppo/rollout_corr_helper.py,
compute_rollout_correction_weights: `valid_is_levels = {"token", "sequence"}`, any other a ValueError "Invalid
rollout_is")."""


def _correction(cfg: dict, settings: dict, notes: list[str]) -> None:
    """algorithm.rollout_correction as the knob advice's settings: rollout_is token -> the token cap C (TIS
    truncates r at C), sequence -> the sequence cap (verl truncates the sequence weight at C; the share it touches
    is the share a mask at C drops, which the knob advice reports); rollout_rs token_k1 -> IcePop's band."""
    block = get(cfg, CORRECTION)
    if block is None:
        settings["setup"], settings["is_mode"] = "verl-decoupled", "none"  # verl's defaults: bypass_mode false
        notes.append(f"{CORRECTION} not set: no rollout correction (verl's default rollout_is: null); the knob "
                     "advice shows diagnose's default settings")
        return
    block = mapping(FLAG, CORRECTION, block)
    level, threshold = block.get("rollout_is"), block.get("rollout_is_threshold", 2.0)
    level = None if level is None else text(FLAG, f"{CORRECTION}.rollout_is", level)
    if level == "token":
        settings["token_cap"] = _number(f"{CORRECTION}.rollout_is_threshold", threshold, knob="cap")
    elif level == "sequence":
        settings["seq_mask_cap"] = _number(f"{CORRECTION}.rollout_is_threshold", threshold, knob="cap")
        notes.append(f"rollout_is sequence at C = {settings['seq_mask_cap']:g}: verl truncates the sequence weight "
                     "at C; the knob advice's sequence_mask line counts the same sequences (exp(S) > C)")
    elif level is not None:  # verl raises at its first step, so a typo is no run without a correction
        raise ConfigError(f"{FLAG}: {CORRECTION}.rollout_is {brief(level)} is not one of verl's (null, "
                          f"{', '.join(VERL_IS_LEVELS)}): verl refuses it at its first step")
    if block.get("rollout_rs") is not None:
        _rejection(text(FLAG, f"{CORRECTION}.rollout_rs", block["rollout_rs"]), block.get("rollout_rs_threshold"),
                   settings, notes)
    bypass = block.get("bypass_mode")
    if bypass is not None and not isinstance(bypass, bool):
        raise ConfigError(f"{FLAG}: {CORRECTION}.bypass_mode is {brief(bypass)}, not true or false")
    _setup(block, bool(bypass), level, settings, notes)


def _setup(block: dict, bypass: bool, level: str | None, settings: dict, notes: list[str]) -> None:
    """Which ratio verl's actor clips (setups.SETUPS) and the correction on β: bypass_mode false (verl's default)
    clips against the actor's recomputed old_log_prob and meets β in rollout_is's truncated weight (token_truncate,
    sequence_truncate) or rollout_rs token_k1's mask (icepop); bypass_mode true with loss_type ppo_clip clips against
    the rollout's log-probs (its IS weights unused: core_algos.compute_policy_loss_bypass_mode); with loss_type
    reinforce there is no clip, a setup not modelled: left unnamed, judged as a clip."""
    rejects = settings.get("icepop_low") is not None
    loss_type = block.get("loss_type")
    loss_type = "ppo_clip" if loss_type is None else text(FLAG, f"{CORRECTION}.loss_type", loss_type)
    if bypass and loss_type != "ppo_clip":
        notes.append(f"bypass_mode with loss_type {brief(loss_type)}: no clip, a setup phantomclip does not model; "
                     "judged as a clip on the rollout's log-probs, where β does the most harm")
        return
    masked = "icepop" if rejects else "none"
    mode = {"token": "token_truncate", "sequence": "sequence_truncate"}.get(level or "", masked)
    if bypass:
        settings["setup"], settings["is_mode"] = "verl-bypass", masked
        notes.append("bypass_mode: the PPO ratio is taken against the rollout's log-probs directly, so β sits inside "
                     "the clipped ratio: the setting where phantom clipping appears"
                     + (f" (rollout_is {level} is computed for its metrics only)" if level else ""))
        return
    settings["setup"], settings["is_mode"] = "verl-decoupled", mode
    if level and rejects:
        notes.append("rollout_is and rollout_rs token_k1 both act: the answer judges rollout_is's weight; the knob "
                     "advice's IcePop line shows what the mask drops")


def _rejection(options: str, spec, settings: dict, notes: list[str]) -> None:
    """rollout_rs: token_k1's band as IcePop's [low, high]; the other options named in a note (not modelled). A
    threshold is UPPER or LOWER_UPPER, one per option (comma-separated) or one for all; anything else is refused."""
    key = f"{CORRECTION}.rollout_rs_threshold"
    if spec is not None and (isinstance(spec, bool) or not isinstance(spec, (str, int, float))):
        raise ConfigError(f"{FLAG}: {key} is {brief(spec)}: give UPPER or LOWER_UPPER (e.g. 0.5_2.0), "
                          "comma-separated per option")
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    specs = [s.strip() for s in str(spec).split(",") if s.strip()] if spec is not None else []
    if TOKEN_RS in names:
        if not specs:
            notes.append(f"rollout_rs {TOKEN_RS} without rollout_rs_threshold (verl refuses it): band not read")
        else:
            text_ = specs[names.index(TOKEN_RS)] if len(specs) == len(names) else specs[0]
            parts = text_.split("_")
            if len(parts) > 2:
                raise ConfigError(f"{FLAG}: {key} {brief(text_)}: expected UPPER or LOWER_UPPER (e.g. 0.5_2.0)")
            lower_s, upper_s = parts if len(parts) == 2 else ("", parts[0])
            upper = _number(key, upper_s)
            lower = _number(key, lower_s) if lower_s else None
            if upper <= 0 or (lower is not None and lower <= 0):  # before 1 / upper: 0 was a ZeroDivisionError
                raise ConfigError(f"{FLAG}: {key} {brief(text_)}: bounds must be positive")
            lower = 1 / upper if lower is None else lower
            if not lower <= 1 <= upper:  # else every token the engine and trainer agree on (r = 1) is dropped
                raise ConfigError(f"{FLAG}: {key} {brief(text_)}: the band must hold 1 (LOWER <= 1 <= UPPER, e.g. "
                                  "0.5_2.0), else it drops the tokens where trainer and engine agree")
            # verl keeps log(lower) <= −log r <= log(upper): r in [1/upper, 1/lower]
            settings["icepop_low"], settings["icepop_high"] = 1 / upper, 1 / lower
    other = [n for n in names if n != TOKEN_RS]
    if other:
        notes.append(f"rollout_rs {brief(', '.join(other))}: not modelled by the knob advice (it models {TOKEN_RS}, "
                     "as IcePop's band; the geometric-mean mask line uses the PPO ε)")


def _model(cfg: dict, settings: dict, notes: list[str]) -> None:
    """actor_rollout_ref.model.path, where it names a model."""
    path = get(cfg, "actor_rollout_ref.model.path")
    if path is not None:
        settings["model"] = text(FLAG, "actor_rollout_ref.model.path", path, empty=False)
    else:
        notes.append("actor_rollout_ref.model.path not set: the bundled model is measured (or pass --model)")
