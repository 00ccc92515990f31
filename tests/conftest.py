import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))

MATMULS = ("native", "emulated")
"""Both low-precision matmul kernels, named explicitly: 'auto' picks native on AVX-512-BF16/AMX CPUs and emulated on
AVX2, so a test that left it to 'auto' would check only one of them on any one machine."""


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random Llama with the byte tokenizer (init std 0.3: peaked enough to show a gap)."""
    from phantomclip.models.load import load_model

    return load_model("tiny-random:0")


@pytest.fixture(scope="session")
def tiny_prompts(tiny):
    from phantomclip.models.prompts import bundled_prompts, encode_prompts

    return encode_prompts(tiny.tokenizer, bundled_prompts()[:6])


def report(name: str, a: torch.Tensor, b: torch.Tensor) -> str:
    """Max / mean absolute difference, for assertion messages."""
    d = (a.double() - b.double()).abs()
    return f"{name}: max |diff| {d.max().item():.3e}, mean |diff| {d.mean().item():.3e} over {d.numel()} values"


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of `dtype`: the spacing of floats in [1, 2) (fp32 2^-23, bf16 2^-7, fp16 2^-10, fp64 2^-52)."""
    return torch.finfo(dtype).eps


def forward_terms(config, context: int) -> int:
    """Rounding events on the path to one logit of a decoder forward, for `terms` of assert_close_eps: the lengths
    of its reductions summed over the layers (q/k/v projections over H, attention scores over head_dim, their
    weighted sum over `context` positions, o projection over H, MLP gate/up over H and down over the intermediate
    size), plus the head's H. Two forwards that reorder all of them (other shapes: a batch against one row, decode
    against prefill; other kernels) give logits that differ by about eps * max|z| * sqrt(forward_terms)."""
    H, inter, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d_head = getattr(config, "head_dim", None) or H // config.num_attention_heads
    return L * (H + d_head + context + H + H + inter) + H


def logit_bound(model) -> float:
    """An upper bound on |logit| over all inputs of a Llama-style model: max_v ||W_v|| * max|g| * sqrt(H)
    (Cauchy-Schwarz on the head over the final RMSNorm's output, whose 2-norm is at most max|g| * sqrt(H)). The
    logit scale for tests that see a run's figures but not its logits (tiny-random:0: 23.7, against 11 seen)."""
    head, g = model.get_output_embeddings().weight, model.model.norm.weight
    return head.norm(dim=-1).max().item() * g.abs().max().item() * model.config.hidden_size**0.5


def fp32_forward_noise(model, context: int) -> float:
    """The largest |Δ log p| between two fp32 forwards of `model` that reorder every reduction (decode against
    prefill, one engine's kernels against another's): 2 eps_fp32 * max|z| * sqrt(forward_terms), max|z| bounded
    by logit_bound. For checks such as 'an fp32 engine against an fp32 trainer has no gap'."""
    return 2 * eps(torch.float32) * logit_bound(model) * math.sqrt(forward_terms(model.config, context))


def assert_close_eps(a, b, dtype: torch.dtype, scale, terms: int = 1, factor: float = 2.0, name: str = "values"
                     ) -> float:
    """Assert |a - b| <= factor * eps(dtype) * scale * sqrt(terms), elementwise; returns the worst |a - b| / bound.

    The bound for two computations of the same quantity that differ in the order or blocking of their floating
    point operations (another kernel, another matmul shape, another reduction tree). Each operation rounds by at
    most eps/2 relative to what it produces, so a sum of `terms` terms of size `scale` carries an error of about
    eps * scale * sqrt(terms) (independent roundings add as a random walk; the worst case, terms instead of
    sqrt(terms), is never approached by real kernels), and two such computations differ by at most twice that
    (`factor` 2). `scale` is the size of what is summed or rounded, not of the result, which may cancel to near
    zero: a number, or a tensor broadcast against `a` (per-row or per-element scales). Each caller says in a
    comment what its scale, terms and factor stand for. On failure the message gives the max and mean |a - b| and
    the bound; the worst ratio is printed either way (pytest -s shows each test's margin).
    """
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    bound = factor * eps(dtype) * torch.as_tensor(scale, dtype=torch.float64) * math.sqrt(terms)
    d = (a - b).abs()
    ratio = torch.where(d == 0, 0.0, d / bound).max().item() if d.numel() else 0.0  # 0/0 where both are exact
    msg = (f"{report(name, a, b)}; bound {factor:g} * eps({str(dtype).removeprefix('torch.')}) * scale * sqrt({terms}) "
           f"= {bound.max().item():.3e}{'' if bound.numel() == 1 else ' (largest)'}, worst |diff| / bound {ratio:.3g}")
    print(msg)
    assert bool((d <= bound).all()), msg
    return ratio


