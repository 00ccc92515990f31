"""The diagnose job's phases on hand-made records (the whole command runs in tests/test_cli.py and, against the
recorded numbers, tests/test_golden.py), and the runs/rundir.py helpers it takes its JSON rounding and progress bar
from."""

import dataclasses
import math

import pytest
import torch

from phantomclip.base.console import progress_bar
from phantomclip.base.files import rounded
from phantomclip.diagnose.job import (
    DiagnoseConfig,
    Sampled,
    Scored,
    measured_column,
    reference,
    run_diagnose,
)


def _sampled(measured, raw, processed):
    mask = torch.ones_like(raw, dtype=torch.bool)
    return Sampled(packed=[], mask=mask, logp_engine=raw, logp_engine_processed=processed, measured=measured,
                   nonfinite=0, info={}, seconds=1.0)


def _shadow(logp, log_kept):
    return Scored(logp=logp, entropy=torch.zeros_like(logp), log_kept=log_kept, seconds=0.0)


def test_measured_column():
    # vLLM computes the column its logprobs_mode names; the local engine reports both; without truncation S = 1
    assert measured_column({"kind": "vllm", "logprobs_mode": "processed"}, (0, 0.7, 0.0)) == "processed"
    assert measured_column({"kind": "vllm", "logprobs_mode": "raw"}, (20, 1.0, 0.0)) == "raw"
    assert measured_column({"kind": "vllm", "logprobs_mode": "raw"}, None) is None
    assert measured_column({"kind": "local"}, (0, 0.7, 0.0)) is None


def test_reference_rebuilds_the_column_the_engine_did_not_measure():
    """processed = full − log S, with the shadow's S: log S = [−0.5, −0.25], full = [−1, −2]."""
    full, log_kept = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -0.25]])
    nan = torch.full_like(full, math.nan)
    shadow = _shadow(torch.tensor([[-1.1, -2.1]]), log_kept)
    ref = reference(_sampled("raw", full, nan), shadow, "bf16")
    assert ref.logp_engine_processed.tolist() == [[-0.5, -1.75]] and ref.logp_engine is not None
    assert ref.rebuilt == "logp_engine_processed" and ref.shadow == "bf16" and ref.logp_shadow is shadow.logp
    ref = reference(_sampled("processed", nan, torch.tensor([[-0.5, -1.75]])), shadow, "bf16")
    assert ref.logp_engine.tolist() == [[-1.0, -2.0]] and ref.rebuilt == "logp_engine"
    # both measured: nothing rebuilt, a missing log-prob stays missing (NaN, left out of every figure)
    both = torch.tensor([[-1.0, math.nan]])
    ref = reference(_sampled(None, both, both - log_kept), shadow, "bf16")
    assert ref.rebuilt is None and ref.logp_engine is both and math.isnan(ref.logp_engine_processed[0, 1])


def test_every_config_field_has_a_docstring():
    """The CLI's help texts are the field docstrings (cli.flags.add_config_args)."""
    from phantomclip.cli.flags import field_docs

    docs = field_docs(DiagnoseConfig)
    assert [f.name for f in dataclasses.fields(DiagnoseConfig) if not docs.get(f.name)] == []


def test_epsilon_high_defaults_to_epsilon():
    assert DiagnoseConfig(epsilon=0.1).epsilon_high == 0.1
    assert DiagnoseConfig(epsilon=0.1, epsilon_high=0.28).epsilon_high == 0.28


def test_library_result_has_figures_and_no_verdict():
    """run_diagnose returns figures; the words are diagnose.text's (the CLI adds them to the JSON)."""
    from phantomclip.diagnose.text import with_verdict

    d = run_diagnose(DiagnoseConfig(model="tiny-random:0", trainer=["fp32"], n=2, max_tokens=3))
    assert "verdict" not in d and d["recipes"]["fp32"]["tokens"] == d["engine"]["tokens"] > 0
    assert with_verdict(d)["verdict"].startswith("Fewest tokens outside [0.8, 1.2] against the bf16 local engine: fp32")
    assert d["answer"]["contract"]["trainer"] == "fp32"  # the answer is added beside the verdict


def test_rounded():
    x = torch.tensor([1.23456789, -2.0, math.nan, math.inf, -math.inf])
    assert rounded(x) == [1.234568, -2.0, None, None, None]
    assert rounded(torch.tensor([0.123456789], dtype=torch.float64), 3) == [0.123]
    assert rounded(torch.zeros(0)) == []


def test_progress_bar_is_silent_without_a_console(capsys):
    with progress_bar(None, info=True) as bar:
        task = bar.add_task("x", total=2, info="")
        bar.advance(task)
        bar.update(task, advance=1, info="done")
    assert capsys.readouterr() == ("", "")


def test_progress_bar_draws_on_a_console():
    import io

    from rich.console import Console

    out = io.StringIO()
    with progress_bar(Console(file=out, force_terminal=True, width=80), transient=False, info=True) as bar:
        task = bar.add_task("scoring", total=2, info="")
        bar.advance(task, 2)
        bar.update(task, info="|β| 0.01")
    text = out.getvalue()
    assert "scoring" in text and "2/2" in text and "|β| 0.01" in text


def test_progress_is_lines_when_the_output_is_piped():
    """A console that is not a terminal (a pipe, a log file) gets a line when a task starts, one when it ends, and
    one at most every PIPED_EVERY_S seconds between (the clock here is a counter, 30 s a step): rich draws nothing
    there until the end, and a 27-minute run said nothing for 20."""
    import io

    from rich.console import Console

    from phantomclip.base.console import PIPED_EVERY_S, LineProgress

    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal and isinstance(progress_bar(console), LineProgress)
    now = [0.0]
    with LineProgress(console, clock=lambda: now[0]) as bar:
        task = bar.add_task("train", total=5, info="")  # at 0 s: said
        for step in range(5):  # steps end at 30, 60, ... 150 s: said once 60 s passed since the last line, and at 5/5
            now[0] += 30
            bar.update(task, advance=1, info=f"step {step + 1}")
    assert PIPED_EVERY_S == 60.0
    assert out.getvalue().splitlines() == ["train: 0/5, 0 s", "train: 2/5, 60 s; step 2", "train: 4/5, 120 s; step 4",
                                           "train: 5/5, 150 s; step 5"]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampled_records_what_the_local_engine_measured(mode):
    """The local engine computes both columns, whatever --logprobs-mode says (it is vLLM's setting)."""
    from phantomclip.diagnose.job import prepare, sample

    cfg = DiagnoseConfig(model="tiny-random:0", n=3, max_tokens=4, top_p=0.8, logprobs_mode=mode)
    prep = prepare(cfg, lambda *a, **k: None)
    with progress_bar(None) as bar:
        s = sample(cfg, prep, bar, lambda *a, **k: None)
    assert s.measured is None and s.nonfinite == 0 and s.mask.shape == s.logp_engine.shape  # [n, T]
    assert s.mask.shape[0] == 3 and bool(torch.isfinite(s.logp_engine_processed[s.mask]).all())
    # top-p renormalises: processed = full − log S >= full
    assert bool((s.logp_engine_processed[s.mask] >= s.logp_engine[s.mask] - 1e-6).all())
