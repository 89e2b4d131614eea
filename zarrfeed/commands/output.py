"""Tables for a person or a script: rich in a terminal, aligned plain text when piped, JSON on
request — one routine, so every command looks and pipes alike."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

SHORT = 10  # a compact table never narrows a column whose cells are at most this wide


def is_terminal(stream: TextIO) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def print_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    title: str = "",
    stream: TextIO | None = None,
    notes: Sequence[str] = (),
    compact: bool = False,
) -> None:
    """``rows`` under ``columns``; numbers right-aligned.  ``notes`` follow the table (a
    root cause, the command that fixes something), one line each.  ``compact`` (in a
    terminal): no borders, and a cell never wraps: a column too wide for the terminal ends
    in an ellipsis, so a name is never split over lines."""
    stream = stream or sys.stdout
    cells = [["" if c is None else str(c) for c in row] for row in rows]
    numeric = [
        all(_is_number(r[i]) for r in cells if r[i]) and any(r[i] for r in cells)
        for i in range(len(columns))
    ]
    if is_terminal(stream):
        from rich import box
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=title or None,
            title_justify="left",
            header_style="bold",
            **(
                {"box": box.SIMPLE_HEAD, "show_edge": False, "padding": (0, 1, 0, 0)}
                if compact
                else {}
            ),
        )
        for i, (name, right) in enumerate(zip(columns, numeric, strict=True)):
            # short columns (flags, counts) keep their width; long ones give way
            widest = max([len(name), *(len(r[i]) for r in cells)])
            table.add_column(
                name,
                justify="right" if right else "left",
                overflow="ellipsis" if compact else "fold",
                no_wrap=compact,
                min_width=widest if compact and widest <= SHORT else None,
            )
        for row in cells:
            table.add_row(*(_style(c) for c in row))
        console = Console(file=stream)
        console.print(table)
        for note in notes:
            console.print(note, highlight=False, markup=False)
        return
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if right else c.ljust(w)
            for c, w, right in zip(row, widths, numeric, strict=True)
        ).rstrip()

    if title:
        print(title, file=stream)
    print(line(list(columns)), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for row in cells:
        print(line(row), file=stream)
    for note in notes:
        print(note, file=stream)


def print_json(value: Any, stream: TextIO | None = None) -> None:
    json.dump(value, stream or sys.stdout, indent=2, default=str)
    print(file=stream or sys.stdout)


def human_bytes(n: float) -> str:
    """``1536`` → ``1.5 KiB``: sizes a person reads at a glance."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").split()[0])
    except (ValueError, IndexError):
        return False
    return True


def _style(cell: str) -> str:
    from rich.markup import escape

    if cell in ("NO", "FAILED", "MISMATCH", "failed", "missing", "stale"):
        return f"[bold red]{escape(cell)}[/]"
    if cell in ("yes", "ok", "current"):
        return f"[green]{escape(cell)}[/]"
    return escape(cell)
