"""Record what a real engine sampled, from inside the user's own run, as rollout files `diagnose --rollouts` reads
(docs/rollouts.md has the lines each framework adds).

  record_vllm(outputs, "rollouts.jsonl", dtype="bfloat16", params=sampling_params)   # vLLM RequestOutputs
  trainer = GRPOTrainer(..., callbacks=[RolloutRecorder("rollouts/")])             # TRL GRPOTrainer, every step
  trainer = AsyncGRPOTrainer(..., callbacks=[AsyncRolloutRecorder("rollouts/")])   # TRL async, with model versions
  record_verl_batch(batch, f"rollouts/step-{self.global_steps:06d}.jsonl")          # verl, after the advantages

Each writes one file per call (or per generation), atomically (temp file, then rename), so a killed run leaves whole
files; each file has the header (engine, dtype, sampling, which log-probs) and one record per sequence with its step
or weight version and, where the framework has them, its advantage and the engine's routed experts. The records are
checked as `diagnose` will read them (rollouts.parse_record), so a recorder never writes a file diagnose refuses.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch

from ..base.errors import IntegrationError, ascii_digits
from ..base.files import check_output_dir
from ..base.numerics import parse_dtype
from ..precision.fp8_vllm import PLAIN, QUANT_NAMES, installed_build
from ..rollouts.record import EngineInfo, Header, Record, RecordedSampling, RecordError, parse_record, write_records
from ..rollouts.slime_dumps import VERSION_DIGITS

VLLM_LOGPROBS = {"raw_logprobs": "raw", "processed_logprobs": "processed", "raw": "raw", "processed": "processed"}
"""vLLM's `logprobs_mode` values (vllm/config/model.py, LogprobsMode; default 'raw_logprobs') -> the record's."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _checked(records: list[Record], what: str) -> list[Record]:
    """Every record as diagnose will read it: a value it would refuse is refused here, when it is recorded."""
    for i, r in enumerate(records):
        try:
            parse_record({k: v for k, v in asdict(r).items() if v is not None}, f"{what}, sequence {i}")
        except RecordError as e:
            raise IntegrationError(str(e)) from None
    return records


def check_engine(who: str, dtype, quantization="", kv_cache_dtype="") -> None:
    """Refuse (IntegrationError, one line naming `who` and the argument) an engine a rollout file would record and
    `diagnose --rollouts` then refuse, when the recorder is built or called, not after a run: the dtype as diagnose
    parses it (numerics.parse_dtype), the FP8 arguments as it maps them (fp8_vllm.QUANT_NAMES; PLAIN: none)."""
    if not isinstance(dtype, str):
        raise IntegrationError(f"{who}: dtype {dtype!r} is not a string: give the engine's dtype (bfloat16, float16 "
                               "or float32)")
    try:
        parse_dtype(dtype)
    except ValueError:
        raise IntegrationError(f"{who}: dtype {dtype!r} is not one diagnose reads: give bfloat16, float16 or float32 "
                               "(an FP8 engine is its dtype plus quantization='fp8')") from None
    for arg, value in (("quantization", quantization), ("kv_cache_dtype", kv_cache_dtype)):
        key = value.strip().lower() if isinstance(value, str) else None
        if key is None or (key not in PLAIN and key not in QUANT_NAMES[arg]):
            raise IntegrationError(f"{who}: {arg} {value!r} is not one diagnose reads: give one of "
                                   f"{', '.join(QUANT_NAMES[arg])}, or '' for none")


def check_out_dir(who: str, out_dir) -> None:
    """Refuse (one line) an out_dir a recorder could never write: something other than a directory already there,
    a path under a file (/dev/null/x), a name too long; or no writable directory to create it in."""
    import os

    check_output_dir(out_dir, f"{who} out_dir")
    parent = Path(out_dir).absolute()
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise IntegrationError(f"{who} out_dir {out_dir}: cannot write under {parent}: choose a writable directory")


def _vllm_engine(dtype: str, quantization: str = "", kv_cache_dtype: str = "") -> EngineInfo:
    build = installed_build()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return EngineInfo(name=build.package if build else "vllm", version=build.version if build else "",
                      dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype, device=device)


