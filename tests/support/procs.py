"""Processes a test started, found and stopped by PID (never by name): a command's whole tree,
including the Ray processes it started, which leave its process group."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def process_tree(root: int) -> set[int]:
    """`root`, the processes of its session, and every descendant of those (Ray's raylet, GCS, workers)."""
    parent, session = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(pid)], session[int(pid)] = int(fields[1]), int(fields[3])
    ours = {root} | {p for p, s in session.items() if s == root}
    while more := {p for p, pp in parent.items() if pp in ours} - ours:
        ours |= more
    return ours


def signal_all(pids: set[int], sig: signal.Signals) -> None:
    """Send `sig` to each of `pids` that still runs."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
