"""Text helpers for error messages: the nearest valid name and config key paths.

A leaf module: anything that reports a bad name or a key path may import it.
"""

from __future__ import annotations

import difflib
import reprlib
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


# Longest quoted value in a message: a config value can be megabytes (or an alias bomb's expansion).
SHORT_REPR_LIMIT = 80
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = SHORT_REPR_LIMIT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def short_repr(value: object, limit: int = SHORT_REPR_LIMIT) -> str:
    """``repr(value)``, bounded: built by :mod:`reprlib` (never the full repr of a huge value), then cut at `limit`.

    Every value quoted in a config error goes through this, so no message grows with its input.
    """
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit
        text = (
            f"<{type(value).__name__} of about {int(value.bit_length() * 0.30103)} digits>"
            if isinstance(value, int)
            else "<unprintable>"
        )
    return text if len(text) <= limit else text[: limit - 4] + " ..."
