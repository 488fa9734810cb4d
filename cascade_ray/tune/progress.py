"""What the driver shows while a sweep runs: one line per trial (state, epoch, metric, best so far).

:class:`SweepProgress` is a public ``ray.tune.Callback``; Tune calls it in the driver process, from
its controller loop, so nothing a trial does ever waits on it. It keeps a :class:`SweepBoard` (the
rows, no I/O) and renders it like the pipeline's progress (:mod:`cascade_ray.stage.progress`):

- on a terminal, the block of trial lines is redrawn in place whenever a row changes; lines that
  Ray forwards from the trials' workers clear the block first and it is redrawn below them (the
  display's guard goes in front of the pipeline display's, :func:`cascade_ray.logs.set_print_guard`);
- otherwise (Ray job logs), a trial's line is printed when its state or its epoch changes: at most
  one line per trial per epoch and per state, never one per step.

Tune's own table is off (``RunConfig(verbose=0)`` in :mod:`cascade_ray.tune.sweep`). A batched
sweep is one Train job: its rank 0 prints the same lines, one per replica at each epoch end
(:mod:`cascade_ray.stage.batched`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from ray import tune

from cascade_ray.stage.progress import format_trial

FINISHED = ("TERMINATED", "ERROR")  # Tune's end states: a restored experiment starts such a trial no more


@dataclass
class TrialRow:
    """What the display knows of one trial."""

    state: str = "PENDING"
    epoch: int | None = None
    epochs: int | None = None
    value: float | None = None  # the metric at the trial's latest epoch
    best: float | None = None  # the trial's best so far


class SweepBoard:
    """The rows of a sweep, in the order Tune made the trials, and the sweep's best so far.

    Args:
        metric, mode: the space's metric and direction (``min`` / ``max``).
        epochs: planned epochs per trial (a trial's own ``train.epochs`` when its config samples it).
    """

    def __init__(self, metric: str, mode: str, epochs: int | None = None):
        self.metric, self.mode, self.epochs = metric, mode, epochs
        self.rows: dict[str, TrialRow] = {}

    def better(self, a: float, b: float | None) -> bool:
        return b is None or (a > b if self.mode == "max" else a < b)

    def update(
        self, trial: str, *, state: str | None = None, result: dict[str, Any] | None = None, best: Any = None
    ) -> bool:
        """Record a state or an epoch result of `trial`; True when its line changed state or epoch
        (what a plain log prints a line for). `best`: a value of the metric it reported before this
        board saw it (a restored trial's best epoch)."""
        row = self.rows.get(trial)
        if row is None:
            row = self.rows[trial] = TrialRow(epochs=self.epochs)
            changed = True
        else:
            changed = False
        if state is not None and state != row.state:
            row.state, changed = state, True
        if result is not None:
            epoch = result.get("epoch")
            if epoch is not None and int(epoch) != row.epoch:
                row.epoch, changed = int(epoch), True
            value = result.get(self.metric)
            if isinstance(value, int | float):
                row.value = float(value)
                if math.isfinite(row.value) and self.better(row.value, row.best):  # NaN is never a best
                    row.best = row.value
            epochs = (result.get("config") or {}).get("train.epochs")
            if isinstance(epochs, int):
                row.epochs = epochs
        finite = isinstance(best, int | float) and not isinstance(best, bool) and math.isfinite(best)
        if finite and self.better(float(best), row.best):
            row.best = float(best)
        return changed

    def leader(self) -> str | None:
        """The trial holding the sweep's best so far."""
        best: tuple[str, float] | None = None
        for trial, row in self.rows.items():
            if row.best is not None and (best is None or self.better(row.best, best[1])):
                best = (trial, row.best)
        return best[0] if best is not None else None

    def line(self, trial: str, leader: str | None = None) -> str:
        row = self.rows[trial]
        return format_trial(
            trial,
            row.state,
            metric=self.metric,
            epoch=row.epoch,
            epochs=row.epochs,
            value=row.value,
            best=row.best,
            leader=trial == leader,
        )

    def lines(self) -> list[str]:
        leader = self.leader()
        return [self.line(t, leader) for t in self.rows]


class SweepProgress(tune.Callback):
    """Tune callback that shows a :class:`SweepBoard` on the driver (see the module docstring).

    Args:
        metric, mode, epochs: as :class:`SweepBoard`.
        stream: where to write (default: ``sys.stdout`` at each write, so a redirected stdout is followed).
        tty: redraw in place (default: ``stream.isatty()``).
    """

    def __init__(
        self,
        metric: str,
        mode: str,
        epochs: int | None = None,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ):
        self.board = SweepBoard(metric, mode, epochs)
        self.stream_, self.tty_ = stream, tty
        self.drawn = 0  # lines of the block on screen now (terminal)
        self.previous: Callable[[], AbstractContextManager[Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its run config with the experiment: no stream or guard travels with it
        return {**self.__dict__, "stream_": None, "previous": None, "drawn": 0}

    @property
    def stream(self) -> TextIO:
        return self.stream_ or sys.stdout

    @property
    def tty(self) -> bool:
        return self.stream.isatty() if self.tty_ is None else self.tty_

    # -- Tune's hooks (driver process, Tune's controller loop) ---------------------------------------

    def setup(self, **info: Any) -> None:
        from cascade_ray.logs import print_guard, set_print_guard

        if self.tty and self.previous is None:
            self.previous = print_guard()
            set_print_guard(self.paused)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        for trial in trials:  # new trials (PENDING) and state changes Tune has no hook for (PAUSED)
            self._seen(trial)

    def _seen(self, trial: Any) -> None:
        if trial.trial_id not in self.board.rows and trial.status in FINISHED:
            # a resumed sweep's trial that had finished: Tune reports nothing more of it, so its line
            # shows the epochs it reported before (not "epoch 0/N")
            self._changed(trial.trial_id, state=trial.status, **self._reported(trial))
        else:
            self._changed(trial.trial_id, state=trial.status)

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._changed(trial.trial_id, state="RUNNING")

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict, **info: Any) -> None:
        self._changed(trial.trial_id, state="RUNNING", result=result)

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._changed(trial.trial_id, state="TERMINATED")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._changed(trial.trial_id, state="ERROR")

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        for trial in trials:  # a resumed sweep whose trials had all finished has no step: seen here first
            self._seen(trial)
        if self.previous is not None:  # the block stays on screen as the sweep's last word
            from cascade_ray.logs import set_print_guard

            set_print_guard(self.previous)
            self.previous = None
        self.drawn = 0

    def _reported(self, trial: Any) -> dict[str, Any]:
        """What a finished trial of a restored experiment reported: its last result and its best value of
        the metric (Tune's ``Trial.last_result`` and ``Trial.metric_analysis``, restored with the experiment)."""
        last = getattr(trial, "last_result", None)
        analysis = (getattr(trial, "metric_analysis", None) or {}).get(self.board.metric) or {}
        return {
            "result": dict(last) if isinstance(last, dict) and "epoch" in last else None,
            "best": analysis.get(self.board.mode),
        }

    # -- rendering -----------------------------------------------------------------------------------

    def _changed(self, trial: str, **update: Any) -> None:
        if not self.board.update(trial, **update) and not (self.tty and update.get("result")):
            return
        if self.tty:
            with self._outer():
                self._clear()
                self._draw()
        else:
            print(self.board.line(trial, self.board.leader()), file=self.stream, flush=True)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the block while something else writes (forwarded worker lines), then redraw it below."""
        with self._outer():
            self._clear()
            yield
            self._draw()

    @contextmanager
    def _outer(self) -> Iterator[None]:
        with (self.previous or _nothing)():
            yield

    def _clear(self) -> None:
        if self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")  # to the block's first line, erase to the end
            self.drawn = 0

    def _draw(self) -> None:
        lines = self.board.lines()
        if lines:
            self.stream.write("".join(f"{line}\n" for line in lines))
            self.stream.flush()
        self.drawn = len(lines)


@contextmanager
def _nothing() -> Iterator[None]:
    yield