def _sampling(params) -> RecordedSampling | None:
    """vLLM's (or TRL's) sampling settings as the record's; top_k -1 or None is off."""
    if params is None:
        return None
    top_k = getattr(params, "top_k", 0) or 0
    return RecordedSampling(temperature=float(getattr(params, "temperature", 1.0)),
                            top_p=float(getattr(params, "top_p", 1.0) or 1.0), top_k=max(int(top_k), 0),
                            min_p=float(getattr(params, "min_p", 0.0) or 0.0))


# ------------------------------------------------------------------------------------------------ vLLM


def record_vllm(outputs, path: str | Path, dtype: str, params=None, logprobs_mode: str = "raw_logprobs",
                step: int | None = None, model: str = "", quantization: str = "", kv_cache_dtype: str = "") -> int:
    """Write vLLM `RequestOutput`s (every completion of each) as a rollout file; returns the records written.

    Ask vLLM for the sampled token's log-prob (`SamplingParams(logprobs=0)`); `logprobs_mode` is the LLM's (default
    'raw_logprobs'); `dtype`, `quantization` and `kv_cache_dtype` are the engine arguments it ran with; `params` the
    SamplingParams (needed for processed log-probs). Routed experts (`enable_return_routed_experts=True`) and weight
    versions are taken where vLLM returned them."""
    from ..engines.vllm import sampled_logprobs

    check_engine("record_vllm", dtype, quantization, kv_cache_dtype)
    if not isinstance(logprobs_mode, str) or logprobs_mode not in VLLM_LOGPROBS:
        raise IntegrationError(f"record_vllm: logprobs_mode {logprobs_mode!r}: use the LLM's raw_logprobs or "
                               "processed_logprobs")
    records = []
    for out in outputs:
        for completion in out.outputs:
            logp = sampled_logprobs(completion)
            if any(math.isnan(v) for v in logp):
                raise IntegrationError("record_vllm: a completion has no log-prob for some sampled token: sample with "
                                       "SamplingParams(logprobs=0)")
            routes = getattr(completion, "routed_experts", None)
            records.append(Record(prompt_ids=list(out.prompt_token_ids), completion_ids=list(completion.token_ids),
                                  logp_engine=logp, step=step, weight_version=_vllm_version(completion),
                                  routed_experts=None if routes is None else routes.tolist(),
                                  finished=getattr(completion, "finish_reason", None) == "stop"))
    header = Header(source="vllm", model=model, engine=_vllm_engine(dtype, quantization, kv_cache_dtype),
                    sampling=_sampling(params), logprobs=VLLM_LOGPROBS[logprobs_mode], recorded_at=_now())
    write_records(path, header, _checked(records, "record_vllm"))
    return len(records)


# ------------------------------------------------------------------------------------------------ canary

CANARY_SAMPLING = RecordedSampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
"""a canary is read at temperature 1 without truncation: its raw and processed log-probs are the same numbers."""
CANARY_SEQUENCES, CANARY_TOKENS = 4, 32
"""the documented probe's size: 4 fixed sequences of 32 tokens (bench/benchmarks/bench_canary.py times it)."""


def default_probe(tokenizer, sequences: int = CANARY_SEQUENCES, tokens: int = CANARY_TOKENS) -> list[list[int]]:
    """The documented probe: phantomclip's bundled prompts joined into one text, cut into `sequences` runs of exactly
    `tokens` token ids (the same ids at every sync of a run; any fixed text of the model's tokenizer serves)."""
    from ..models.prompts import bundled_prompts

    ids = tokenizer.encode(" ".join(bundled_prompts()))
    if len(ids) < sequences * tokens:
        raise IntegrationError(f"default_probe: the bundled prompts hold {len(ids)} tokens, fewer than "
                               f"{sequences} x {tokens}: ask for a smaller probe")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(sequences)]


