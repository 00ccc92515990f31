"""`--device`: resolved once, refused in one line where the machine lacks it, and reaching every tensor a job makes.

No GPU here: the CUDA paths are checked statically (every allocation on a job's tensor path names its device, or is a
named host-side one) and by `cpu` given explicitly giving the same numbers as the default.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import phantomclip
from conftest import bad_cli
from phantomclip.base.devices import DeviceError, describe_device, resolve_device
from phantomclip.cli.main import main

NO_CUDA = not torch.cuda.is_available()


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu") == resolve_device(" CPU ")
    assert resolve_device("auto") == (torch.device("cuda", 0) if not NO_CUDA else torch.device("cpu"))
    with pytest.raises(DeviceError, match=r"--device 'mps': use auto, cpu, cuda or cuda:N"):
        resolve_device("mps")
    with pytest.raises(DeviceError, match=r"--device 'cuda:x': use auto, cpu, cuda or cuda:N"):
        resolve_device("cuda:x")
    assert describe_device("cpu") == {"device": "cpu", "name": "cpu", "capability": None, "torch": torch.__version__,
                                      "cuda": None}


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [
    ["diagnose", "--device", "cuda"], ["train", "--device", "cuda:1"], ["trace", "--device", "cuda"],
    ["engines", "--engines", "local", "--device", "cuda"], ["experiment", "sanity", "--device", "cuda"],
    ["diagnose", "--device", "mps"], ["train", "--device", "tpu"],
])
def test_a_device_this_machine_lacks_is_one_line_before_any_load(argv, capsys, monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad --device was refused")

    monkeypatch.setattr("phantomclip.models.load.check_vocab", loaded)
    line = bad_cli(argv, capsys)
    assert "--device" in line and ("no CUDA device" in line or "use auto, cpu, cuda or cuda:N" in line), line


TIMES = ("seconds", "_s", "tokens_per_s", "startup", "hook_overhead", "versions", "device", "cpu")


def _figures(x, path=""):
    """Every number of a result, times and machine records left out: what must not move with an explicit --device."""
    if isinstance(x, dict):
        # run/id is the run's config.json's hash, which holds the --device string itself
        return {k: _figures(v, f"{path}.{k}") for k, v in x.items() if not any(t in k for t in TIMES)
                and k != "run/id"}
    if isinstance(x, list):
        return [_figures(v, path) for v in x]
    return x


def test_explicit_cpu_gives_the_default_numbers(tmp_path, capsys):
    """On a machine without CUDA, `auto` is the CPU: diagnose, 2 train steps and trace give the same figures with
    `--device cpu` given (the setting reaches the model, the engine, scoring and the step without changing them)."""
    if not NO_CUDA:
        pytest.skip("auto is CUDA on this machine")
    runs = {}
    for device in ("auto", "cpu"):
        d, t, tr = (tmp_path / f"{name}-{device}" for name in ("d.json", "train", "t.json"))
        assert main(["diagnose", "--model", "tiny-random:0", "--n", "4", "--max-tokens", "6", "--trainer", "fp32,bf16",
                     "--device", device, "--json", str(d)]) == 0
        assert main(["train", "--model", "tiny-random:30", "--steps", "2", "--group-size", "2", "--max-tokens", "4",
                     "--device", device, "--out", str(t)]) == 0
        assert main(["trace", "--model", "tiny-random:0", "--n", "2", "--max-tokens", "4", "--device", device,
                     "--json", str(tr)]) == 0
        metrics = [json.loads(line) for line in (t / "metrics.jsonl").read_text().splitlines()]
        runs[device] = {"diagnose": json.loads(d.read_text()), "train": metrics, "trace": json.loads(tr.read_text())}
    capsys.readouterr()
    for job in ("diagnose", "train", "trace"):
        a, b = _figures(runs["auto"][job]), _figures(runs["cpu"][job])
        if job != "train":
            a.pop("config"), b.pop("config")  # the --device string itself
        assert a == b, job
    assert runs["cpu"]["diagnose"]["device"]["device"] == "cpu" and runs["cpu"]["trace"]["device"]["name"] == "cpu"


# ------------------------------------------------------------------------------ every allocation names its device

PACKAGE = Path(phantomclip.__file__).parent
ALLOCATORS = {"zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "tensor", "Generator",
              "linspace", "eye"}
HOST_SIDE = {
    ("engines/local.py", "pack"): "token lists -> tensors on the host, moved to the device once at the end",
    ("engines/local.py", "left_pad"): "token lists -> tensors on the host; callers move them",
    ("engines/local.py", "__init__"): "_Forced: the given tokens built on the host, then moved",
    ("engines/decode.py", "packs_bit_identically"): "a CPU-only probe of oneDNN's bf16 packing",
    ("diagnose/job.py", "score_alone"): "the host copy of the alone-scored log-probs (figures are computed there)",
    ("training/step.py", "_rollout_row"): "completion lengths for the step's row (host figures)",
    ("engines/drift.py", "*"): "drift compares host token and log-prob lists",
    ("diagnose/knobs.py", "*"): "knob advice: host figures",
    ("base/numerics.py", "*"): "scalar helpers",
    ("report/", "*"): "the report reads JSON on the host (every module of report/)",
    ("answer/decide.py", "*"): "the answer reads a result dict (the JSON's per-token arrays) on the host",
    ("answer/exposure.py", "*"): "the answer's per-token rules, from a result dict's arrays, on the host",
    ("routing/routes.py", "*"): "expert routes live on the host (k small ints per token and layer), compared there",
    ("routing/depth.py", "*"): "route flips along the depth: host figures from host routes",
    ("rollouts/batches.py", "*"): "rollout records -> tensors on the host, as Rollout.pack builds them",
    ("diagnose/recorded.py", "phantom_shares"): "recorded advantages broadcast on the host, where the figures are "
                                                "computed",
    ("integrations/slime.py", "rollout_figures"): "slime's samples carry their log-probs as Python lists: the "
                                                  "rollout-side figures are computed on the host",
    ("integrations/ranks.py", "route_flip_stats"): "flip sums built on the host, moved to the mask's device to reduce",
    ("engines/decode.py", "fuses_bit_identically"): "a probe of this CPU's oneDNN kernels: packed weights run on the "
                                                    "CPU only",
    ("integrations/trl_async/versions.py", "current_version"): "the weight version as a host number before it is "
                                                               "broadcast",
    ("integrations/trl_async/versions.py", "__call__"): "the samples' versions added to the collated batch on the "
                                                        "host, as TRL's collator builds it (moved with the batch)",
}
"""allocations without a device, each on the host by design; anything else on a job's path must name its device."""


def allocations_without_device() -> list[tuple[str, str, int]]:
    """(module, enclosing function, line) of every torch allocation call without device=."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = str(path.relative_to(PACKAGE))
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and node.func.attr in ALLOCATORS and not any(k.arg == "device" for k in node.keywords)):
                    found.append((mod, fn.name, node.lineno))
    return sorted(set(found))


def test_every_allocation_names_its_device_or_is_host_side():
    loose = [f"{m}:{line} in {fn}()" for m, fn, line in allocations_without_device()
             if (m, fn) not in HOST_SIDE and (m, "*") not in HOST_SIDE
             and (m.split("/")[0] + "/", "*") not in HOST_SIDE]
    assert not loose, "allocations without device= on a job's path (name the device of the data at hand):\n" + \
        "\n".join(loose)
