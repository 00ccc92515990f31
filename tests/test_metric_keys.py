"""One meaning per name: every key `train` logs (metrics.jsonl) and every key the TRL monitor logs is defined in
docs/metrics.md, and no logged key is defined in two rows of its tables."""

import json
import re
from collections import Counter
from pathlib import Path

from phantomclip.cli.main import main
from phantomclip.integrations.trl import MONITOR_KEYS

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
PARTS = ("alpha", "beta", "beta_kernel", "beta_precision")
"""what `{part}` stands for in the train table (the parts of metrics.ratio_split)."""


def documented() -> Counter:
    """Each key the tables of docs/metrics.md define, counted per row that defines it: the backticked names of a row's
    first cell, `{part}` expanded, and a shorthand `_suffix` completing the row's first key (`x_mean`, `_abs_mean`)."""
    keys: Counter = Counter()
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        stem = names[0].removesuffix("_mean")
        row = set()
        for name in names:
            name = stem + name if name.startswith("_") else name
            row |= {name.replace("{part}", p) for p in PARTS} if "{part}" in name else {name}
        keys.update(row)
    return keys


def test_every_logged_key_is_defined_once(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", "tiny-random:0", "--steps", "1", "--group-size", "2", "--max-tokens", "4",
                 "--out", str(out)]) == 0
    logged = set(json.loads((out / "metrics.jsonl").read_text().splitlines()[0])) - {"step"}
    logged |= {f"precision/{k}" for k in (*MONITOR_KEYS, "shadow_minus_engine_mean", "changed_share_at_sync",
                                           "trainer_precision", "engine_dtype")}
    keys = documented()
    assert sorted(k for k in logged if k not in keys) == []
    assert sorted(k for k, n in keys.items() if "/" in k and n > 1) == []  # a logged key has one definition


def test_the_parser_reads_templates_and_shorthands():
    keys = documented()
    assert {"mismatch/alpha_abs_p99", "mismatch/beta_kernel_outside_trust_region"} <= set(keys)  # {part} rows
    assert "mismatch/beta_quant_abs_p99" in keys  # `mismatch/beta_quant_mean`, `_abs_p99`
