"""--from-verl-config: verl's own key names (volcengine/verl b178a3cd, _generated_ppo_trainer.yaml
and algorithm/rollout_correction.yaml) -> exact diagnose settings;
missing keys -> notes; garbage -> one line, exit 2."""

import json
import re

import pytest

from conftest import bad_cli
from phantomclip.base.errors import ConfigError
from phantomclip.cli.main import main
from phantomclip.integrations.configs.verl import diagnose_settings_from_verl

VERL_YAML = """\
actor_rollout_ref:
  model:
    path: tiny-random:0
  actor:
    strategy: fsdp
    clip_ratio: 0.2
    clip_ratio_high: 0.28
    fsdp_config:
      model_dtype: fp32
      dtype: bfloat16
  rollout:
    name: vllm
    dtype: bfloat16
    temperature: 0.9
    top_k: -1
    top_p: 0.95
    response_length: ${oc.select:data.max_response_length,512}
    logprobs_mode: processed_logprobs
data:
  max_response_length: 8
algorithm:
  rollout_correction:
    rollout_is: token
    rollout_is_threshold: 2.0
    rollout_rs: token_k1
    rollout_rs_threshold: "0.5_4"
    bypass_mode: true
"""


def test_verl_keys_map_to_exact_settings(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(VERL_YAML)
    settings, notes = diagnose_settings_from_verl(path)
    assert settings == {
        "trainer": "bf16,fp32,fp16,bf16-autocast,fp32-head",  # FSDP's param dtype (fsdp_config.dtype) first
        "engine_dtype": "bf16", "temperature": 0.9, "top_p": 0.95, "top_k": 0,  # verl's -1 = off
        "logprobs_mode": "processed",
        "epsilon": 0.2, "epsilon_high": 0.28,  # clip_ratio_low falls back to clip_ratio
        "max_tokens": 8,  # data.max_response_length (rollout.response_length only interpolates it)
        "token_cap": 2.0,  # rollout_is token: TIS at rollout_is_threshold
        # token_k1 "0.5_4": verl keeps log 0.5 <= -log r <= log 4, i.e. r in [1/4, 1/0.5]
        "icepop_low": 0.25, "icepop_high": 2.0,
        "model": "tiny-random:0",
        "answer_in": "verl",  # the answer names verl's keys
        # bypass_mode true (loss_type ppo_clip, verl's default): the clip is on the rollout's log-probs; its IS weights
        # are computed for metrics only, its rejection mask (token_k1) still acts
        "setup": "verl-bypass", "is_mode": "icepop",
    }
    assert any("bypass_mode" in n for n in notes)
    assert not any("not set" in n for n in notes)  # every key the mapping reads is in the fixture


def test_other_dtypes_and_corrections():
    fsdp = {"fsdp_config": {"mixed_precision": {"param_dtype": "fp16"}, "dtype": "bfloat16"}}
    settings, _ = diagnose_settings_from_verl({"actor_rollout_ref": {"actor": fsdp, "rollout": {"dtype": "float16"}}})
    assert settings["trainer"].startswith("fp16,") and settings["engine_dtype"] == "fp16"  # mixed_precision wins
    algorithm = {"rollout_correction": {"rollout_is": "sequence", "rollout_is_threshold": 5,
                                        "rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "2"}}
    settings, notes = diagnose_settings_from_verl({"algorithm": algorithm})
    # one threshold shared by both options; a single number U is the band [1/U, U]
    assert (settings["seq_mask_cap"], settings["icepop_low"], settings["icepop_high"]) == (5.0, 0.5, 2.0)
    assert "token_cap" not in settings
    assert any("seq_mean_k3" in n and "not modelled" in n for n in notes)
    assert any("rollout_is sequence" in n for n in notes)


@pytest.mark.parametrize("block, setup, mode", [
    (None, "verl-decoupled", "none"),  # no rollout_correction: verl's defaults, bypass_mode false, rollout_is null
    ({"rollout_is": "token"}, "verl-decoupled", "token_truncate"),
    ({"rollout_is": "sequence"}, "verl-decoupled", "sequence_truncate"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2}, "verl-decoupled", "icepop"),
    ({"bypass_mode": True}, "verl-bypass", "none"),
    ({"bypass_mode": True, "loss_type": "reinforce"}, None, None),  # no clip: not modelled, judged as a clip
])
def test_verl_names_its_trainer_setup(block, setup, mode):
    settings, notes = diagnose_settings_from_verl({"algorithm": {} if block is None else {"rollout_correction": block}})
    assert (settings.get("setup"), settings.get("is_mode")) == (setup, mode)
    if setup is None:
        assert any("loss_type 'reinforce': no clip" in n for n in notes)


def test_unknown_verl_keys_are_named():
    """A key verl's config does not have, in a block the reader takes settings from, is named with the nearest real
    one (verl's keys at b178a3c: data/verl_b178a3c_keys.txt)."""
    _, notes = diagnose_settings_from_verl({"actor_rollout_ref": {"actor": {"clip_ratio_hgh": 0.28}}})
    assert ("not a key of verl's trainer config at b178a3c, so nothing was read from it: "
            "actor_rollout_ref.actor.clip_ratio_hgh (did you mean actor_rollout_ref.actor.clip_ratio_high?); the "
            "setting keeps its default here") in notes


def test_missing_keys_are_notes_with_verls_defaults():
    settings, notes = diagnose_settings_from_verl({"data": {"max_response_length": 64}})
    assert settings == {"trainer": "bf16,fp32,fp16,bf16-autocast,fp32-head", "engine_dtype": "bf16",
                        "epsilon": 0.2, "epsilon_high": 0.2, "max_tokens": 64, "answer_in": "verl",
                        "setup": "verl-decoupled", "is_mode": "none"}  # verl's defaults: bypass_mode false, no IS
    text = "\n".join(notes)
    for key in ("fsdp_config.dtype", "rollout.dtype", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                "clip_ratio_low", "clip_ratio_high", "algorithm.rollout_correction", "model.path"):
        assert key in text, key


@pytest.mark.parametrize("text, message", [
    ("a: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping of verl config sections at the top level, found list"),
    ("epsilon: 0.2\n", "not a verl trainer config"),
    ("actor_rollout_ref:\n  actor:\n    clip_ratio: wide\n", "actor.clip_ratio is 'wide', not a number"),
    ("algorithm:\n  rollout_correction:\n    rollout_rs: token_k1\n    rollout_rs_threshold: \"0_2\"\n",
     "bounds must be positive"),
    # the audit's case: a band that misses 1 reached diagnose as --icepop-low/--icepop-high, naming our flags
    ("algorithm:\n  rollout_correction:\n    rollout_rs: token_k1\n    rollout_rs_threshold: \"2.0_0.5\"\n",
     r"rollout_rs_threshold '2.0_0.5': the band must hold 1 \(LOWER <= 1 <= UPPER"),
    ("algorithm:\n  rollout_correction:\n    rollout_rs: token_k1\n    rollout_rs_threshold: \"0.5_0.9\"\n",
     r"rollout_rs_threshold '0.5_0.9': the band must hold 1"),
])
def test_garbage_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        diagnose_settings_from_verl(path)
    line = bad_cli(["diagnose", "--from-verl-config", str(path)], capsys)
    assert line.startswith("phantomclip diagnose: error: --from-verl-config") and re.search(message, line), line


def test_cli_reads_the_verl_config_and_keeps_an_explicit_max_tokens(tmp_path, capsys):
    """--max-tokens given: sampling stays short while the knob advice is judged at the config's 8 tokens; the
    rest comes from the file."""
    path, out = tmp_path / "ppo.yaml", tmp_path / "d.json"
    path.write_text(VERL_YAML)
    assert main(["diagnose", "--from-verl-config", str(path), "--n", "3", "--max-tokens", "4",
                 "--no-batch-invariance", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "from the verl config: " in err and "note: bypass_mode" in err
    d = json.loads(out.read_text())
    c = d["config"]
    assert (c["max_tokens"], c["knob_length"], d["knobs"]["length"]["target"]) == (4, 8, 8)
    assert (c["epsilon_high"], c["token_cap"], c["icepop_low"], c["logprobs_mode"]) == (0.28, 2.0, 0.25, "processed")
    assert list(d["recipes"])[0] == "bf16"
    line = bad_cli(["diagnose", "--from-verl-config", str(path), "--from-trl-config", str(path)], capsys)
    assert "not allowed with argument" in line


def test_verl_fp8_rollout_maps_to_block_fp8():
    """verl's FP8 rollout is DeepSeek's block scheme (docs/advance/fp8.md): actor_rollout_ref.rollout.quantization
    fp8 -> --engine-quant fp8-block; absent -> none; another scheme is named and not applied."""
    from phantomclip.integrations.configs.verl import diagnose_settings_from_verl

    base = {"actor_rollout_ref": {"rollout": {"quantization": "fp8"}}}
    settings, notes = diagnose_settings_from_verl(base)
    assert settings["engine_quant"] == "fp8-block" and any("fp8-block" in n for n in notes)
    settings, _ = diagnose_settings_from_verl({"actor_rollout_ref": {"rollout": {"dtype": "bfloat16"}}})
    assert "engine_quant" not in settings
    settings, notes = diagnose_settings_from_verl({"actor_rollout_ref": {"rollout": {"quantization": "int4"}}})
    assert "engine_quant" not in settings and "int4" in settings["unmapped"]
