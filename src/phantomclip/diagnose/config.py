"""`phantomclip diagnose`'s configuration: one dataclass, a docstring under every field (each is a flag), and its
validation, which refuses a setting that cannot run in one line before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..answer.setups import get_setup, resolve_mode
from ..base.devices import resolve_device
from ..base.errors import BATCH_ROWS_LIMIT, LENGTH_LIMIT, ConfigError, check_field_types, check_number, check_seed
from ..base.files import check_output_path
from ..base.numerics import parse_dtype
from ..engines import ENGINE_KINDS, cannot_run
from ..engines.local import SamplingParams
from ..engines.vllm_memory import check_share
from ..maths.frameworks import FRAMEWORKS, check_frameworks
from ..maths.loss import KNOBS, check_knobs, clip_range
from ..models.load import BUNDLED_NAME
from ..precision.recipes import (
    DEFAULT_TRAINERS,
    RECIPES,
    Recipe,
    RecipeError,
    engine_quants,
    engine_recipe,
    get_recipe,
    resolve_matmul,
    with_quant,
)
from .knobs import KnobSettings

KNOB_FIELDS = {"epsilon": "epsilon", "epsilon_high": "epsilon_high", "seq_mask_cap": "cap", "token_cap": "cap",
               "icepop_low": "icepop_low", "icepop_high": "icepop_high"}
"""DiagnoseConfig's fields that are loss.KNOBS: one default, range and help for every command."""
ANSWER_FRAMEWORKS = ("", "trl", "verl")
"""the frameworks whose config fields the answer can name (answer.RECIPE_FIELDS)."""


