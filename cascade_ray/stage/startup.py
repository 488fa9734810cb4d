"""Where a stage fit's seconds go before its first optimizer step.

Every stage fit (a pipeline stage or a Tune trial) pays a fixed start-up before it trains:
Ray Train's controller, placement group and worker process, the worker's imports, fetching
the data and frozen upstream from the object store, building the model and optimizer, and
the first step itself. :class:`StartupClock` takes wall-clock marks on rank 0 of the stage
and turns them into phases, relative to ``fit_started`` (``time.time()`` on the driver when
it called ``fit()``; the same host clock on one node, NTP-synchronized clocks across nodes):

- ``ray_train_s``: ``fit()`` called -> the worker process exists (the Train controller's
  process and imports, the placement group, the synchronization actor, the worker's spawn);
- ``worker_start_s``: -> the loop function runs (the worker's imports, the train function's
  unpickling, the torch process group);
- ``inputs_s``: -> the data, upstream weights and cached features are fetched;
- ``setup_s``: -> the model, optimizer, schedule and precision are built;
- ``first_step_s``: -> the first optimizer step has returned;
- ``to_first_step_s``: their sum.

The record lands in the stage's ``summary.json`` entry (``startup``) and, for a Tune trial,
in its trial directory; ``benchmarks/bench_trial_startup.py`` tabulates them.
"""

from __future__ import annotations

import os
import time
from typing import Any

PHASES = ("ray_train_s", "worker_start_s", "inputs_s", "setup_s", "first_step_s")


def process_start_time(pid: int | str = "self") -> float | None:
    """When process `pid` started (seconds since the epoch), from ``/proc``; None where there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks


class StartupClock:
    """Marks of one worker's start-up; :meth:`record` turns them into phase durations."""

    def __init__(self, fit_started: float | None) -> None:
        self.fit_started = fit_started
        self.marks: dict[str, float | None] = {"process": process_start_time(), "loop": time.time()}

    def mark(self, name: str) -> None:
        """Note that `name` (``inputs``, ``setup``, ``first_step``) is done, the first time only."""
        self.marks.setdefault(name, time.time())

    def on_setup(self, _state: Any) -> None:
        """``LoopHooks.on_setup``: the model and solver are built."""
        self.mark("setup")

    def after_optimizer_step(self, _state: Any) -> None:
        """``LoopHooks.after_optimizer_step``: the first step is done (later calls keep the first mark)."""
        if "first_step" not in self.marks:
            self.mark("first_step")

    def record(self) -> dict[str, float] | None:
        """Phase durations in seconds (rounded to ms), or None without the driver's ``fit()`` time.

        A phase whose end mark is missing (no ``/proc``; a stage that took no step) is left out and
        the next phase counts from the last mark there is. After a worker group restart (a failed
        worker), the marks are the new group's, so ``ray_train_s`` includes the failed attempt.
        """
        if self.fit_started is None:
            return None
        out: dict[str, float] = {}
        last = self.fit_started
        for name, mark in zip(PHASES, ("process", "loop", "inputs", "setup", "first_step"), strict=True):
            at = self.marks.get(mark)
            if at is not None:
                out[name] = round(max(0.0, at - last), 3)
                last = at
        if self.marks.get("first_step") is not None:
            out["to_first_step_s"] = round(max(0.0, last - self.fit_started), 3)
        return out
