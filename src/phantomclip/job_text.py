"""The text each job prints on the terminal, apart from its measurement (diagnose's, larger, is diagnose_text.py).

Each function reads only the job's result dict, so a saved --json renders the same as a fresh run.
"""

from __future__ import annotations

from .compare import CompareConfig
from .experiments import ARM_COLUMNS


def render_trace(result: dict, console) -> None:
    """Print a `run_trace` result (reads only the dict, so a saved --json renders the same)."""
    from rich import box
    from rich.table import Table

    def table(title: str) -> Table:
        return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)

    console.print(f"[bold]phantomclip trace[/bold]: {result['recipe']} against {result['against']}, "
                  f"{result['tokens']} completion tokens")
    t = table("error along depth (‖x − x_ref‖ / ‖x_ref‖ over real tokens)")
    for col in ("site", "rel error", "max |Δ|", "ref RMS", "ref max |x|"):
        t.add_column(col, justify="left" if col == "site" else "right", overflow="fold")
    for r in result["sites"]:
        t.add_row(r["site"], f"{r['rel_error']:.2e}", f"{r['max_abs_error']:.3g}", f"{r['ref_rms']:.3g}",
                  f"{r['ref_max_abs']:.3g}")
    console.print(t)
    b, fo = result["beta"], result["first_order"]
    console.print(f"β = Δlog p: mean {b['beta_mean']:+.4f}, mean |β| {b['beta_abs_mean']:.4f}, "
                  f"outside the trust region {100 * b['outside_trust_region']:.2f}%. "
                  f"First order Δz_y − Σ p_i Δz_i explains {100 * fo['explained_share']:.1f}% of Σ|β| "
                  f"(correlation {fo['corr']:.4f}).")
    t = table("by the reference probability of the token")
    for col in ("p", "tokens", "mean |β|", "mean |Δz_y|", "mean |Σ p Δz|", "mean |first order|"):
        t.add_column(col, justify="right", overflow="fold")
    for r in fo["buckets"]:
        t.add_row(f"[{r['p_low']:g}, {r['p_high']:g})", str(r["tokens"]), f"{r['beta_abs_mean']:.4f}",
                  f"{r['dz_target_abs_mean']:.4f}", f"{r['dz_expected_abs_mean']:.4f}",
                  f"{r['first_order_abs_mean']:.4f}")
    console.print(t)
    if "split" in result:
        sp = result["split"]
        console.print(f"weights vs compute: rounding the weights alone (fp32 arithmetic) gives mean |β| "
                      f"{sp['weights_only']['beta_abs_mean']:.4f}; the recipe's arithmetic on unrounded weights "
                      f"{sp['compute_only']['beta_abs_mean']:.4f}; both {sp['whole']['beta_abs_mean']:.4f}. "
                      f"Weights carry {100 * sp['weights_share_of_variance']:.0f}% of the variance (the parts add in "
                      f"quadrature: ratio {sp['quadrature_ratio']:.2f}).")
    if "what_if" in result:
        t = table("what-if: keep modules in fp32 (ranked by gain per extra MiB)")
        for col in ("keep fp32", "mean |β|", "outside %", "gain", "extra MiB", "forward s"):
            t.add_column(col, justify="left" if col == "keep fp32" else "right", overflow="fold")
        for r in result["what_if"]:
            t.add_row(",".join(r["keep_fp32"]), f"{r['beta_abs_mean']:.4f}", f"{100 * r['outside_trust_region']:.2f}",
                      f"{r['gain']:+.4f}", f"{r['extra_mib']:.2f}", f"{r['forward_s']:.2f}")
        console.print(t)
    if "quant_what_if" in result:  # an FP8 recipe: which part kept in the engine's dtype buys the most
        render_quant_what_if(result, console, table)


