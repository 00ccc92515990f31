import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama with the byte tokenizer (init std 0.3: peaked enough to show a gap)."""
    from phantomclip.models import load_model

    return load_model("tiny-random:0")


@pytest.fixture(scope="session")
def tiny_prompts(tiny):
    from phantomclip.prompts import bundled_prompts, encode_prompts

    return encode_prompts(tiny.tokenizer, bundled_prompts()[:6])


def report(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """Max / mean absolute difference, for assertion messages."""
    d = (a.double() - b.double()).abs()
    return f"{name}: max |diff| {d.max().item():.3e}, mean |diff| {d.mean().item():.3e} over {d.numel()} values"


def offline(monkeypatch) -> None:
    """Offline mode as a user without network sets it (HF_HUB_OFFLINE is read once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def bad_cli(args: list[str], capsys, after_progress: bool = False) -> str:
    """Run the CLI on bad input: exit code 2, one line on stderr, no traceback. Returns the line.

    `after_progress`: errors found only once work has started (an engine refusing the model) may follow
    progress lines; the error must still be one line, the last."""
    from phantomclip.cli import main

    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    if after_progress:
        assert sum(line.startswith("phantomclip") for line in lines) == 1 and lines[-1].startswith("phantomclip"), err
        return lines[-1]
    assert len(lines) == 1, err
    return err
