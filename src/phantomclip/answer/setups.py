"""Which ratio each trainer clips, and where β enters its loss: one table of trainer setups, each read from its
framework's own source (the file is cited with each entry), so that the answer judges the ratio the user's trainer
really clips.

β = logp_trainer − logp_engine at equal weights meets a GRPO/PPO loss in one of three ways:
  clip    the clipped ratio is taken against the engine's log-probs (asynchronous trainers, verl's bypass mode,
          slime's --use-rollout-logprobs): a token whose |β| crosses the trust region has its gradient zeroed when
          its advantage has the matching sign, although the policy never moved (phantom clipping);
  weight  the clipped ratio is taken against the trainer's own recomputed log-probs, so β is not in it, and the
          engine's samples are reweighted by exp(β) (per token) or exp(Σβ) (per sequence), truncated at a cap C or
          masked past it (TRL GRPOTrainer's vLLM correction, verl's rollout_is, slime's --use-tis, NeMo-RL's TIS):
          β then removes (mask) or caps (truncate) the gradient of the tokens past the cap;
  none    the trainer clips against itself and corrects nothing: β is in no ratio, and the engine's samples are
          used as if the trainer had drawn them (an off-policy update nothing bounds).
A setup names which of these its trainer does and which correction modes its framework offers (loss.CORRECTIONS'
names; the definitions live there, once). An unnamed setup is judged as `clip`, where β does the most harm.

phantomclip's fix for TRL's async trainer (integrations.trl_async.with_async_shadow_ratio) turns `clip` into
`weight` with the trust region kept: its default ratio clips on the policy's own move since the sample's version in
the trainer's precision and reweighs by the capped π_trainer(θ_v)/μ (β alone). Its opt-in ratio "decoupled"
(decoupled PPO as AReaL and verl write it) is `weight` without a trust region there: with one optimizer step per
sample its clip on π_θ/π_prox never fires, and staleness and β together ride in the capped weight.
"""

from __future__ import annotations

from dataclasses import dataclass

IN_CLIP, IN_WEIGHT, IN_NEITHER = "clip", "weight", "none"
"""where β meets the loss (module docstring): in the clipped ratio, in an importance-sampling weight, nowhere."""
OFF = "none"
"""the correction mode 'off' (loss.CORRECTIONS' 'none')."""
TOKEN_CORRECTIONS = ("token_truncate", "token_mask", "icepop")
SEQUENCE_CORRECTIONS = ("sequence_truncate", "sequence_mask")
"""the corrections by the unit they weigh: a token, or a whole sequence (loss.CORRECTIONS)."""
TRUNCATING = ("token_truncate", "sequence_truncate")
"""the corrections that cap a weight at C (the gradient is kept, scaled down); the others mask (gradient removed)."""


@dataclass(frozen=True)
class Setup:
    """One trainer as its framework runs it: which ratio its clip sees and where β enters."""

    name: str
    label: str
    """how the answer names it ('TRL GRPOTrainer')."""
    framework: str
    """the framework whose settings it reads and whose fields the answer writes ('' for none it can)."""
    clip_sees_engine: bool
    """True: the clipped ratio is against the engine's log-probs (β in the clip); False: against the trainer's own."""
    modes: tuple[str, ...]
    """the importance-sampling corrections the framework offers for this trainer (loss.CORRECTIONS names)."""
    default_mode: str
    """the correction it runs when the config says nothing ('none': off)."""
    default_cap: float | None
    """its correction's default cap C."""
    source: str
    """where the behaviour was read: the file, and what in it."""

    def where(self, mode: str) -> str:
        """Where β meets the loss under correction `mode`: IN_CLIP, IN_WEIGHT or IN_NEITHER."""
        if self.clip_sees_engine:
            return IN_CLIP
        return IN_NEITHER if mode == OFF else IN_WEIGHT