def render_quant_what_if(result: dict, console, table) -> None:
    """trace's FP8 what-if table, ranked with its noise (trace.quant_order_noise), and the orders' line."""
    noise = result.get("quant_order_noise")
    t = table(f"what-if: keep part of the FP8 quantisation in the engine's dtype (against {result['against']}; "
              "ranked by gain in mean |β|" + (f"; a gain within ±{noise['floor']:.4f} ({noise['floor_from']}: the "
                                              "spread of the whole recipe's mean |β| over fp32 summation orders, "
                                              "or the largest loss of a row) is noise: marked ~ and ranked last"
                                              if noise else "") + ")")
    for col in ("keep", "mean |β|", "outside %", "gain"):
        t.add_column(col, justify="left" if col == "keep" else "right", overflow="fold")
    for r in result["quant_what_if"]:
        t.add_row(r["keep"], f"{r['beta_abs_mean']:.4f}", f"{100 * r['outside_trust_region']:.2f}",
                  f"{r['gain']:+.4f}" + (" ~" if r.get("within_noise") and r is not result["quant_what_if"][0]
                                         else ""))
    console.print(t)
    if noise:
        console.print(f"summation orders ({', '.join(noise['orders'])}): mean |β| "
                      + ", ".join(f"{o['beta_abs_mean']:.4f}" for o in noise["orders"].values())
                      + f"; per-token β between two orders correlates r ≥ {noise['token_correlation']:.2f}: read "
                      "means and shares, not single tokens (emulated FP8: one order per run, a GPU has its own)",
                      markup=False)


def render_growth(result: dict, console) -> None:
    """One table: per snapshot, mean |β| (reference and own tokens) and its change since the first snapshot split
    into mix, within-bucket and interaction."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"how β grows along {result['run']}: mean |β| and its parts; its change since the first "
                  "snapshot = mix + within + interaction (tokens: ref = sampled at step "
                  f"{result['reference_step']}, own = sampled with that step's weights)",
                  title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False)
    # 9 columns of at most 7 characters: fits 80 columns
    for name in ("step", "drift", "|β|", "kernel", "precis.", "Δ|β|", "mix", "within", "inter."):
        table.add_column(name, justify="right", no_wrap=True)
    for row in result["snapshots"]:
        for which in ("reference", "own"):
            if which not in row:
                continue
            r, d = row[which], row[which]["change_since_first"]
            table.add_row(f"{row['step']} {'ref' if which == 'reference' else 'own'}",
                          f"{row['weights']['relative_drift']:.0e}", f"{r['beta_abs_mean']:.4f}",
                          f"{r['beta_kernel_abs_mean']:.4f}", f"{r['beta_precision_abs_mean']:.4f}",
                          f"{d['change']:+.4f}", f"{d['mix']:+.4f}", f"{d['within']:+.4f}", f"{d['interaction']:+.4f}")
    console.print(table)


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


def render_experiment(summary: dict, console) -> None:
    """The experiment's arms (mean and 95% t interval over seeds) and its verdict lines: one table when the terminal
    is wide enough, else the figures in as many tables as it takes, each whole cell on one line (`column_groups`)."""
    from rich import box
    from rich.table import Table

    arms = summary["arms"]
    cells = [[cell(a) for a in arms] for _, cell in ARM_COLUMNS]  # [column][arm]
    # a column is as wide as its widest cell (kept whole) or header word (headers wrap), plus the table's padding
    longest = [max(len(c) for c in col) for col in cells]
    widths = [max(w, *(len(word) for word in header.split())) + PADDING for (header, _), w in zip(ARM_COLUMNS, longest)]
    label = max([len("arm"), *(len(a["run"]) for a in arms)]) + len("seeds") + 2 * PADDING
    groups = column_groups(widths, console.width - label)
    for i, group in enumerate(groups):
        part = f" ({i + 1}/{len(groups)})" if len(groups) > 1 else ""
        table = Table(title=f"experiment {summary['experiment']}: mean [95% t interval] over seeds "
                      f"{summary['seeds']}{part}", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("arm", no_wrap=True)
        table.add_column("seeds", justify="right")
        for k in group:
            table.add_column(ARM_COLUMNS[k][0], justify="right", min_width=longest[k], overflow="fold")
        for j, a in enumerate(arms):
            table.add_row(a["run"], str(len(a["seeds"])), *(cells[k][j] for k in group))
        console.print(table)
    console.print("* censored at the budget: a run that did not converge counts as the budget")
    for line in summary["verdict"]:
        console.print(f"- {line}")


PADDING = 3
"""terminal columns a rich table adds around each column's text (a space on each side and the separator)."""


def column_groups(widths: list[int], room: int) -> list[list[int]]:
    """The columns (by index, in order) packed greedily into groups whose widths add up to at most `room`; a column
    wider than `room` gets a group of its own."""
    groups: list[list[int]] = [[]]
    used = 0
    for k, w in enumerate(widths):
        if groups[-1] and used + w > room:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += w
    return groups
