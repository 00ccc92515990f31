"""phantomclip inside slime (integrations/slime.py): the TIS hook on tensors shaped as slime's policy_loss_function
passes them (THUDM/slime 624b824a, slime/backends/megatron_utils/loss.py), and the rollout log hook.

slime is not on PyPI (the PyPI "slime" is another project), so its TIS function is restated below from its source
(`vanilla_tis_function`, `icepop_function`) as the delegate; what is tested is that the hook returns the
delegate's loss and masks untouched and adds figures that match a second computation. Tolerances: β is the same
fp32 subtraction on both sides (compared exactly); per-sample means in float64 agree to summation order (1e-12).
"""

from __future__ import annotations

import json
import math
from argparse import Namespace
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import pytest
import torch

from phantomclip.base.errors import IntegrationError, PhantomclipError
from phantomclip.integrations.slime import DELEGATE_ENV, log_rollout, rollout_figures, tis_function
from phantomclip.maths.frameworks import slime as slime_figures

ARGS = Namespace(eps_clip=0.2, eps_clip_high=0.28, tis_clip=2.0, tis_clip_low=0.0)


def vanilla_tis_reference(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's vanilla_tis_function restated: w = clamp(exp(train − rollout), tis_clip_low, tis_clip); loss · w."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))  # [ΣT]
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)  # [ΣT]
    return pg_loss * weights, loss_masks, {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float()}


