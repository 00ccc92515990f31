"""docs/trl.md's quick start runs as written: its Python block is executed with only the model and the budget swapped
(the tiny test model for the bundled one, 2 steps for 10), the monitor's figures come out in TRL's log, and every
step has a learning signal (rewards that differ within the group, a non-zero gradient)."""

import math
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "trl.md"


def quick_start() -> str:
    """The first ```python block under '## Quick start'."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_page_names_the_install_and_the_defaults():
    """... and a completion budget the bundled model can learn with (examples/trl_grpo.py says why: at 32 tokens
    nearly every completion hits the cap, every group's rewards tie and nothing learns)."""
    text = PAGE.read_text(encoding="utf-8")
    assert "max_completion_length=64" in quick_start()
    assert "pip install torch==2.13.0 -e '.[trl]'" in text  # the extra that brings TRL
    assert "bf16=True" in text and "bf16-autocast" in text  # TRL's default, and what the monitor then reports


def test_the_quick_start_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl")
    from phantomclip.models.load import load_model

    model_dir = tmp_path / "tiny"
    lm = load_model("tiny-random:30")
    lm.model.save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    code = quick_start()
    swaps = {"model=bundled_path()": f"model={str(model_dir)!r}", "max_steps=10": "max_steps=2",
             "per_device_train_batch_size=8, num_generations=8, max_completion_length=64":
             "per_device_train_batch_size=4, num_generations=4, max_completion_length=8"}
    for old, new in swaps.items():
        assert old in code, old  # the page still says what the test swaps
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)  # output_dir="grpo-out" lands here
    scope: dict = {}
    exec(compile(code, str(PAGE), "exec"), scope)
    rows = [r for r in scope["trainer"].state.log_history if "precision/beta_abs_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["precision/beta_abs_mean"]) and r["precision/beta_abs_mean"] > 0 for r in rows)
    # a learning signal, not only the wiring: every step's group has rewards that differ (some completions of the
    # tiny model stop before its 8-token cap), so the advantages are not all 0 and the step moves the weights
    assert all(r["reward_std"] > 0 and r["frac_reward_zero_std"] < 1 and r["grad_norm"] > 0 for r in rows), rows
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed if line[:1].isdigit()] == ["1", "2"]  # the block's own print
