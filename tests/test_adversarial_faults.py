"""The fourth adversarial pass, one test per class of fault, each with the audit's instance and a variant: config
files that expand without bound, links inside the directories phantomclip writes, two jobs on one run, values read
silently as something else, history from another run, gate keys the result has, unbounded sizes, and start-up.

`bad_cli` (conftest) runs the CLI in-process and asserts exit 2, one stderr line and no traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import bad_cli
from phantomclip.cli import main
from phantomclip.errors import ConfigError
from phantomclip.integrations.config_files import EXPANSION_LIMIT
from phantomclip.integrations.trl_config import diagnose_settings_from_trl
from phantomclip.integrations.verl import diagnose_settings_from_verl

TINY = ["--model", "tiny-random"]


def _no_model_work(monkeypatch):
    """Any model load fails the test: a case that passes refused its input before loading anything."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr("phantomclip.models.check_vocab", loaded)


# ------------------------------------------------------------------------------ 1. YAML aliases without bound


def _alias_bomb(levels: int, field: str) -> str:
    """A YAML document whose `field` (a dotted path, nested as mappings) is an alias of `levels` levels of nine
    aliases each: 9^levels leaves written in a few hundred bytes."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    *parents, leaf = field.split(".")
    body = f"{leaf}: *a{levels - 1}"
    for parent in reversed(parents):
        body = f"{parent}: {{{body}}}"
    return "\n".join(lines) + "\n" + body + "\n"


@pytest.mark.parametrize("flag,field", [("--from-trl-config", "min_p"),  # the audit's instance
                                        ("--from-verl-config", "actor_rollout_ref.rollout.name")])
def test_an_alias_bomb_is_one_line_before_any_value_is_used(flag, field, tmp_path, capsys, monkeypatch):
    """9^9 leaves in about 500 bytes: refused while the document is composed, naming the file and the alias in the
    first node past EXPANSION_LIMIT. Counting every list and scalar: a0 holds 1 + 9 = 10 values, a_i 1 + 9 a_(i-1):
    a4 66,430, a5 597,871 > 100,000, so the line of a5 (line 6, nine *a4) is the one named."""
    _no_model_work(monkeypatch)
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9, field))
    assert path.stat().st_size < 600
    t0 = time.perf_counter()
    line = bad_cli(["diagnose", *TINY, flag, str(path)], capsys)
    assert time.perf_counter() - t0 < 20  # it ran past 60 s; composing 600 bytes takes milliseconds
    assert line == (f"phantomclip diagnose: error: {flag} {path}: the alias *a4 (line 6) expands to more than "
                    f"{EXPANSION_LIMIT:,} values (an alias bomb, not a trainer config): write the values out")


def test_an_alias_under_the_bound_is_read_and_a_value_is_shown_briefly(tmp_path):
    """An ordinary anchor is read as written; a field aliased to 9^4 = 6,561 leaves (about 15,700 values in the
    document, under the bound) that is not what the field holds is refused in a line showing a few dozen characters
    of the value, not its 33 kB repr."""
    ok = tmp_path / "ok.yaml"
    ok.write_text("t: &t 0.7\ntemperature: *t\ntop_p: *t\n")
    settings, _ = diagnose_settings_from_trl(ok)
    assert (settings["temperature"], settings["top_p"]) == (0.7, 0.7)
    for field, fragment in (("model_name_or_path", "model_name_or_path is a list"), ("min_p", "min_p is [[[[")):
        path = tmp_path / f"{field}.yaml"
        path.write_text(_alias_bomb(4, field))
        with pytest.raises(ConfigError) as e:
            diagnose_settings_from_trl(path)
        assert fragment in str(e.value) and len(str(e.value)) < 300, str(e.value)[:400]


# ------------------------------------------------------------------- 4. values read as something else, unsaid


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_vllm_own_names_select_their_quantisers_and_an_unknown_one_is_unjudged(tmp_path):
    """vLLM's own spellings map to the recipes they select (fp8_vllm.VLLM_ARGS read backwards); a setting vLLM takes
    that no recipe emulates is said and leaves the result unjudged; one phantomclip's reader owns is refused."""
    cases = {"vllm_kwargs: {quantization: fp8_per_channel}": "fp8-w8a8-channel",  # the audit's instance
             "vllm_kwargs: {quantization: fp8_per_block, kv_cache_dtype: fp8_e4m3}": "fp8-block,fp8-kv",
             "quantization: fp8_per_tensor": "fp8-w8a8"}
    for text, quant in cases.items():
        assert diagnose_settings_from_trl(_yaml(tmp_path, text))[0]["engine_quant"] == quant, text
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "vllm_kwargs: {quantization: awq}\n"))
    assert "engine_quant" not in settings and settings["unmapped"] == "vLLM vllm_kwargs.quantization 'awq'"
    assert any("'awq': not a setting phantomclip emulates" in n for n in notes)
    refused = {"vllm_kwargs: [quantization, fp8]": "vllm_kwargs is a list (['quantization', 'fp8']), not a mapping",
               "vllm_dtype: 0": "vllm_dtype is a number (0), not a name",  # was bf16, unsaid
               "vllm_dtype: fp8": "vllm_dtype 'fp8' is not a dtype",
               "vllm_importance_sampling_mode: token_clip": "is not one of TRL's",
               "model_init_kwargs: [dtype, float16]": "model_init_kwargs is a list"}
    for text, fragment in refused.items():
        with pytest.raises(ConfigError, match=None) as e:
            diagnose_settings_from_trl(_yaml(tmp_path, text + "\n"))
        assert fragment in str(e.value), (text, str(e.value))


