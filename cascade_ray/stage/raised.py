"""Where an exception from the training code came from, carried from the worker to the driver.

Ray Train 2.60 hands the driver the worker's exception without its traceback, and its error text
cuts a long traceback's middle, where a user module's frame usually is. The worker therefore adds
a note (PEP 678, kept when the exception is pickled) naming the deepest frame outside torch, Ray
and cascade-ray; the driver's stage error names it (``cascade_ray.pipeline.failures``).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Iterable
from pathlib import Path

NOTE = "cascade-ray: raised at "
# not the user's code: cascade-ray itself and Python's standard library (installed packages: "-packages")
_NOT_OWN = tuple(
    str(Path(p).resolve()) + os.sep
    for p in (Path(__file__).resolve().parents[1], sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
)


def own_frame(frames: Iterable[tuple[str, int | str, str]]) -> tuple[str, int | str, str] | None:
    """The deepest of `frames` (file, line, function; outermost first) outside installed packages (torch,
    Ray), cascade-ray itself, the standard library and Python's frozen modules: the user's code, or None."""
    own = [f for f in frames if "-packages" not in f[0] and not f[0].startswith(("<", *_NOT_OWN))]
    return own[-1] if own else None


def mark_raised_at(exc: BaseException) -> None:
    """Add the note naming `exc`'s own frame (:func:`own_frame` of its traceback), when it has one."""
    where = own_frame((f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__))
    if where is not None and hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"{NOTE}{where[0]}:{where[1]}, in {where[2]}")


def raised_at(exc: BaseException) -> str | None:
    """``file:line, in function`` from :func:`mark_raised_at`'s note, or None."""
    return next((n[len(NOTE) :] for n in getattr(exc, "__notes__", ()) if str(n).startswith(NOTE)), None)
