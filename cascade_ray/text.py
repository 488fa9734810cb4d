"""Text helpers for error messages: the nearest valid name and config key paths.

A leaf module: anything that reports a bad name or a key path may import it.
"""

from __future__ import annotations

import difflib
import typing


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest choice (case-insensitive), or ``""``."""
    options = list(choices)
    lowered = {c.lower(): c for c in options}
    if word.lower() in lowered and lowered[word.lower()] != word:
        return f"; did you mean {lowered[word.lower()]!r}?"
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]!r}?" if close else ""


def format_path(loc: typing.Sequence[str | int]) -> str:
    """``('stages', 1, 'solver')`` -> ``stages[1].solver``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
