"""`phantomclip train`'s configuration: one dataclass, a docstring under every field (each is a flag), and its
validation, which refuses a setting that cannot run in one line before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

from ..base.devices import resolve_device
from ..base.errors import (
    BATCH_ROWS_LIMIT,
    DRAWS_LIMIT,
    GROUP_LIMIT,
    LENGTH_LIMIT,
    STEPS_LIMIT,
    check_field_types,
    check_number,
    check_seed,
)
from ..engines import ENGINE_KINDS, cannot_run
from ..engines.vllm_memory import check_share
from ..maths.loss import AGGREGATIONS, KNOBS, check_knobs
from ..precision.recipes import RECIPES, get_recipe
from .interventions import TrainConfigError, resolve_plan

EXPERIMENT_LR = 3e-5
ADDED_SINCE_SCHEMA_1 = {"icepop_low": 0.5, "icepop_high": 2.0, "inputs": {}, "keep_snapshots": 0, "engine": "local",
                        "device": "auto", "vllm_memory_share": None, "engine_quant": "",
                        "plan": {"routes": "own"}}
"""config fields added after runs were first written: an older run resumes as if they had their defaults."""
KNOB_FIELDS = {"epsilon": "epsilon", "epsilon_high": "epsilon_high", "correction_cap": "cap",
               "icepop_low": "icepop_low", "icepop_high": "icepop_high"}
"""TrainConfig's fields that are loss.KNOBS: one default, range and help for every command."""
RESUME_MAY_CHANGE = ("steps", "versions", "schema", "checkpoint_every", "samples_per_step", "token_log_steps",
                     "keep_snapshots", "vllm_memory_share")
"""config keys a resumed run may change: none of them changes the numbers of the steps already taken."""


