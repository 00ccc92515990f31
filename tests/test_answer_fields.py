"""Every field the answer can propose exists in the framework version it names: TRL's in the installed trl 1.16's own
config classes (GRPOConfig, AsyncGRPOConfig, `trl vllm-serve`'s ScriptArguments), verl's among the keys of verl's
default trainer config at the commit integrations/configs/verl.py cites (tests/data/verl_b178a3c_keys.txt), and the
changes the answer writes for a crafted result paste back as the fields they claim (YAML for TRL, overrides for
verl)."""

import dataclasses
import warnings

import pytest
import yaml

from phantomclip.answer.changes import (
    CAP_FIELDS,
    CORRECTION_ON,
    EPSILON_FIELDS,
    FP8_OFF,
    MODE_FIELDS,
    RECIPE_SETTINGS,
    REPLAY,
    _fp8_off_trl,
    as_pasted,
)
from phantomclip.integrations.configs.load import known_keys
from phantomclip.precision.recipes import RECIPES

VERL_KEYS = known_keys("verl")


@pytest.fixture(scope="module")
def trl_fields() -> dict[str, set[str]]:
    """The field names of trl's config classes, read from the installed trl (its version checked)."""
    import trl
    from trl import GRPOConfig
    from trl.scripts.vllm_serve import ScriptArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental warns that its APIs may change
        from trl.experimental.async_grpo import AsyncGRPOConfig
    assert trl.__version__.startswith("1.16"), trl.__version__
    return {name: {f.name for f in dataclasses.fields(cls)} for name, cls in
            (("GRPOConfig", GRPOConfig), ("AsyncGRPOConfig", AsyncGRPOConfig), ("vllm-serve", ScriptArguments))}


def _proposed() -> dict[str, set[str]]:
    """Every field, by config class, that any table of answer.changes can put in a change."""
    out: dict[str, set[str]] = {}
    for config, recipes in RECIPE_SETTINGS.items():
        for fields in recipes.values():
            out.setdefault(config, set()).update(fields or {})
    for config, pair in EPSILON_FIELDS.items():
        out.setdefault(config, set()).update(pair)
    for config, field in CAP_FIELDS.items():
        out.setdefault(config, set()).add(field)
    for fields, config in FP8_OFF.values():
        out.setdefault(config, set()).update(fields or {})
    for config, fields in REPLAY.items():
        out.setdefault(config, set()).update(fields)
    fields, config, _ = _fp8_off_trl({"fp8": {"engine_recipe": "bf16+fp8-kv"}})
    out.setdefault(config, set()).update(fields)
    out["GRPOConfig"].add(CORRECTION_ON["trl-grpo"].split(":")[0])
    out["verl"].add(CORRECTION_ON["verl-decoupled"].split("=")[0])
    out["verl"].add("algorithm.rollout_correction.rollout_rs_threshold")  # the IcePop band's (answer.changes)
    for config, fields_of in MODE_FIELDS.items():  # the IS mode a change selects
        out.setdefault(config, set()).update(fields_of("token_truncate"))
    return out


def test_every_trl_field_exists_in_trl_1_16(trl_fields):
    proposed = _proposed()
    for config in ("GRPOConfig", "AsyncGRPOConfig", "vllm-serve"):
        tops = {f.split(".")[0] for f in proposed[config]}  # model_init_kwargs.dtype: a from_pretrained argument
        assert tops <= trl_fields[config], (config, tops - trl_fields[config])
    assert {"cast_lm_head_to_fp32", "vllm_importance_sampling_clip_max", "epsilon_high", "model_init_kwargs",
            "bf16", "fp16"} <= proposed["GRPOConfig"] | {"model_init_kwargs"}
    # trl 1.16's GRPOConfig has no vllm_kwargs and AsyncGRPOConfig no cast_lm_head_to_fp32 (the issue's finding)
    assert "vllm_kwargs" not in trl_fields["GRPOConfig"] and "cast_lm_head_to_fp32" not in trl_fields["AsyncGRPOConfig"]
    assert all(v is None or v.keys() <= trl_fields["AsyncGRPOConfig"] for v in RECIPE_SETTINGS["AsyncGRPOConfig"]
               .values())


def test_the_shipped_trl_field_list_is_trl_1_16s(trl_fields):
    """data/trl_1.16_fields.txt (what --from-trl-config knows) holds exactly the installed trl's fields: its config
    classes and the CLI's ModelConfig and ScriptArguments."""
    from trl import ModelConfig, ScriptArguments

    cli = {f.name for cls in (ModelConfig, ScriptArguments) for f in dataclasses.fields(cls)}
    assert known_keys("trl") == set().union(*trl_fields.values(), cli)


def test_every_verl_key_exists_in_verls_config():
    missing = {k for k in _proposed()["verl"] if k not in VERL_KEYS}
    assert not missing, missing
    assert len(VERL_KEYS) == 635  # the file as generated (a truncated copy would pass anything)


def test_every_recipe_setting_names_a_recipe():
    for config, recipes in RECIPE_SETTINGS.items():
        assert set(recipes) <= set(RECIPES), config


@pytest.mark.parametrize("config, fields, pasted", [
    ("GRPOConfig", {"model_init_kwargs.dtype": "float32", "bf16": False}, {"model_init_kwargs": {"dtype": "float32"},
                                                                           "bf16": False}),
    ("GRPOConfig", {"epsilon_high": 0.262}, {"epsilon_high": 0.262}),
    ("vllm-serve", {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "auto"}),
])
def test_trl_changes_paste_as_yaml(config, fields, pasted):
    assert yaml.safe_load(as_pasted(fields, config)) == pasted


def test_verl_changes_paste_as_overrides():
    fields = {"actor_rollout_ref.rollout.quantization": None, "actor_rollout_ref.rollout.enable_rollout_routing_replay":
              True, "actor_rollout_ref.actor.clip_ratio_high": 0.3}
    lines = as_pasted(fields, "verl").splitlines()
    assert lines == ["actor_rollout_ref.rollout.quantization=null",
                     "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                     "actor_rollout_ref.actor.clip_ratio_high=0.3"]
    # each override reads back (Hydra parses an override's value as YAML) as the field it claims
    assert {k: yaml.safe_load(v) for k, v in (line.split("=", 1) for line in lines)} == fields