def offline(monkeypatch) -> None:
    """Offline mode as a user without network sets it (HF_HUB_OFFLINE is read once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def bad_cli(args: list[str], capsys, after_progress: bool = False) -> str:
    """Run the CLI on bad input: exit code 2, one line on stderr, no traceback. Returns the line.

    `after_progress`: errors found only once work has started (an engine refusing the model) may follow
    progress lines; the error must still be one line, the last."""
    from phantomclip.cli.main import main

    try:
        code = main(args)
    except SystemExit as e:  # argparse's own errors exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    if after_progress:
        assert sum(line.startswith("phantomclip") for line in lines) == 1 and lines[-1].startswith("phantomclip"), err
        return lines[-1]
    assert len(lines) == 1, err
    return err


def as_written_before_run_ids(run: Path) -> None:
    """Strip run/id from every row of a run's JSONL files, as a run written before rows carried it: for tests that
    make a run look older by editing its config.json (which changes the id its rows would be checked against)."""
    import json

    for name in ("metrics.jsonl", "samples.jsonl", "tokens.jsonl"):
        path = Path(run) / name
        if path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "run/id"}) + "\n" for r in rows))


def cpu_kind() -> str:
    """'amx', 'avx512bf16' or 'avx2': the kernel family oneDNN picks for bf16 (and fp32 blocking) on this CPU. Golden
    files are recorded per kind: another kind sums in another order and may even sample other tokens."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    return "amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags else "avx2"


def over(base: list[str], *extra: str) -> list[str]:
    """`base` with the flags of `extra` given in their place: the command line a user types, each flag once (a
    repeated single-value flag is refused)."""
    given = {a for a in extra if a.startswith("--")}
    out, skip = [], False
    for a in base:
        if skip and not a.startswith("--"):
            skip = False
            continue
        skip = a in given
        if not skip:
            out.append(a)
    return [*out, *extra]


def run_ranks(worker: str, out: Path, world: int, timeout: int, **env: str) -> list[dict]:
    """Run tests/<worker> on `world` processes (torchrun over gloo, one thread each) with `out` as its argument, and
    return each rank's saved record (out/rank<r>.pt). A failed launch fails the test with the ranks' stderr."""
    here = Path(__file__).parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(here / worker), str(out)]
    # this checkout's src first: the venv's editable install may point at another checkout (a worktree's tests must
    # run the worktree's code on every rank, as they do in the main process with PYTHONPATH=src)
    path = os.pathsep.join([str(here), str(here.parent / "src")])
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


SIGNAL_AT = """
import builtins, os, signal, sys
from phantomclip.cli import main as cli
real = builtins.__import__
def signal_at(name, *args, **kwargs):  # the signal argv[2] the moment the module named argv[1] is first imported
    if name == sys.argv[1]:
        builtins.__import__ = real
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
    return real(name, *args, **kwargs)
builtins.__import__ = signal_at
sys.exit(cli.main(["diagnose", "--model", "tiny-random", "--n", "2", "--max-tokens", "2"]))
"""
"""a diagnose run sent a signal (argv[2]: SIGINT, SIGTERM) the moment a module (argv[1]) is first imported: run as
`python -c SIGNAL_AT module SIGNAME`."""
