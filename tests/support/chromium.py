"""Headless Chromium (Debian's ``chromium`` package) for tests that check a page as a browser shows it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

CHROMIUM_TIMEOUT_S = 90


def chromium() -> str:
    """The browser's path; an error saying how to install it when it is missing (no skip)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("headless Chromium is needed: apt-get install chromium (.ci/run installs it)")
    return path


def _run(args: list[str], cwd: Path) -> str:
    """Chromium with `args`, in its own process group (it forks helpers), killed by its PID's group
    when it outlives the timeout; its stdout."""
    proc = subprocess.Popen(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            f"--user-data-dir={cwd / 'chromium-profile'}",
            *args,
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited {proc.returncode}: {err[-2000:]}")
    return out


def screenshot(page: Path, png: Path, size: str = "1280,2000") -> Path:
    """A screenshot of the local file `page` (no network: the page must be self-contained)."""
    _run([f"--screenshot={png}", f"--window-size={size}", page.resolve().as_uri()], png.parent)
    return png


def dump_dom(page: Path, work: Path) -> str:
    """The DOM of `page` after Chromium loaded it, serialized."""
    return _run(["--dump-dom", page.resolve().as_uri()], work)