def read_canary(engine, sequences: list[list[int]]) -> list[list[float]]:
    """The engine's log-prob of every token of each fixed sequence after its first, teacher-forced with the weights it
    holds now: phantomclip's LocalEngine through its own decode path (`rescore`), a vLLM `LLM` through
    `prompt_logprobs` (vLLM's SamplingParams(max_tokens=1, prompt_logprobs=0): the log-prob of each prompt token
    given the ones before it)."""
    if any(len(s) < 2 for s in sequences) or not sequences:
        raise IntegrationError("canary: give at least one fixed sequence of two or more token ids")
    if callable(getattr(engine, "rescore", None)):
        from ..engines.local import Rollout, SamplingParams

        fixed = Rollout(prompt_ids=[s[:1] for s in sequences], completion_ids=[s[1:] for s in sequences],
                        logp_engine=[[0.0] * (len(s) - 1) for s in sequences],
                        logp_engine_processed=[[0.0] * (len(s) - 1) for s in sequences])
        params = SamplingParams(max_tokens=max(len(s) for s in sequences) - 1)
        return engine.rescore(fixed, params).logp_engine
    if callable(getattr(engine, "generate", None)) and hasattr(engine, "llm_engine"):
        from vllm import SamplingParams as VllmParams

        outputs = engine.generate([{"prompt_token_ids": list(s)} for s in sequences],
                                  VllmParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)
        return [[float(pos[tok].logprob) for pos, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for out, seq in zip(outputs, sequences)]
    raise IntegrationError(f"canary: {type(engine).__name__} is neither phantomclip's LocalEngine nor a vLLM LLM")


def record_canary(engine, sequences: list[list[int]], path: str | Path, dtype: str, step: int | None = None,
                  weight_version: int | None = None, model: str = "") -> int:
    """Write the engine's reading of the fixed `sequences` now (`read_canary`) as canary records of `step` (call it
    right after each weight sync, one file per sync); returns the records written. `dtype` is the engine's."""
    check_engine("record_canary", dtype)
    logp = read_canary(engine, sequences)
    records = [Record(prompt_ids=list(s[:1]), completion_ids=list(s[1:]), logp_engine=lp, step=step,
                      weight_version=weight_version, logprobs="raw", sampling=CANARY_SAMPLING, canary=True)
               for s, lp in zip(sequences, logp)]
    kind = "local" if callable(getattr(engine, "rescore", None)) else "vllm"
    engine_info = (EngineInfo(name="phantomclip-local", dtype=dtype) if kind == "local"
                   else _vllm_engine(dtype))
    header = Header(source=f"{kind} canary", model=model, engine=engine_info, logprobs="raw", recorded_at=_now())
    write_records(path, header, _checked(records, "record_canary"))
    return len(records)


def _vllm_version(completion) -> int | None:
    """The weight version of a completion's last tokens (vLLM's `weight_versions`, spans of (version, start, end)),
    where it is a whole number; None otherwise."""
    spans = getattr(completion, "weight_versions", None) or []
    version = str(getattr(spans[-1], "version", "")) if spans else ""
    return int(version) if ascii_digits(version) and len(version) <= VERSION_DIGITS else None


# ------------------------------------------------------------------------------------------------ TRL


try:  # a TrainerCallback when transformers is importable (it always is beside trl)
    from transformers import TrainerCallback as _Callback
except ImportError:  # pragma: no cover
    _Callback = object


class _Recorder(_Callback):
    """A recorder callback: attached to the trainer whose training loop starts it, unless attached before."""

    trainer = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            from .trl import find_trainer

            trainer = find_trainer()
            if trainer is None:
                raise IntegrationError(f"{type(self).__name__} could not find its trainer: call "
                                       "recorder.attach(trainer) before trainer.train()")
            self.attach(trainer)


class RolloutRecorder(_Recorder):
    """Records every generation of a TRL `GRPOTrainer` that samples with vLLM: per process, one file
    `{out_dir}/step-{step:06d}-rank{rank}.jsonl` per generation, with each completion's prompt and completion ids,
    vLLM's log-probs of them (`sampling_per_token_logps`, processed: TRL asks vLLM for them), its advantage, the
    step and the weight version (the step of the last weight sync). Changes nothing TRL computes: it reads the
    dict `_generate_and_score_completions` returns (trl 1.16 grpo_trainer.py).

    `canary`: True (the documented probe, `default_probe` of the trainer's tokenizer) or fixed token-id sequences:
    right after every weight sync, vLLM's reading of them (`read_canary`) is written as canary records of that step,
    `{out_dir}/canary-{step:06d}-rank{rank}.jsonl`, for the post-mortem's engine-or-learning test (docs/rollouts.md).
    vLLM colocate mode only (the server's client has no prompt log-prob call), and not with vllm_enable_sleep_mode
    (the KV cache sleeps between generations)."""

    def __init__(self, out_dir: str | Path, engine_dtype: str = "bfloat16", every: int = 1,
                 canary: bool | list[list[int]] = False):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise IntegrationError(f"RolloutRecorder: every must be a whole number >= 1, got {every!r}")
        if canary is not True and canary is not False and not (
                isinstance(canary, list) and canary and all(isinstance(c, list) and len(c) >= 2 for c in canary)):
            raise IntegrationError("RolloutRecorder: canary must be True, False or a list of fixed token-id "
                                   f"sequences of two or more ids each, got {type(canary).__name__}")
        check_engine("RolloutRecorder", engine_dtype)
        check_out_dir("RolloutRecorder", out_dir)
        self.out_dir, self.engine_dtype, self.every, self.canary = Path(out_dir), engine_dtype, every, canary
        self.trainer = None
        self.files: list[Path] = []

    def attach(self, trainer) -> None:
        """Hook into `trainer` (done by itself at the start of training when passed in callbacks=[...])."""
        from trl import GRPOTrainer

        if not isinstance(trainer, GRPOTrainer):
            raise IntegrationError(f"RolloutRecorder works with trl.GRPOTrainer, not {type(trainer).__name__}")
        if self.trainer is not None and self.trainer is not trainer:
            raise IntegrationError("this RolloutRecorder already records another trainer: make one per trainer")
        if getattr(trainer, "_pc_recorder", None) is not None:
            return
        if not trainer.use_vllm:
            raise IntegrationError("RolloutRecorder needs use_vllm=True: without vLLM, TRL samples with the "
                                   "trainer's own model and there is no engine log-prob to record")
        probe = self._probe(trainer) if self.canary else None
        self.trainer, trainer._pc_recorder = trainer, self
        if probe is not None:
            read_canary_after_sync(trainer.vllm_generation, lambda: self.record_canary(probe))
        original = trainer._generate_and_score_completions
        recorder = self

        def generate_and_record(inputs):
            batch = original(inputs)
            step = trainer.state.global_step
            if step % recorder.every == 0:
                recorder.record(batch, step, getattr(trainer, "_last_loaded_step", None))
            return batch

        trainer._generate_and_score_completions = generate_and_record

    def _probe(self, trainer) -> list[list[int]]:
        """The canary's fixed sequences, after the checks that it can be read in this trainer's vLLM mode."""
        generation = getattr(trainer, "vllm_generation", None)
        if getattr(generation, "mode", None) != "colocate" or getattr(generation, "llm", None) is None:
            raise IntegrationError("RolloutRecorder(canary=...) needs vllm_mode='colocate': TRL's vLLM server client "
                                   "has no prompt log-prob call; record the canary on the server's side "
                                   "(record_canary on its LLM after each sync)")
        if getattr(generation, "enable_sleep_mode", False):
            raise IntegrationError("RolloutRecorder(canary=...) does not work with vllm_enable_sleep_mode=True yet "
                                   "(vLLM's KV cache sleeps between generations): turn one of them off")
        if self.canary is True:
            tokenizer = trainer.processing_class
            return default_probe(getattr(tokenizer, "tokenizer", tokenizer))
        return [list(s) for s in self.canary]

    def record_canary(self, probe: list[list[int]]) -> Path:
        """vLLM's reading of the fixed probe now, as canary records of the step the sync is for."""
        step, rank = self.trainer.state.global_step, self.trainer.accelerator.process_index
        path = self.out_dir / f"canary-{step:06d}-rank{rank}.jsonl"
        record_canary(self.trainer.vllm_generation.llm, probe, path, self.engine_dtype, step=step,
                      model=str(getattr(self.trainer.model.config, "_name_or_path", "")))
        self.files.append(path)
        return path

    def record(self, batch: dict, step: int, version: int | None) -> Path | None:
        """One generation's batch as a rollout file; the rows TRL masked whole (truncated completions) or that have a
        token vLLM gave no log-prob are left out, and so are multi-turn rows with tool tokens (not sampled)."""
        logps = batch.get("sampling_per_token_logps")
        if logps is None:
            raise IntegrationError("RolloutRecorder: this batch has no vLLM log-probs (sampling_per_token_logps): "
                                   "sample with use_vllm=True")
        args = self.trainer.args
        records = [r for _, r in rows_as_records(
            batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], logps,
            advantages=batch.get("advantages"), tool_mask=batch.get("tool_mask"), step=step,
            version=version if version is not None and version >= 0 else None)]
        if not records:
            return None
        rank = self.trainer.accelerator.process_index
        path = self.out_dir / f"step-{step:06d}-rank{rank}.jsonl"
        header = Header(source="trl GRPOTrainer (phantomclip RolloutRecorder)",
                        model=str(getattr(self.trainer.model.config, "_name_or_path", "")),
                        engine=_vllm_engine(self.engine_dtype), logprobs="processed", recorded_at=_now(),
                        sampling=RecordedSampling(temperature=float(args.temperature), top_p=float(args.top_p),
                                                  top_k=max(int(args.top_k or 0), 0),
                                                  min_p=float(args.min_p or 0.0)))
        write_records(path, header, _checked(records, str(path)))
        self.files.append(path)
        return path