@dataclass
class DiagnoseConfig:
    """Everything that determines a diagnose run (written verbatim into the JSON output)."""

    model: str = BUNDLED_NAME
    """model to measure: 'smollm2-135m' (bundled), 'tiny-random[:seed[:init_std]]', 'tiny-moe[:seed[:init_std]]' (a
    random 2-layer MoE: its expert routing), a local directory or a hub id."""
    trainer: list[str] = field(default_factory=lambda: list(DEFAULT_TRAINERS))
    """trainer precision recipes to compare against the engine, comma-separated (recipes.RECIPES; the first is told
    apart in the verdict); default: recipes.DEFAULT_TRAINERS."""
    engine: str = "local"
    """inference engine: 'local' (in-process, this package) or 'vllm' (vLLM's offline LLM; install it apart, see
    docs/vllm.md)."""
    engine_dtype: str = "bf16"
    """dtype the inference engine samples in (bf16, fp16 or fp32)."""
    engine_quant: str = ""
    """FP8 quantisers the engine samples with, comma-separated, on top of --engine-dtype (precision/fp8.py): fp8-w8a8
    (vLLM quantization='fp8'), fp8-w8a8-channel, fp8-block, fp8-w8a16 (weight-only) and/or fp8-kv
    (kv_cache_dtype='fp8'). The FP8 engine's tokens are then also read by the plain engine, and β splits into β_quant
    and the rest (the result's 'fp8' key). Local engine only. Empty: none."""
    logprobs_mode: str = "raw"
    """which log-probs vLLM reports: 'raw' (full vocabulary, before temperature) or 'processed' (after temperature
    and truncation, as TRL asks for)."""
    max_model_len: int = 0
    """vLLM's context limit in tokens (0 = the model's own)."""
    vllm_memory_share: float | None = None
    """with --engine vllm on a GPU: the share of the GPU's memory vLLM may take (its gpu_memory_utilization); default:
    what is free once the recipes' scoring memory is set aside, at most 0.9. A model that cannot fit both is refused,
    naming the memory needed and available (engines/vllm_memory.py). Ignored on the CPU."""
    epsilon: float = KNOBS["epsilon"].default
    """PPO clip ε_low: the ratio's lower bound is 1 − ε_low (loss.KNOBS, as every knob below)."""
    epsilon_high: float | None = KNOBS["epsilon_high"].default
    """PPO clip ε_high (DAPO's clip-higher); None: the same as --epsilon (loss.clip_range)."""
    n: int = 64
    """number of completions to sample (prompts are reused in order if n exceeds the prompt set); with --rollouts,
    at most this many recorded sequences, in file order (0, the default there: all of them)."""
    max_tokens: int = 48
    """maximum completion length in tokens."""
    temperature: float = 1.0
    """sampling temperature; trainer log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """engine top-p; β is measured on full-vocabulary log-probs, and truncation's own bias (log S) apart."""
    top_k: int = 0
    """engine top-k (0 = off)."""
    min_p: float = 0.0
    """engine min-p: keep tokens with at least min_p times the top token's probability (0 = off)."""
    seed: int = 0
    """seed of the engine's sampler."""
    prompts: str | None = None
    """file of prompts (one per line, or JSONL with a "prompt" field); None: the 64 bundled prompts."""
    batch_size: int = 64
    """sequences per engine / scoring batch (decode is bound by reading the weights: bigger batches are cheaper per
    token)."""
    seq_mask_cap: float = KNOBS["cap"].default
    """cap C of TRL's sequence_mask: sequences with exp(Σβ) > C would be dropped."""
    token_cap: float = KNOBS["cap"].default
    """cap C of the token-level corrections, for the knob advice: TIS (token_truncate) truncates r to C, token_mask
    drops tokens with r > C (loss.KNOBS; TRL's vllm_importance_sampling_cap)."""
    icepop_low: float = KNOBS["icepop_low"].default
    """IcePop's lower bound, for the knob advice: tokens with r below it are dropped."""
    icepop_high: float = KNOBS["icepop_high"].default
    """IcePop's upper bound, for the knob advice: tokens with r above it are dropped."""
    keep_share: float = 0.99
    """the knob advice's target: for each correction knob, the setting that leaves this share of tokens (token
    knobs) or of sequences (sequence knobs) untouched on the measured β of the first trainer recipe, in (0, 1)."""
    batch_invariance: bool = True
    """also score up to 12 sequences (BATCH_INVARIANCE_SEQUENCES, spread over the n) one at a time, unpadded, under
    each trainer recipe, and report split.batch = logp in the run's batch − logp alone: 12 single-sequence forwards
    per recipe (`seconds_alone`). Measured on the bundled model's default run
    (bench/benchmarks/bench_batch_invariance.py, runs with and without interleaved, 2-core AMX Xeon, 2026-12-07):
    idle, median 48.6 s with the pass against 35.9 s without (+35%); shared with other jobs (load 4.4-6.7), 505 s
    against 241 s (+109%: single-sequence forwards slow down far more under load than batched ones). Turn it off to
    save that time."""
    matmul: str = "auto"
    """low-precision matmul kernels: auto, native (PyTorch's) or emulated (fp32 accumulate; see
    precision/recipes.py)."""
    device: str = "auto"
    """where the model, the local engine and the recipes' scoring run: auto (the first CUDA device if torch sees one,
    else the CPU), cpu, cuda or cuda:N (devices.resolve_device). Figures are computed on the host."""
    framework: list[str] = field(default_factory=lambda: list(FRAMEWORKS))
    """RL frameworks whose own mismatch figures to compute for each recipe, comma-separated (frameworks.FRAMEWORKS;
    default all of them: a few masked means, negligible next to scoring)."""
    knob_length: int = 0
    """completion length in tokens the knob advice judges the sequence knobs at (extrapolated when longer than the
    sampled completions); 0: --max-tokens. --from-trl-config / --from-verl-config fill it from the config's
    completion length when it is 0."""
    answer_in: str = ""
    """whose config fields the answer's changes are written in: 'trl' (GRPOConfig fields), 'verl' (its YAML keys) or
    '' (phantomclip's own flags); --from-trl-config / --from-verl-config set it (answer/decide.py)."""
    setup: str = ""
    """the trainer you run, for the answer: which ratio its clip sees and where β enters its loss (setups.SETUPS:
    trl-grpo, trl-async, verl-decoupled, verl-bypass, slime, slime-rollout-logprobs, nemo-rl, phantomclip);
    --from-trl-config / --from-verl-config set it. Empty: not named, judged as a clip against the engine's log-probs,
    where β does the most harm."""
    is_mode: str = ""
    """the importance-sampling correction that trainer runs on β (loss.CORRECTIONS: none, token_truncate, token_mask,
    sequence_truncate, sequence_mask, icepop), at --token-cap, --seq-mask-cap or the IcePop band; the config readers
    set it. Empty: the setup's default (TRL GRPOTrainer: sequence_mask; the others: none)."""
    unmapped: str = ""
    """what of a --from-trl-config / --from-verl-config file maps to no recipe phantomclip measures (its trainer's
    dtype, say); set by those readers, not a flag. The answer then gives no status, only the generic changes."""
    drift: int | None = None
    """push the same (unchanged) weights into the engine this many times and re-read the same tokens after each
    push (engines/drift.py); a gap that moves is an engine defect. None: off."""
    rollouts: str = ""
    """a rollout file that a real engine recorded (token ids and the engine's own log-prob of each sampled token;
    docs/rollouts.md): its tokens are scored instead of sampling, against the engine named in the file, with the
    dtype, FP8 arguments and sampling it recorded. --model is then the checkpoint that sampled them. Empty: sample."""
    rollouts_step: int | None = None
    """with --rollouts: measure only the records of this step (their `step`, or their weight version where they have
    no step). None: every record."""
    checkpoints: str = ""
    """with --rollouts DIR holding records of several steps: a post-mortem, step by step. A directory of the run's
    checkpoints, one per step, named checkpoint-N (TRL, HF Trainer), global_step_N (verl), step-N, step_N or iter_N:
    each step's records are measured against the checkpoint whose weights sampled them, found by scoring a sample of
    them against every checkpoint (--model stands for step 0 where no checkpoint is; docs/rollouts.md, "Engine or
    learning"). Empty: every step against --model."""
    save_rollouts: str = ""
    """also write what the engine sampled as a rollout file, for `--rollouts` later, e.g. on another machine or with
    another checkpoint; as --json writes PATH: an earlier phantomclip output is replaced whole, through a temp file
    (the line that says it was written says so), a device or FIFO such as /dev/stdout is written into; a file
    phantomclip did not write, a directory, an unwritable place or the --json file is refused before sampling.
    Empty: none."""
    checkpoint_lag: int | None = 0
    """steps between the recorded tokens and the checkpoint measuring them (a post-mortem sets it; None: unknown):
    the check that the records belong to the checkpoint (recorded.check_belongs) is made only at 0, since a later
    checkpoint's β holds the policy's change too (set by the post-mortem, not a flag)."""
    rollouts_part: str = ""
    """a file of this step's records alone, read in place of --rollouts (the post-mortem splits the input once, so
    each step reads its own records, not the whole input again; set by the post-mortem, not a flag)."""
    typed_flags: list[str] = field(default_factory=list)
    """the flags the user typed among those a rollout file records (recorded.RECORDED_FLAGS: the engine's dtype and FP8
    arguments, the log-prob kind, the sampling): with --rollouts they fill what the file did not record, and must
    agree with what it did (set by the command line, not a flag)."""
    recorded_notes: list[str] = field(default_factory=list)
    """--rollouts: what the file did not record, and what was assumed for it (set by the reader, not a flag)."""
    routing: bool = True
    """mixture-of-experts models: capture the experts the engine chose as it decoded, compare every recipe's choice
    with them, and split the first trainer recipe's β into β_route and the rest (one more forward; routing/routes.py).
    Needs --engine local; dense models ignore it."""

    def __post_init__(self):
        if isinstance(self.trainer, str):
            self.trainer = [t.strip() for t in self.trainer.split(",") if t.strip()]
        if isinstance(self.framework, str):
            self.framework = [t.strip() for t in self.framework.split(",") if t.strip()]
        if self.framework == ["all"]:  # the spelling of the default
            self.framework = list(FRAMEWORKS)
        self.epsilon, self.epsilon_high = clip_range(self.epsilon, self.epsilon_high)

    def validate(self) -> None:
        """Refuse a setting that cannot run, with a one-line message naming the flag, before anything loads."""
        check_field_types(self)
        if not self.trainer:
            raise ConfigError("--trainer is empty: give one or more of " + ", ".join(RECIPES))
        for name in self.trainer:
            get_recipe(name)
        check_frameworks(self.framework)
        try:
            parse_dtype(self.engine_dtype)
        except ValueError as e:
            raise ConfigError(f"--engine-dtype: {e}") from None
        try:
            recipe = self.engine_recipe()
        except RecipeError as e:
            raise ConfigError(f"--engine-quant: {e}") from None
        # vLLM's FP8: fp8_vllm.vllm_refusal; --drift loads the weights again into the running engine
        refusal = cannot_run(self.engine, recipe, weight_sync=bool(self.drift)) if recipe.quant else None
        if refusal:
            raise ConfigError(f"--engine-quant {self.engine_quant}: {refusal}")
        check_knobs(self, KNOB_FIELDS)
        self._check_setup()
        if self.answer_in not in ANSWER_FRAMEWORKS:
            raise ConfigError(f"--answer-in {self.answer_in!r}: use trl, verl, or leave it empty for phantomclip's "
                              "own flags")
        # --rollouts: 0 reads every record; --n 10^9 built its prompt list for ever
        check_number("--n", self.n, 0 if self.rollouts else 1, BATCH_ROWS_LIMIT, integer=True)
        check_number("--batch-size", self.batch_size, 1, BATCH_ROWS_LIMIT, integer=True)
        self._check_recorded()
        check_number("--max-tokens", self.max_tokens, 1, LENGTH_LIMIT, integer=True)
        check_number("--knob-length", self.knob_length, 0, LENGTH_LIMIT, integer=True)
        if self.drift is not None:  # pushing zero times measures nothing: refused, not silently skipped
            check_number("--drift", self.drift, 1, integer=True)
        check_number("--max-model-len", self.max_model_len, 0, integer=True)
        check_share(self.vllm_memory_share)
        check_seed("--seed", self.seed)
        check_number("--temperature", self.temperature, 0, low_open=True)
        check_number("--keep-share", self.keep_share, 0, 1, low_open=True, high_open=True)
        if self.engine not in ENGINE_KINDS:
            raise ConfigError(f"--engine {self.engine!r}: use one of {', '.join(ENGINE_KINDS)}")
        from ..engines.vllm import (  # vLLM itself is not imported
            check_logprobs_mode,
            check_sampling,
            require_vllm,
        )

        check_logprobs_mode(self.logprobs_mode)  # for the local engine too: a typo is refused, not ignored
        try:
            self.sampling(0)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        resolve_device(self.device)  # a device this machine lacks: one line before anything loads
        try:
            resolve_matmul(self.matmul)
        except ValueError as e:
            raise ConfigError(f"--matmul: {e}") from None
        if self.engine == "vllm":
            check_sampling(self.sampling(0), self.logprobs_mode)  # before anything loads
            require_vllm()

    def _check_setup(self) -> None:
        """--setup names a trainer answer/setups.py knows, and --is-mode a correction that trainer's framework
        offers."""
        try:
            setup = get_setup(self.setup)
        except ValueError as e:
            raise ConfigError(f"--setup: {e}") from None
        try:
            resolve_mode(setup, self.is_mode)
        except ValueError as e:
            raise ConfigError(f"--is-mode: {e}") from None

    def _check_recorded(self) -> None:
        """--rollouts measures tokens already sampled: the settings of sampling have nothing to act on, and the
        settings of recorded rollouts nothing without them. --save-rollouts is refused before sampling where it
        cannot be written, as --json is."""
        if self.save_rollouts:
            check_output_path(self.save_rollouts, "--save-rollouts")
        if not self.rollouts:
            if self.rollouts_step is not None or self.checkpoints:
                flag = "--checkpoints" if self.checkpoints else "--rollouts-step"
                raise ConfigError(f"{flag} measures recorded rollouts: give --rollouts FILE_OR_DIR too")
            return
        for flag, given in (("--engine vllm", self.engine != "local"), ("--drift", self.drift is not None),
                            ("--save-rollouts", bool(self.save_rollouts)), ("--prompts", self.prompts is not None)):
            if given:
                raise ConfigError(f"{flag} with --rollouts: the tokens were sampled by the engine the file names; "
                                  f"drop {flag.split()[0]} (docs/rollouts.md)")

    def engine_recipe(self) -> Recipe:
        """The recipe the engine samples in: --engine-dtype's plain recipe with --engine-quant's FP8 quantisers."""
        return with_quant(engine_recipe(parse_dtype(self.engine_dtype)), engine_quants(self.engine_quant))

    def knob_settings(self) -> KnobSettings:
        """The user's current setting of every correction knob (diagnose/knobs.py)."""
        return KnobSettings(eps_low=self.epsilon, eps_high=self.epsilon_high, token_cap=self.token_cap,
                            seq_mask_cap=self.seq_mask_cap, icepop_low=self.icepop_low,
                            icepop_high=self.icepop_high)

    def sampling(self, batch: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The engine's sampling settings for batch number `batch` (each batch has its own seed)."""
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed + batch, stop_token_ids=stop_token_ids,
        )
