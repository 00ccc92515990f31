"""Golden numbers: `diagnose --json` on tiny-random with a fixed seed gives the same figures, to 1e-12, as the
file recorded before a refactor. A refactor that moves code must not move a number.

The golden depends on the CPU kind: with native bf16 (AVX512-BF16 or AMX) PyTorch takes other low-precision kernels
than on an AVX2-only CPU, and a different rounding can even sample other tokens. So each golden is named by the kind
it was recorded on, and a CPU kind without one is skipped, not compared against the wrong numbers.
Re-recorded once, at 9e3e6ef: `--matmul auto` now picks emulated fp16 on CPUs without fp16 instructions (was native);
every figure outside the fp16 recipe was checked equal to the first recording (57c664d) to 1e-12 before replacing it.
The AMX golden was recorded at the static decode path; on that CPU a run with the HF decode path instead
gives the same figures to 1e-12 on tiny-random, so the older goldens, recorded with the HF path, still apply.
The AVX512-BF16 golden was re-recorded at the packed engine weights (oneDNN-packed): every number of the old recording
equal to 1e-12 but `schema` (1 -> 2: the frameworks' figures, which it now also holds).
The AVX2 golden was first recorded at the emulated kernel's packing (2026-12-02, on a 2-core AVX2-only
EPYC): a recording at the commit before it, on F.linear, gave every number equal to 1e-12 (only
`engine.packed_weights` false -> true), since at tiny-random's widths oneDNN's fp32 sums equal MKL's there.
Re-record (only when a change of numbers is intended and explained in the commit), <kind> as `cpu_kind()` says,
with the 2 threads the tests run with (conftest.py; reductions split over other thread counts round otherwise):
    OMP_NUM_THREADS=2 phantomclip diagnose --model tiny-random:0 --n 8 --max-tokens 8 --seed 0 \
        --json tests/golden/diagnose-tiny-<kind>.json
"""

import json
import math
from pathlib import Path

import pytest

from conftest import cpu_kind
from phantomclip.cli.main import main

GOLDEN = Path(__file__).parent / "golden"
ARGS = ["diagnose", "--model", "tiny-random:0", "--n", "8", "--max-tokens", "8", "--seed", "0"]
UNSTABLE = {"versions", "seconds", "seconds_alone", "startup_seconds", "tokens_per_s"}
"""keys whose values are times, durations or versions: they differ from run to run and machine to machine."""
TOL = 1e-12


def numeric_diffs(old, new, path: str = "$") -> list[str]:
    """Every path where a number (or a null standing for a non-finite one) of `old` differs from `new` by more
    than TOL, or where `new` lacks a key or list entry of `old`. Strings are not compared; keys only `new` has
    are allowed."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path}: was an object, now {type(new).__name__}"]
        out = []
        for key, value in old.items():
            if key in UNSTABLE:
                continue
            if key not in new:
                out.append(f"{path}.{key}: removed")
            else:
                out += numeric_diffs(value, new[key], f"{path}.{key}")
        return out
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{path}: list of {len(old)}, now {len(new) if isinstance(new, list) else type(new).__name__}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in numeric_diffs(a, b, f"{path}[{i}]")]
    is_number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if old is None or is_number(old) or isinstance(old, bool):
        if isinstance(old, bool) or isinstance(new, bool):
            return [] if old == new else [f"{path}: {old!r} -> {new!r}"]
        if old is None or new is None:
            return [] if old is None and new is None else [f"{path}: {old!r} -> {new!r}"]
        if not is_number(new):
            return [f"{path}: {old!r} -> {new!r}"]
        same = abs(old - new) <= TOL or (math.isinf(old) and old == new)
        return [] if same else [f"{path}: {old!r} -> {new!r} (diff {new - old:.3e})"]
    return []


def test_numeric_diffs_finds_what_changed():
    old = {"a": 1.0, "b": [1, None, 2.5], "c": {"d": 0.5, "seconds": 3.0}, "s": "text"}
    assert numeric_diffs(old, {"a": 1.0 + 1e-13, "b": [1, None, 2.5], "c": {"d": 0.5, "seconds": 9.0, "new": 1},
                               "s": "other"}) == []
    assert numeric_diffs(old, {"a": 1.1, "b": [1, 0.0], "c": {"seconds": 3.0}, "s": "text"}) == [
        "$.a: 1.0 -> 1.1 (diff 1.000e-01)", "$.b: list of 3, now 2", "$.c.d: removed"]


def test_diagnose_numbers_match_the_golden(tmp_path):
    golden = GOLDEN / f"diagnose-tiny-{cpu_kind()}.json"
    if not golden.exists():
        pytest.skip(f"no diagnose golden for this CPU kind ({cpu_kind()}): other bf16 kernels give other numbers; "
                    f"record {golden.name} on such a CPU to compare (see this file's docstring)")
    out = tmp_path / "diag.json"
    assert main(ARGS + ["--json", str(out)]) == 0
    diffs = numeric_diffs(json.loads(golden.read_text()), json.loads(out.read_text()))
    assert not diffs, f"{len(diffs)} numbers differ from {golden.name}; first ones:\n" + "\n".join(diffs[:15])