def read_canary_after_sync(generation, read) -> None:
    """Call `read()` after every weight sync of TRL's `VLLMGeneration` (trl 1.16 generation/vllm_generation.py
    `sync_weights`, which GRPOTrainer calls once per step before generating), whatever sync is installed when the
    recorder attaches (TRL's own, or integrations.trl.sync_vllm_by_reload's: call that one first)."""
    sync = generation.sync_weights

    def sync_then_read() -> None:
        sync()
        read()

    generation.sync_weights = sync_then_read


class AsyncRolloutRecorder(_Recorder):
    """Records every sample TRL's `AsyncGRPOTrainer` takes from its rollout queue, with the weight version that
    sampled it: one file `{out_dir}/step-{step:06d}.jsonl` per optimizer step, written at the step's end. A sample
    (trl 1.16 trl/experimental/async_grpo/async_rollout_worker.py, `RolloutSample`) holds the whole sequence
    (`input_ids`), a `completion_mask` over it, vLLM's log-probs (`old_log_probs`, zero outside the completion), its
    `advantage` and `model_version`; the recorder wraps the queue's `get` in the main process, where the trainer's
    dataset dequeues (samples it then drops as too stale are recorded too: the engine sampled them). Multi-turn
    samples (a completion mask that is not one run of ones to the end) are left out."""

    def __init__(self, out_dir: str | Path, engine_dtype: str = "bfloat16"):
        check_engine("AsyncRolloutRecorder", engine_dtype)
        check_out_dir("AsyncRolloutRecorder", out_dir)
        self.out_dir, self.engine_dtype = Path(out_dir), engine_dtype
        self.trainer, self.files, self._pending = None, [], []

    def attach(self, trainer) -> None:
        """Hook into `trainer`'s rollout queue (done by itself at the start of training from callbacks=[...])."""
        queue = getattr(trainer, "rollout_queue", None)
        if queue is None or not hasattr(queue, "get"):
            raise IntegrationError("AsyncRolloutRecorder works with TRL's AsyncGRPOTrainer (a rollout_queue with "
                                   f"get()); {type(trainer).__name__} has none")
        if self.trainer is not None and self.trainer is not trainer:
            raise IntegrationError("this AsyncRolloutRecorder already records another trainer: make one per trainer")
        if self.trainer is trainer:
            return
        self.trainer, get = trainer, queue.get
        pending = self._pending

        def get_and_record(*args, **kwargs):
            sample = get(*args, **kwargs)
            pending.append(sample)
            return sample

        queue.get = get_and_record

    def on_step_end(self, args, state, control, **kwargs):
        self.flush(state.global_step)

    def flush(self, step: int) -> Path | None:
        """The samples dequeued since the last flush as one file of `step`."""
        samples, self._pending[:] = list(self._pending), []
        records = [r for r in (sample_as_record(s, step) for s in samples) if r is not None]
        if not records:
            return None
        args = self.trainer.args
        path = self.out_dir / f"step-{step:06d}.jsonl"
        header = Header(source="trl AsyncGRPOTrainer (phantomclip AsyncRolloutRecorder)", logprobs="processed",
                        engine=_vllm_engine(self.engine_dtype), recorded_at=_now(),
                        sampling=RecordedSampling(temperature=float(args.temperature)))
        write_records(path, header, _checked(records, str(path)))
        self.files.append(path)
        return path


