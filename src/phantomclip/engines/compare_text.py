"""What `phantomclip engines` prints: one table read from the result dict alone (a saved --json renders the same)."""

from __future__ import annotations

from .compare import CompareConfig


def render_engines(result: dict, console) -> None:
    """One table row per (engine, dtype): start-up, median tokens/s and the ratio to the local engine."""
    from rich import box
    from rich.table import Table

    cfg, rows = CompareConfig(**result["config"]), result["rows"]
    title = f"engines: {cfg.n} prompts x {cfg.max_tokens} tokens, median of {cfg.repeats} calls after a warm-up"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("engine", "dtype", "start-up s", "tokens/s", "vs local"):
        table.add_column(col, justify="left" if col in ("engine", "dtype") else "right", overflow="fold")
    for r in rows:
        vs = f"{r['vs_local']:.2f}x" if r["vs_local"] is not None else "n/a"
        table.add_row(r["engine"], r["dtype"], f"{r['startup_seconds']:.1f}", f"{r['tokens_per_s']:.0f}", vs)
    console.print(table)