@dataclass
class TrainConfig:
    """One GRPO run. Every field is a `phantomclip train` flag (underscores become dashes)."""

    model: str = "smollm2-135m"
    """bundled 'smollm2-135m', 'tiny-random[:seed[:init_std]]', 'tiny-moe[:seed[:init_std]]' (a random 2-layer MoE:
    train --intervention r3 replays its routes), a model directory or a hub id."""
    task: str = "neglen"
    """reward task: neglen (reward = −length), target-length or add; ignored when --reward is given."""
    reward: str | None = None
    """a user reward 'module:function' taking (prompts, completions, completion_ids) -> list of floats."""
    trainer: str = "fp32"
    """trainer precision recipe (fp32, bf16, fp16, bf16-autocast, fp32-head) before interventions."""
    engine: str = "local"
    """the sampling engine: 'local' (the in-process engine) or 'vllm' (vLLM's offline engine, as in the reference
    analysis: started once per run, the weights synced into it in place before every batch; needs vLLM, see
    scripts/install_vllm_cpu.sh on a CPU)."""
    engine_dtype: str = "bf16"
    """engine dtype (bf16, fp16, fp32) before interventions."""
    engine_quant: str = ""
    """FP8 quantisers the engine runs with, comma-separated, on top of its dtype (after interventions): fp8-w8a8
    (vLLM quantization='fp8'), fp8-w8a8-channel, fp8-block, fp8-w8a16 (weight-only) and/or fp8-kv (kv_cache_dtype
    'fp8'); precision/fp8.py. The shadow runs the same recipe, and β_quant is logged apart. Empty: none."""
    vllm_memory_share: float | None = None
    """with --engine vllm on a GPU: the share of the GPU's memory vLLM may take (its gpu_memory_utilization); default:
    what is free once the trainer's memory (weights, AdamW, activations) is set aside, at most 0.9. A model that
    cannot fit both is refused, naming the memory needed and available (engines/vllm_memory.py). Ignored on the
    CPU."""
    intervention: str = "none"
    """comma-separated interventions (see `phantomclip train --list-interventions`), e.g. shadow-ratio or
    epsilon=0.3."""
    epsilon: float = KNOBS["epsilon"].default
    """PPO clip ε_low (this and the correction knobs below: one default and range in loss.KNOBS)."""
    epsilon_high: float | None = KNOBS["epsilon_high"].default
    """PPO clip ε_high (default: epsilon)."""
    steps: int = 40
    """optimizer steps (one batch each)."""
    prompts_per_step: int = 1
    """distinct prompts per batch."""
    group_size: int = 8
    """completions per prompt (GRPO group, at least 2)."""
    max_tokens: int = 32
    """max completion tokens."""
    temperature: float = 1.0
    """sampling temperature."""
    lr: float = EXPERIMENT_LR
    """AdamW learning rate. TRL's default 1e-6 barely moves the bundled model in a CPU budget of a few dozen
    steps; 3e-5 shows learning within them (docs/training.md: 'Why these defaults')."""
    max_grad_norm: float = 1.0
    """gradient norm clip."""
    loss_type: str = "dapo"
    """loss aggregation: grpo, dapo (token mean) or dr_grpo."""
    importance_level: str = "token"
    """PPO ratio per token, or per sequence (GSPO geometric mean)."""
    scale_rewards: bool = True
    """divide advantages by the group std (off = Dr. GRPO)."""
    staleness: int = 1
    """the engine samples with weights this many steps old (0 = on-policy)."""
    correction_cap: float = KNOBS["cap"].default
    """cap C of the truncate / mask rollout corrections (the tis, mis, seq-* interventions)."""
    icepop_low: float = KNOBS["icepop_low"].default
    """IcePop (`icepop` intervention): tokens whose π/μ is below this are masked."""
    icepop_high: float = KNOBS["icepop_high"].default
    """IcePop: tokens whose π/μ is above this are masked."""
    seed: int = 0
    """seeds prompt choice and sampling: a run is deterministic for a seed."""
    stop_after_converged: int = 0
    """stop once the task has counted as converged for this many consecutive steps (0: always run --steps)."""
    checkpoint_every: int = 10
    """write a checkpoint every this many steps (and at the end, and on Ctrl-C)."""
    samples_per_step: int = 2
    """completions per step written to samples.jsonl."""
    token_log_steps: int = 5
    """per-token α, β, advantage and clip flags are written to tokens.jsonl for this many first steps."""
    keep_snapshots: int = 0
    """keep the fp32 weights every this many steps (and at step 0) in OUT/snapshots/, with the tokens sampled with
    them, for `trace`'s analysis of how β grows (0: none; the bundled model's snapshot is about 540 MB)."""
    prompts: str | None = None
    """prompts file (one per line or JSONL 'prompt'); default: the task's or the 64 bundled prompts."""
    matmul: str = "auto"
    """low-precision matmul kernels: auto, native or emulated (docs/diagnose.md)."""
    device: str = "auto"
    """where the master weights, the optimizer, the local engine, the shadow and the step run: auto (the first CUDA
    device if torch sees one, else the CPU), cpu, cuda or cuda:N (devices.resolve_device)."""

    def validate(self) -> None:
        """Refuse a setting that cannot run, with one line naming the flag (errors.check_number's rules, shared by
        every command), before anything loads."""
        check_field_types(self, TrainConfigError)
        # a GRPO group needs 2 completions of a prompt to compare (a group of one has no advantage)
        check_number("--steps", self.steps, 1, STEPS_LIMIT, integer=True, error=TrainConfigError)
        check_number("--max-tokens", self.max_tokens, 1, LENGTH_LIMIT, integer=True, error=TrainConfigError)
        whole = [("--prompts-per-step", self.prompts_per_step, 1), ("--group-size", self.group_size, 2),
                 ("--staleness", self.staleness, 0), ("--checkpoint-every", self.checkpoint_every, 1),
                 ("--stop-after-converged", self.stop_after_converged, 0),
                 ("--samples-per-step", self.samples_per_step, 0), ("--token-log-steps", self.token_log_steps, 0),
                 ("--keep-snapshots", self.keep_snapshots, 0)]
        for flag, value, low in whole:
            check_number(flag, value, low, integer=True, error=TrainConfigError)
        self._check_sizes()
        check_seed("--seed", self.seed, error=TrainConfigError)
        check_share(self.vllm_memory_share, TrainConfigError)
        # an lr above 1 is no AdamW step size: it diverges in one step (NaN from step 2)
        check_number("--lr", self.lr, 0, 1, low_open=True, error=TrainConfigError)
        check_number("--temperature", self.temperature, 0, low_open=True, error=TrainConfigError)
        check_number("--max-grad-norm", self.max_grad_norm, 0, low_open=True, error=TrainConfigError)
        check_knobs(self, KNOB_FIELDS, TrainConfigError)
        checks = [
            (self.loss_type in AGGREGATIONS,
             f"unknown --loss-type {self.loss_type!r}: use one of {', '.join(AGGREGATIONS)}"),
            (self.importance_level in ("token", "sequence"),
             f"unknown --importance-level {self.importance_level!r}: use token or sequence"),
            (self.trainer in RECIPES, f"unknown --trainer {self.trainer!r}: use one of {', '.join(RECIPES)}"),
            (self.engine in ENGINE_KINDS, f"unknown --engine {self.engine!r}: use one of {', '.join(ENGINE_KINDS)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise TrainConfigError(message)
        resolve_device(self.device)  # a device this machine lacks: one line before anything loads
        refused = engine_refuses(self)  # before vLLM's minutes of start-up
        if refused:
            raise TrainConfigError(refused)


    def _check_sizes(self) -> None:
        """The group, a step's rows and the run's prompt draws, bounded before anything is drawn or loaded (the
        memory a step needs is checked once the model is known: check_step_memory)."""
        check_number("--group-size", self.group_size, 2, GROUP_LIMIT, integer=True, error=TrainConfigError)
        rows, draws = self.prompts_per_step * self.group_size, self.steps * self.prompts_per_step
        for what, value, limit, say in (("rows", rows, BATCH_ROWS_LIMIT, "--prompts-per-step x --group-size"),
                                        ("prompt draws", draws, DRAWS_LIMIT, "--steps x --prompts-per-step")):
            if value > limit:
                raise TrainConfigError(f"{say} is {value:,} {what}, more than the {limit:,} a run may have: lower them")


def check_model_fits(cfg: TrainConfig, model, longest_prompt: int, device) -> None:
    """The checks that need the loaded model, made before the engine starts and before any file is written: r3
    needs a mixture-of-experts model (a dense one left the run's config.json and .lock behind, so the next
    `train --out DIR` was refused), and a step must fit (check_step_memory)."""
    if resolve_plan(cfg).routes == "engine":
        from ..routing.routes import require_moe

        require_moe(model, "--intervention r3")
    check_step_memory(cfg, model.config, longest_prompt, device)


def check_step_memory(cfg: TrainConfig, config, longest_prompt: int, device) -> None:
    """Refuse, once the model is loaded and before the engine starts, a step that cannot fit: a floor on what one
    step holds, the engine's KV cache for the step's rows (prompts x group, each (longest prompt + max tokens)
    positions x layers x 2 (keys and values) x KV heads x head dim x the engine dtype's bytes: what the engine
    allocates up front) plus the hidden states the trainer's backward keeps (one fp32 [positions, hidden] per layer).
    What a step really uses is several times that, so a step refused here could never run."""
    from ..base.devices import memory_limit

    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads, head_dim = getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None)
    head_dim = head_dim or hidden // heads
    rows, positions = cfg.prompts_per_step * cfg.group_size, longest_prompt + cfg.max_tokens
    engine_bytes = get_recipe(resolve_plan(cfg).engine_recipe).weight_dtype.itemsize
    floor = rows * positions * layers * (2 * kv_heads * head_dim * engine_bytes + hidden * 4)
    memory, where = memory_limit(device)
    if floor > memory:
        raise TrainConfigError(
            f"a step of {rows:,} rows ({cfg.prompts_per_step} prompts x --group-size {cfg.group_size}) of up to "
            f"{positions:,} positions needs at least {floor / 1e9:,.1f} GB (the engine's KV cache and the trainer's "
            f"hidden states), more than {where} ({memory / 1e9:,.1f} GB): lower --group-size, --prompts-per-step or "
            "--max-tokens")


def engine_refuses(cfg: TrainConfig) -> str | None:
    """Why cfg's engine cannot run its plan, or None: the plan's engine recipe (`engines.cannot_run`), or r3's routes,
    which only the local engine returns (`routing.no_engine_routes`). The one place `train` and `experiment` ask."""
    plan = resolve_plan(cfg)
    if cfg.engine != "local" and plan.routes == "engine":
        from ..routing.routes import no_engine_routes

        return no_engine_routes(cfg.engine, "--intervention r3")
    return cannot_run(cfg.engine, get_recipe(plan.engine_recipe), weight_sync=True)  # training syncs weights
