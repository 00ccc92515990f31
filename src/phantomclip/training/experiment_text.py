"""What `phantomclip experiment` prints: the arms' table and the verdict lines, read from the summary dict alone
(a saved --json renders the same)."""

from __future__ import annotations

from .experiments import ARM_COLUMNS


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
