"""What `phantomclip trace` and `trace --run` print: tables read from the result dict alone, so a saved --json
renders the same as a fresh run."""

from __future__ import annotations


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