def test_trainer_dtypes_and_repeated_keys_are_said(tmp_path):
    """model_init_kwargs dtype float16 under TRL's default bf16 autocast is a mix no recipe measures (was judged
    as bf16-autocast unsaid); with bf16 off it is the fp16 recipe. A key given twice: a note for TRL (PyYAML keeps
    the last), refused for verl (OmegaConf refuses it)."""
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "model_init_kwargs: {dtype: float16}\n"))
    assert settings["unmapped"].startswith("model_init_kwargs.dtype float16") and any("float16 with bf16" in n
                                                                                      for n in notes)
    settings, _ = diagnose_settings_from_trl(_yaml(tmp_path, "model_init_kwargs: {dtype: float16}\nbf16: false\n"))
    assert settings["trainer"].startswith("fp16,") and "unmapped" not in settings
    settings, notes = diagnose_settings_from_trl(_yaml(tmp_path, "epsilon: 0.1\nepsilon: 0.3\n"))
    assert settings["epsilon"] == 0.3 and "key 'epsilon' given twice (lines 1 and 2): TRL's YAML reader" in notes[0]
    with pytest.raises(ConfigError, match=r"key 'data' given twice \(lines 1 and 3\): give each key once"):
        diagnose_settings_from_verl(_yaml(tmp_path, "data: {max_response_length: 8}\nalgorithm: {}\n"
                                                    "data: {max_response_length: 4096}\n"))


@pytest.mark.parametrize("block,fragment", [
    ("rollout_rs: [token_k1], rollout_rs_threshold: 2.0", "rollout_rs is a list (['token_k1']), not a name"),
    ("rollout_rs: token_k1, rollout_rs_threshold: '0.5_1_5'", "rollout_rs_threshold '0.5_1_5': expected UPPER or"),
    ("rollout_is: token, rollout_is_threshold: '1_5'", "rollout_is_threshold is '1_5', not a number"),
    ("rollout_rs: token_k1, rollout_rs_threshold: [2.0]", "rollout_rs_threshold is [2.0]: give UPPER"),
    ("bypass_mode: 'false'", "bypass_mode is 'false', not true or false"),
])
def test_verl_correction_fields_of_the_wrong_shape_are_refused(block, fragment, tmp_path):
    """rollout_rs_threshold '0.5_1_5' was read as lower 0.5, upper 15, and rollout_is_threshold '1_5' as 15
    (float() takes '1_5'); a list of options was a note about an option named "['token_k1']"."""
    with pytest.raises(ConfigError) as e:
        diagnose_settings_from_verl(_yaml(tmp_path, f"algorithm: {{rollout_correction: {{{block}}}}}\n"))
    assert fragment in str(e.value), str(e.value)
    band = diagnose_settings_from_verl(_yaml(tmp_path, "algorithm: {rollout_correction: {rollout_rs: token_k1, "
                                                       "rollout_rs_threshold: '0.5_2.0'}}\n"))[0]
    assert (band["icepop_low"], band["icepop_high"]) == (0.5, 2.0)  # r in [1/upper, 1/lower]


def test_a_typed_trainer_keeps_an_unmapped_engine_unjudged(tmp_path, capsys):
    """--trainer typed over a verl config whose rollout dtype is unmapped: the trainer's reading is moot, the
    engine's is not, so the answer still says 'not judged' (was: judged as if the engine were bf16)."""
    path = _yaml(tmp_path, "actor_rollout_ref: {rollout: {dtype: int8}, actor: {fsdp_config: {dtype: int4}}}\n")
    out = tmp_path / "d.json"
    assert main(["diagnose", *TINY, "--n", "2", "--max-tokens", "2", "--trainer", "fp32", "--from-verl-config",
                 str(path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["unmapped"] == "actor_rollout_ref.rollout.dtype 'int8'"
    assert result["answer"]["status"] == "not judged"


def test_an_empty_list_of_quantisers_or_interventions_is_refused(capsys, monkeypatch):
    """--engine-quant ',' ran an engine without FP8; --intervention ',' ran the baseline."""
    _no_model_work(monkeypatch)
    for command in ("train", "diagnose"):
        line = bad_cli([command, *TINY, "--engine-quant", ","], capsys)
        assert line.startswith(f"phantomclip {command}: error: --engine-quant: ',' names no quantiser: give one")
    line = bad_cli(["train", *TINY, "--intervention", " , "], capsys)
    assert "--intervention ' , ' names no intervention" in line


def test_the_async_monitor_refuses_a_negative_staleness(tmp_path):
    import trl_async_setup as setup
    from phantomclip.errors import IntegrationError
    from phantomclip.integrations.trl_async import AsyncPrecisionMonitor

    trainer, _ = setup.make_trainer(str(tmp_path / "x"), steps=1)
    for name, value in (("max_staleness", -1), ("weight_sync_steps", 0)):
        good = getattr(trainer.args, name)
        setattr(trainer.args, name, value)
        with pytest.raises(IntegrationError, match=f"{name} must be a whole number >= "):
            AsyncPrecisionMonitor().attach(trainer)
        setattr(trainer.args, name, good)