TRL_SOURCE = "trl 1.16 trl/trainer/grpo_trainer.py"
VERL_SOURCE = "volcengine/verl b178a3cd56f5 (2026-01-29)"
SETUPS: dict[str, Setup] = {s.name: s for s in [
    Setup(name="trl-grpo", label="TRL GRPOTrainer", framework="trl", clip_sees_engine=False,
          modes=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"), default_mode="sequence_mask",
          default_cap=3.0,
          source=f"{TRL_SOURCE}: _generate_and_score_completions recomputes old_per_token_logps with the trainer when "
          "vLLM samples and sets vllm_importance_sampling_ratio = exp(old_per_token_logps − sampling_per_token_logps) "
          "(summed over the sequence in the sequence_* modes), clamped to vllm_importance_sampling_clip_max "
          "(*_truncate) or zeroed past it (*_mask); _compute_loss clips exp(per_token_logps − old_per_token_logps) "
          "and multiplies the loss by that ratio"),
    Setup(name="trl-async", label="TRL AsyncGRPOTrainer", framework="trl", clip_sees_engine=True, modes=(),
          default_mode=OFF, default_cap=None,
          source="trl 1.16 trl/experimental/async_grpo/async_grpo_trainer.py: _compute_loss clips exp(log_probs − "
          "old_log_probs), old_log_probs being the log-probs vLLM returned with the sample; no correction"),
    Setup(name="verl-decoupled", label="verl, bypass_mode false", framework="verl", clip_sees_engine=False,
          modes=("token_truncate", "sequence_truncate", "icepop"), default_mode=OFF, default_cap=2.0,
          source=f"{VERL_SOURCE} verl/trainer/ppo/ray_trainer.py: the actor recomputes old_log_prob unless "
          "bypass_mode; verl/trainer/ppo/rollout_corr_helper.py compute_rollout_correction_and_rejection_mask: "
          "log_ratio = old_log_prob − rollout_log_prob, weights exp(log_ratio) (rollout_is: token) or exp(Σ "
          "log_ratio) (sequence) clamped at rollout_is_threshold; rollout_rs token_k1 masks tokens outside its band "
          "(icepop)"),
    Setup(name="verl-bypass", label="verl, bypass_mode true", framework="verl", clip_sees_engine=True,
          modes=("icepop",), default_mode=OFF, default_cap=None,
          source=f"{VERL_SOURCE} verl/trainer/ppo/core_algos.py compute_policy_loss_bypass_mode: old_log_prob is "
          "rollout_log_prob, and loss_type ppo_clip clips π/π_rollout with no IS weight (its rejection mask, "
          "rollout_rs, still applies)"),
    Setup(name="slime", label="slime", framework="", clip_sees_engine=False, modes=("token_truncate",),
          default_mode=OFF, default_cap=2.0,
          source="THUDM/slime 624b824a8 slime/backends/megatron_utils/loss.py: old_log_probs are the trainer's own "
          "log_probs unless --use-rollout-logprobs; --use-tis weights by clamp(exp(old − rollout), --tis-clip-low, "
          "--tis-clip) (vanilla_tis_function; --tis-clip 2)"),
    Setup(name="slime-rollout-logprobs", label="slime --use-rollout-logprobs", framework="", clip_sees_engine=True,
          modes=(), default_mode=OFF, default_cap=None,
          source="THUDM/slime 624b824a8 slime/backends/megatron_utils/loss.py: with --use-rollout-logprobs the PPO "
          "ratio is taken against batch['rollout_log_probs'] (slime/utils/arguments.py refuses it with --use-tis)"),
    Setup(name="nemo-rl", label="NeMo-RL", framework="", clip_sees_engine=False, modes=("token_truncate", "icepop"),
          default_mode=OFF, default_cap=None,
          source="NVIDIA-NeMo/RL 7ea279abf nemo_rl/algorithms/loss/loss_functions.py ClippedPGLossFn: the ratio is "
          "against prev_logprobs (recomputed by the policy); use_importance_sampling_correction weights by exp(prev "
          "− generation), truncated (truncated_importance_sampling_type tis) or masked (icepop)"),
    Setup(name="phantomclip", label="phantomclip train", framework="", clip_sees_engine=True,
          modes=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop"), default_mode=OFF,
          default_cap=3.0,
          source="src/phantomclip/training/trainer.py: log r = logp − logp_old with logp_old = logp_engine "
          "(asynchronous GRPO) unless --intervention recompute-old; --correction adds a weight on top"),
]}
"""every trainer setup the answer can judge for, by --setup name."""
UNNAMED = Setup(name="", label="an unnamed trainer", framework="", clip_sees_engine=True,
                modes=SETUPS["phantomclip"].modes, default_mode=OFF, default_cap=None,
                source="no setup named: judged where β does the most harm, inside the clip")
"""the setup judged when none is named (--setup empty): β in the clip, the worst case."""


def get_setup(name: str) -> Setup:
    """The setup named `name`, UNNAMED for ''; ValueError listing the names for another."""
    if not name:
        return UNNAMED
    if name not in SETUPS:
        raise ValueError(f"unknown trainer setup {name!r}: use one of {', '.join(SETUPS)}")
    return SETUPS[name]


def resolve_mode(setup: Setup, mode: str) -> str:
    """The correction the setup runs: `mode` as given, or the setup's default for ''. ValueError for a mode the
    setup's framework does not offer (naming those it does)."""
    mode = mode or setup.default_mode
    if mode != OFF and mode not in setup.modes:
        offered = ", ".join((OFF, *setup.modes))
        raise ValueError(f"{setup.label or 'this setup'} has no correction {mode!r}: use one of {offered}")
    return mode