def icepop_reference(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """An RS-style delegate (slime's icepop_function zeroes weights outside [tis_clip_low, tis_clip]); here it also
    drops those tokens from the masks, as a rejection function returns `modified_response_masks`."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))  # [ΣT]
    keep = (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip)  # [ΣT]
    masks, start = [], 0
    for m in loss_masks:
        masks.append(m * keep[start:start + m.numel()].to(m.dtype))
        start += m.numel()
    return pg_loss * torch.where(keep, ratio, torch.zeros_like(ratio)), masks, {"tis": ratio.detach()}


def _slime_batch(seed: int = 0, lengths=(5, 3, 7)):
    """One micro-batch as slime passes it: per-sample 1-D log-probs and loss masks, pg_loss concatenated."""
    g = torch.Generator().manual_seed(seed)
    train = [-torch.rand(n, generator=g) * 3 for n in lengths]  # the actor's recompute at θ_old
    rollout = [t - 0.3 * torch.randn(n, generator=g) for t, n in zip(train, lengths)]  # the engine's
    masks = [torch.ones(n) for n in lengths]
    masks[1][-1] = 0  # a masked token (a tool result, say)
    pg_loss = torch.randn(sum(lengths), generator=g)
    return train, rollout, masks, pg_loss


def _sample_mean(values: torch.Tensor, masks: list[torch.Tensor]) -> float:
    """slime's default reducer for a metric: the masked mean per sample, averaged over samples (cp_utils.py
    get_sum_of_sample_mean summed, divided by the sample count in train_metric_utils.py)."""
    out, start = [], 0
    for m in masks:
        out.append((values[start:start + m.numel()].double() * m).sum() / m.sum())
        start += m.numel()
    return torch.stack(out).mean().item()


def test_tis_hook_returns_the_delegates_loss_and_masks(monkeypatch):
    monkeypatch.setenv(DELEGATE_ENV, f"{__name__}.vanilla_tis_reference")
    train, rollout, masks, pg = _slime_batch()
    kw = dict(train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks, total_lengths=[9, 6, 11],
              response_lengths=[5, 3, 7], parallel_state=None, max_seq_lens=None)  # the last two: miles passes them
    pg_a, pg_b = pg.clone().requires_grad_(True), pg.clone().requires_grad_(True)
    ref_loss, ref_masks, ref_metrics = vanilla_tis_reference(ARGS, pg_loss=pg_a, **kw)
    loss, out_masks, metrics = tis_function(ARGS, pg_loss=pg_b, **kw)
    assert torch.equal(loss, ref_loss) and out_masks is masks
    ref_loss.sum().backward()
    loss.sum().backward()
    assert torch.equal(pg_a.grad, pg_b.grad)  # the gradient, bit for bit
    assert torch.equal(metrics["tis"], ref_metrics["tis"])  # the delegate's own metrics pass through
    beta = torch.cat(train) - torch.cat(rollout)
    assert torch.equal(metrics["phantomclip/beta"], beta)
    assert all(v.shape == pg.shape for k, v in metrics.items())  # per token, as slime's reducer expects
    # slime's per-sample reduction of |β| is its own train_rollout_logprob_abs_diff (a second implementation)
    padded = torch.nn.utils.rnn.pad_sequence
    want = slime_figures(padded(train, batch_first=True), padded(rollout, batch_first=True),
                         padded(masks, batch_first=True))["train_rollout_logprob_abs_diff"]
    assert _sample_mean(metrics["phantomclip/beta_abs"], masks) == pytest.approx(want, rel=1e-12)


def test_trust_region_and_rejection_by_hand(monkeypatch):
    # β = [0.3, −0.3, 0.1, 1.0] with ε 0.2 / 0.28: log 1.28 = 0.247, log 0.8 = −0.223: outside = [1, 1, 0, 1].
    # The IcePop-style delegate keeps exp(β) in [0, 2]: e^1.0 = 2.72 > 2 drops the last token: rs_removed [0, 0, 0, 1].
    monkeypatch.setenv(DELEGATE_ENV, f"{__name__}.icepop_reference")
    train = [torch.tensor([0.3, -0.3]), torch.tensor([0.1, 1.0])]
    rollout = [torch.zeros(2), torch.zeros(2)]
    masks = [torch.ones(2), torch.ones(2)]
    _, out_masks, metrics = tis_function(ARGS, pg_loss=torch.ones(4), train_log_probs=train,
                                         rollout_log_probs=rollout, loss_masks=masks)
    assert metrics["phantomclip/beta_outside_trust_region"].tolist() == [1, 1, 0, 1]
    assert metrics["phantomclip/rs_removed"].tolist() == [0, 0, 0, 1]
    assert out_masks[1].tolist() == [1, 0]


def test_bad_delegate_is_one_line(monkeypatch):
    monkeypatch.setenv(DELEGATE_ENV, "no_such_module.tis")
    with pytest.raises(IntegrationError, match="could not be imported") as e:
        tis_function(ARGS, pg_loss=torch.ones(1), train_log_probs=[torch.zeros(1)], rollout_log_probs=[torch.zeros(1)],
                     loss_masks=[torch.ones(1)])
    assert "\n" not in str(e.value)
    monkeypatch.setenv(DELEGATE_ENV, "phantomclip.integrations.slime.tis_function")
    with pytest.raises(IntegrationError, match="phantomclip's own"):
        tis_function(ARGS, pg_loss=torch.ones(1), train_log_probs=[torch.zeros(1)], rollout_log_probs=[torch.zeros(1)],
                     loss_masks=[torch.ones(1)])


def test_rollout_figures_by_hand():
    # engine probabilities 0.5, 0.05, 0.9 (masked out), 0.02: tokens 3, low-p share 2/3,
    # mean log-prob (ln 0.5 + ln 0.05 + ln 0.02) / 3; one sample without log-probs.
    samples = [SimpleNamespace(rollout_log_probs=[math.log(0.5), math.log(0.05), math.log(0.9)], loss_mask=[1, 1, 0]),
               SimpleNamespace(rollout_log_probs=[math.log(0.02)], loss_mask=None),
               SimpleNamespace(rollout_log_probs=None, loss_mask=[1])]
    out = rollout_figures(samples)
    assert out["phantomclip/rollout/tokens"] == 3 and out["phantomclip/rollout/samples_without_logprobs"] == 1
    assert out["phantomclip/rollout/lowp_share"] == pytest.approx(2 / 3, rel=1e-15)
    want = (math.log(0.5) + math.log(0.05) + math.log(0.02)) / 3
    assert out["phantomclip/rollout/logp_engine_mean"] == pytest.approx(want, rel=1e-15)
    extra = {"rollout/custom": 1.0}
    assert log_rollout(0, ARGS, samples, extra, 1.0) is False  # slime's own logging still runs
    assert extra["phantomclip/rollout/tokens"] == 3 and extra["rollout/custom"] == 1.0
    with pytest.raises(IntegrationError, match="same response tokens"):
        rollout_figures([SimpleNamespace(rollout_log_probs=[0.0, 0.0], loss_mask=[1])])


@pytest.mark.parametrize("name", ["slime", "miles"])
def test_rollout_log_without_metrics_dict_uses_the_frameworks_logger(monkeypatch, name):
    """RolloutFnTrainOutput.metrics defaults to None: the figures then go through the framework's own logger at its
    own rollout step. Neither slime nor miles is installed here, so their modules are stood in at the names the hook
    imports (slime: observability/logging_utils.py `log(args, metrics, step_key)`, observability/metric_utils.py
    `compute_rollout_step(args, rollout_id)`; miles: utils/tracking_utils/tracking.py, utils/metric_utils.py)."""
    import importlib.machinery
    import sys
    import types

    from phantomclip.integrations.slime import LOGGERS, framework

    logged = []
    probe = {"slime": "slime.backends.megatron_utils", "miles": "miles.backends.training_utils"}[name]
    log_module, step_module = LOGGERS[name]
    names = {probe, log_module, step_module}
    for full in sorted(names):  # every parent package too, each with a spec as an imported module has
        parts = full.split(".")
        names |= {".".join(parts[:i]) for i in range(1, len(parts))}
    for full in sorted(names):
        module = types.ModuleType(full)
        module.__spec__ = importlib.machinery.ModuleSpec(full, None, is_package=True)
        module.__path__ = []
        monkeypatch.setitem(sys.modules, full, module)
    sys.modules[log_module].log = lambda args, metrics, step_key: logged.append((metrics, step_key))
    sys.modules[step_module].compute_rollout_step = lambda args, rollout_id: 10 * rollout_id
    assert framework() == name
    samples = [SimpleNamespace(rollout_log_probs=[math.log(0.5)], loss_mask=[1])]
    assert log_rollout(3, ARGS, samples, None, 1.0) is False
    (metrics, key), = logged
    assert key == "rollout/step" and metrics["rollout/step"] == 30 and metrics["phantomclip/rollout/tokens"] == 1


def test_neither_framework_installed_is_one_line(monkeypatch):
    monkeypatch.delenv(DELEGATE_ENV, raising=False)
    with pytest.raises(IntegrationError, match="neither slime nor miles") as e:
        tis_function(ARGS, pg_loss=torch.ones(1), train_log_probs=[torch.zeros(1)], rollout_log_probs=[torch.zeros(1)],
                     loss_masks=[torch.ones(1)])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------- the rollout file (ROLLOUTS_ENV)


@dataclass
class Sample:
    """slime's Sample (slime/utils/types.py @624b824) restated with the fields the record reads, and its `to_dict`
    (`self.__dict__.copy()` with the status as its value)."""

    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    reward: float | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    status: str = "pending"

    def to_dict(self):
        return self.__dict__.copy()


SLIME_ARGS = Namespace(**vars(ARGS), hf_checkpoint="Qwen/Qwen3-0.6B", rollout_temperature=0.8, rollout_top_p=1.0,
                       rollout_top_k=-1, sglang_dtype="bfloat16", sglang_quantization=None,
                       sglang_kv_cache_dtype="auto", custom_rollout_log_function_path=f"{log_rollout.__module__}."
                       "log_rollout")


def _rollout_samples() -> list[Sample]:
    """Four samples of one rollout: two plain, one multi-turn (a tool token: loss mask 0, log-prob 0.0 as slime's
    add_response_tokens pads it), one with a positive log-prob (no probability: refused), one without log-probs."""
    return [Sample(tokens=[1, 2, 3, 4, 5], response_length=2, reward=1.0, loss_mask=[1, 1], weight_versions=["3"],
                   rollout_log_probs=[-0.5, -1.25], status="completed"),
            Sample(tokens=[1, 2, 3, 6, 7, 8], response_length=3, reward=0.0, loss_mask=[1, 0, 1],
                   weight_versions=["default", "3"], rollout_log_probs=[-2.0, 0.0, -0.125], status="truncated"),
            Sample(tokens=[1, 2, 9, 9], response_length=2, loss_mask=[1, 1], rollout_log_probs=[-0.5, 0.25]),
            Sample(tokens=[1, 2, 9], response_length=1, loss_mask=[1], rollout_log_probs=None)]


def test_log_rollout_writes_the_rollout_record(monkeypatch, tmp_path):
    from phantomclip.integrations.slime import ROLLOUTS_ENV
    from phantomclip.rollouts.readers import read_rollouts
    from phantomclip.rollouts.record import Record

    out = tmp_path / "rollouts"
    monkeypatch.setenv(ROLLOUTS_ENV, str(out))
    extra = {}
    # as slime/observability/rollout_metrics.py log_rollout_data calls the custom function, rollout 7
    assert log_rollout(7, SLIME_ARGS, _rollout_samples(), extra, 12.5) is False
    assert extra["phantomclip/rollout/samples_not_recorded"] == 1  # the positive log-prob
    assert extra["phantomclip/rollout/samples_without_logprobs"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["step-000007.jsonl"]  # no temp file left
    # the same reader diagnose --rollouts (and its post-mortem) uses for TRL's RolloutRecorder directory
    header, located = read_rollouts(str(out))
    records = [item.record for item in located]
    assert (header.source, header.model, header.logprobs) == ("slime (phantomclip log_rollout)", "Qwen/Qwen3-0.6B",
                                                              "tempered")
    assert (header.engine.name, header.engine.dtype, header.engine.kv_cache_dtype) == ("sglang", "bfloat16", "")
    assert (header.sampling.temperature, header.sampling.top_p, header.sampling.top_k) == (0.8, 1.0, 0)  # -1: off
    first, second = records
    assert (first.prompt_ids, first.completion_ids, first.logp_engine) == ([1, 2, 3], [4, 5], [-0.5, -1.25])
    assert (first.step, first.weight_version, first.finished, first.advantage) == (7, 3, True, None)
    assert (second.prompt_ids, second.completion_ids, second.loss_mask) == ([1, 2, 3], [6, 7, 8], [1, 0, 1])
    assert (second.weight_version, second.finished) == (3, False)  # 'default' names no version: the last number
    line = json.loads((out / "step-000007.jsonl").read_text().splitlines()[1])
    assert set(line) <= {f.name for f in fields(Record)}  # TRL's record's field names, nothing of its own
    # the TIS hook, as policy_loss_function calls it (keywords, args included), writes nothing
    monkeypatch.setenv(DELEGATE_ENV, f"{__name__}.vanilla_tis_reference")
    train, rollout, masks, pg = _slime_batch()
    tis_function(args=SLIME_ARGS, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                 total_lengths=[9, 6, 11], response_lengths=[5, 3, 7])
    assert sorted(p.name for p in out.iterdir()) == ["step-000007.jsonl"]


@pytest.mark.parametrize("case", ["out is a file", "quantization"])
def test_rollout_record_bad_settings_one_line(monkeypatch, tmp_path, case):
    from phantomclip.integrations.slime import ROLLOUTS_ENV

    (tmp_path / "file").write_text("")
    args = SLIME_ARGS
    if case == "out is a file":
        monkeypatch.setenv(ROLLOUTS_ENV, str(tmp_path / "file" / "rollouts"))
    else:
        monkeypatch.setenv(ROLLOUTS_ENV, str(tmp_path / "rollouts"))
        args = Namespace(**{**vars(SLIME_ARGS), "sglang_quantization": "awq"})
    with pytest.raises(PhantomclipError) as e:  # WriteError for the directory, IntegrationError for the engine
        log_rollout(0, args, _rollout_samples(), {}, 1.0)
    assert "\n" not in str(e.value)
    assert ("rollouts" in str(e.value)) if case == "out is a file" else ("quantization 'awq'" in str(e.value))