def sample_as_record(sample, step: int) -> Record | None:
    """One AsyncGRPOTrainer RolloutSample as a record: the prompt is the sequence before the completion mask's first
    one, the completion the rest; None where the mask is not one run to the end (tool turns) or a log-prob is not a
    finite one <= 0."""
    ids = [int(x) for x in sample.input_ids]
    mask = [int(x) for x in sample.completion_mask]
    start = mask.index(1) if 1 in mask else len(mask)
    if start == 0 or start == len(mask) or any(m != 1 for m in mask[start:]):
        return None
    logps = [float(x) for x in sample.old_log_probs[start:]]
    if any(not math.isfinite(v) or v > 0 for v in logps):
        return None
    return Record(prompt_ids=ids[:start], completion_ids=ids[start:], logp_engine=logps, step=step,
                  weight_version=int(sample.model_version), advantage=float(sample.advantage))


def rows_as_records(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor, logps: torch.Tensor, advantages: torch.Tensor | None = None,
                    tool_mask: torch.Tensor | None = None, step: int | None = None,
                    version: int | None = None) -> list[tuple[int, Record]]:
    """Padded batch rows as (row, record): prompts [B, P] left-padded (mask 1 on real tokens), completions [B, C] and
    the engine's log-probs [B, C] right-padded; a row whose completion mask is not one run of ones from its start
    (TRL's masked truncations, tool tokens), or that has a non-finite or positive log-prob, is left out."""
    out = []
    for b in range(prompt_ids.shape[0]):
        n = int(completion_mask[b].sum())
        real = completion_mask[b, :n].bool().all() and n > 0
        if tool_mask is not None:
            real = real and bool(tool_mask[b, :n].bool().all())
        lp = logps[b, :n].double()
        if not real or not torch.isfinite(lp).all() or (lp > 0).any():
            continue
        out.append((b, Record(prompt_ids=prompt_ids[b][prompt_mask[b].bool()].tolist(),
                              completion_ids=completion_ids[b, :n].tolist(), logp_engine=lp.tolist(), step=step,
                              weight_version=version,
                              advantage=None if advantages is None else float(advantages[b].reshape(-1)[0]))))
    return out


# ------------------------------------------------------------------------------------------------ verl


def record_verl_batch(batch, path: str | Path, dtype: str = "bfloat16", sampling: dict | None = None,
                      step: int | None = None) -> int:
    """Write a verl `DataProto` (after generation; after the advantages to have them) as a rollout file; returns the
    records written. Needs `actor_rollout_ref.rollout.calculate_log_probs=True`, which puts vLLM's or SGLang's
    log-probs in `rollout_log_probs` [B, R]; `prompts` [B, P] is left-padded, `responses` [B, R] right-padded,
    `attention_mask` [B, P + R] marks both (verl/experimental/agent_loop/agent_loop.py, `_postprocess`);
    `routed_experts` [B, P + R, layers, k] where the rollout returned them. verl samples with
    logprobs_mode processed_logprobs (verl/trainer/config/rollout/rollout.yaml): `sampling` is the rollout's
    temperature, top_p, top_k (and min_p) as in its config."""
    check_engine("record_verl_batch", dtype)
    t = batch.batch
    if "rollout_log_probs" not in t.keys():
        raise IntegrationError("record_verl_batch: the batch has no rollout_log_probs: set "
                               "actor_rollout_ref.rollout.calculate_log_probs=True")
    P = t["prompts"].shape[1]
    mask = t["attention_mask"]
    advantages = t["advantages"][:, 0] if "advantages" in t.keys() else None  # GRPO: the same on every token
    step = step if step is not None else batch.meta_info.get("global_steps")
    rows = rows_as_records(t["prompts"], mask[:, :P], t["responses"], t.get("response_mask", mask[:, P:]),
                           t["rollout_log_probs"], advantages=advantages, step=step)
    if "routed_experts" in t.keys():  # [B, P + R, layers, k], zeros outside each row's own positions
        for b, r in rows:  # every position but the last, from the row's first prompt token (left padding)
            start = P - len(r.prompt_ids)
            r.routed_experts = t["routed_experts"][b, start : start + len(r.prompt_ids) + len(r.completion_ids) - 1
                                                   ].tolist()
    records = [r for _, r in rows]
    header = Header(source="verl (phantomclip record_verl_batch)", engine=EngineInfo(dtype=dtype), logprobs="processed",
                    sampling=_sampling(SimpleNamespace(**sampling)) if sampling else None, recorded_at=_now())
    write_records(path, header, _checked(records, str(path)))
    return len(records)

