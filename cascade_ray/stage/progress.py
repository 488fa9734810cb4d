"""What the driver shows while a stage trains: stage i/N, epoch, step, loss, samples/s, ETA.

Three pieces, so that no step of any worker ever waits on a display:

- :class:`ProgressBoard`, a tiny Ray actor (no CPU) the driver creates per pipeline run. It
  holds the latest update and a few notes (messages for the user, e.g. a profile summary).
- :class:`ProgressHook`, rank 0's ``after_optimizer_step`` callback: it compares one clock
  reading per step and, at most every ``PROGRESS_PUSH_INTERVAL_S``, sends a fire-and-forget
  update (one ``loss.item()``; no reply awaited). A board that is gone costs one caught
  exception, after which the hook goes quiet: progress never fails a stage.
- :class:`ProgressDisplay`, a driver thread that polls the board and renders: on a terminal
  one line redrawn in place; otherwise (Ray job logs) plain lines, one per stage when it starts
  and ends and in between at most every ``PROGRESS_LINE_INTERVAL_S`` seconds and
  ``train.log_interval`` steps, whichever is rarer.

The driver starts a :class:`ProgressSession` and passes its board down explicitly (stage
session -> ``fit_stage`` -> the workers' loop config); Tune trials run in other processes and
get none (their workers print as before).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from cascade_ray.constants import PROGRESS_LINE_INTERVAL_ENV, PROGRESS_LINE_INTERVAL_S, PROGRESS_PUSH_INTERVAL_S


class ProgressBoard:
    """Latest training progress of a pipeline run, plus notes for the user (a Ray actor).

    Workers call :meth:`push` / :meth:`note` without waiting; the driver polls :meth:`read`.
    """

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None
        self.version = 0
        self.notes: list[str] = []

    def push(self, update: dict[str, Any]) -> None:
        self.latest, self.version = update, self.version + 1

    def note(self, text: str) -> None:
        self.notes.append(text)

    def read(self, seen_notes: int) -> tuple[int, dict[str, Any] | None, list[str]]:
        """(version, latest update, notes after the first `seen_notes`)."""
        return self.version, self.latest, self.notes[seen_notes:]


def send_note(board: Any, text: str) -> None:
    """Show `text` to the user: through the board when there is one, else print it (worker log)."""
    if board is not None:
        try:
            board.note.remote(text)
            return
        except Exception:  # noqa: BLE001 - a board that is gone: fall back to the worker's stdout
            pass
    print(text, flush=True)


class ProgressHook:
    """Rank 0's ``after_optimizer_step`` hook: rate-limited, fire-and-forget pushes to a board.

    Args:
        board: a :class:`ProgressBoard` actor handle.
        stage, index, stages: the stage's name, its position and the pipeline's stage count.
        epochs: planned epochs; samples_per_step: samples one optimizer step consumes on all ranks.
        interval_s: least time between two pushes.
        clock: seconds (monotonic); injectable for tests.
    """

    def __init__(
        self,
        board: Any,
        *,
        stage: str,
        index: int,
        stages: int,
        epochs: int,
        samples_per_step: int,
        interval_s: float = PROGRESS_PUSH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.board, self.interval_s, self.clock = board, interval_s, clock
        self.fixed = {"stage": stage, "index": index, "stages": stages, "epochs": epochs}
        self.samples_per_step = samples_per_step
        self.start: tuple[float, int] | None = None  # (time, step) of the first step this hook saw
        self.last = -math.inf

    def __call__(self, state: Any) -> None:
        if self.board is None or state.rank != 0:
            return
        now = self.clock()
        if self.start is None:
            self.start = (now, state.step)  # rates count from the end of the first step seen
        done = state.step >= state.total_steps
        if now - self.last < self.interval_s and not done and state.step != self.start[1]:
            return  # the common case: one clock reading and a comparison
        self.last = now
        elapsed, steps = now - self.start[0], state.step - self.start[1]
        rate = steps / elapsed if elapsed > 0 else math.nan  # optimizer steps/s, validation time included
        update = self.fixed | {
            "epoch": state.epoch + 1,
            "step": state.step,
            "total_steps": state.total_steps,
            "loss": float(state.loss.detach().float().item()) if state.loss is not None else math.nan,
            "samples_per_s": rate * self.samples_per_step,
            "eta_s": (state.total_steps - state.step) / rate if rate > 0 else math.nan,
            "log_interval": state.stage.train.log_interval,
        }
        try:
            self.board.push.remote(update)
        except Exception:  # noqa: BLE001 - the driver went away or the actor died: train on, quietly
            self.board = None


def format_progress(update: dict[str, Any]) -> str:
    """One progress line, e.g. ``stage 2/3 encoder | epoch 1/2 | step 12/36 | loss 1.2034 | 5120 samples/s | ETA 3 s``."""
    rate = update.get("samples_per_s", math.nan)
    return (
        f"stage {update['index'] + 1}/{update['stages']} {update['stage']} | epoch {update['epoch']}/{update['epochs']} | "
        f"step {update['step']}/{update['total_steps']} | loss {update['loss']:.4f} | {f'{rate:.0f}' if math.isfinite(rate) else '?'} samples/s | "
        f"ETA {_duration(update.get('eta_s', math.nan))}"
    )


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    return (
        f"{seconds} s"
        if seconds < 60
        else f"{seconds // 60}m{seconds % 60:02d}s"
        if seconds < 3600
        else f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
    )


class ProgressDisplay:
    """Renders a board's updates on the driver (see the module docstring for the two styles).

    Args:
        fetch: ``seen_notes -> (version, latest, new notes)``, i.e. a blocking call of
            :meth:`ProgressBoard.read` (injectable so the rendering is testable without Ray).
        stream: where to write (default stdout); tty: live line or plain lines (default: ``stream.isatty()``).
        line_interval_s: least seconds between two plain lines of one stage.
        poll_s: how often the thread polls.
    """

    def __init__(
        self,
        fetch: Callable[[int], tuple[int, dict[str, Any] | None, list[str]]],
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        line_interval_s: float | None = None,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.fetch, self.stream, self.clock = fetch, stream or sys.stdout, clock
        self.tty = self.stream.isatty() if tty is None else tty
        self.line_interval_s = (
            line_interval_s
            if line_interval_s is not None
            else float(os.environ.get(PROGRESS_LINE_INTERVAL_ENV, PROGRESS_LINE_INTERVAL_S))
        )
        self.poll_s = poll_s if poll_s is not None else (0.2 if self.tty else 1.0)
        self.lock, self.poll_lock = threading.Lock(), threading.Lock()
        self.version, self.notes_seen, self.live = 0, 0, ""
        self.latest: dict[str, Any] | None = None
        self.printed: dict[str, Any] | None = None  # the last plain line's update
        self.printed_at = -math.inf
        self._stop = threading.Event()
        self._fetched = threading.Event()  # the board answered once (it exists)
        self._thread: threading.Thread | None = None

    # -- the driver's own lines ------------------------------------------------------------------

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log` with the live line cleared before and redrawn after each line."""

        def wrapped(line: str) -> None:
            # after stop() Ray may be shut down (a poll would start a new one); before the board first
            # answered, a poll would wait for its actor to start (~1 s) and no stage has reported yet
            if not self.tty and not self._stop.is_set() and self._fetched.is_set():
                # a stage's last update belongs before the driver's line about that stage; if the board
                # is gone, the line is printed anyway
                with contextlib.suppress(Exception):
                    self.poll()
            with self.lock:
                self._clear()
                if not self.tty:
                    self._flush_stage()
                log(line)
                self._draw()

        return wrapped

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the display while something else writes to the terminal (e.g. forwarded worker lines)."""
        with self.lock:
            self._clear()
            yield
            self._draw()

    # -- polling ---------------------------------------------------------------------------------

    def poll(self) -> None:
        """Fetch once and render (the driver's thread and its log lines both poll)."""
        with self.poll_lock:
            version, latest, notes = self.fetch(self.notes_seen)
            self._fetched.set()
            self._render(version, latest, notes)

    def _render(self, version: int, latest: dict[str, Any] | None, notes: list[str]) -> None:
        with self.lock:
            self.notes_seen += len(notes)
            if notes:
                self._clear()
                for note in notes:
                    print(note, file=self.stream, flush=True)
            if latest is not None and version != self.version:
                self.version = version
                self._update(latest)
            elif notes:
                self._draw()

    def _update(self, update: dict[str, Any]) -> None:
        previous, self.latest = self.latest, update
        if self.tty:
            self._clear()
            self._draw()
            return
        now = self.clock()
        new_stage = previous is None or previous["stage"] != update["stage"]
        if new_stage and previous is not None and self.printed is not previous:
            self._line(previous, now)  # the end of the previous stage
        done = update["step"] >= update["total_steps"]
        steps_since = (
            update["step"] - self.printed["step"]
            if self.printed is not None and self.printed["stage"] == update["stage"]
            else math.inf
        )
        if (
            new_stage
            or done
            or (now - self.printed_at >= self.line_interval_s and steps_since >= update.get("log_interval", 1))
        ):
            self._line(update, now)

    def _line(self, update: dict[str, Any], now: float) -> None:
        print(format_progress(update), file=self.stream, flush=True)
        self.printed, self.printed_at = update, now

    def _flush_stage(self) -> None:
        if self.latest is not None and self.printed is not self.latest:
            self._line(self.latest, self.clock())

    def _clear(self) -> None:
        if self.tty and self.live:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self.live = ""

    def _draw(self) -> None:
        if self.tty and self.latest is not None:
            self.live = format_progress(self.latest)
            self.stream.write(self.live)
            self.stream.flush()

    # -- the thread --------------------------------------------------------------------------------

    def start(self) -> ProgressDisplay:
        self._thread = threading.Thread(target=self._run, name="cascade-ray-progress", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the board or Ray went away: the run's own errors say why
                return

    def stop(self) -> None:
        """Stop polling, show the last notes and leave the terminal on a fresh line."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(Exception):  # the board is gone: the last notes are lost, the run is not
            self.poll()
        with self.lock:
            self._clear()
            if not self.tty:
                self._flush_stage()


@functools.lru_cache(maxsize=1)
def _remote_board() -> Any:
    """The board's Ray actor class, made once per process: Ray exports (pickles and
    fingerprints) every new actor class, about 0.1 s."""
    import ray

    return ray.remote(num_cpus=0)(ProgressBoard)


class ProgressSession:
    """The board and its display for one pipeline run: :meth:`start` after ``ray.init``, :meth:`stop` before shutdown."""

    def __init__(self, board: Any = None, display: ProgressDisplay | None = None):
        self.board, self.display = board, display

    @classmethod
    def start(cls, show: bool = True, stream: TextIO | None = None) -> ProgressSession:
        """Create the board and display it; pass :attr:`board` to the stages' fits.

        With ``show`` False (``--log-level warning``) there is no board. A board that cannot be
        created leaves the workers printing their progress lines, as Tune trials do.
        """
        if not show:
            return cls()
        import ray

        from cascade_ray.logs import set_print_guard

        try:
            board = _remote_board().remote()
        except Exception as exc:  # noqa: BLE001 - progress is never worth failing a run over
            print(f"note: no progress display ({type(exc).__name__}: {exc})", flush=True)
            return cls()
        display = ProgressDisplay(lambda seen: ray.get(board.read.remote(seen), timeout=10), stream).start()
        set_print_guard(display.paused)  # forwarded worker lines clear the live line first
        return cls(board, display)

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log` that keeps the live line intact (unchanged without a display)."""
        return self.display.wrap(log) if self.display is not None else log

    def stop(self) -> None:
        """Show the last update and notes, stop the thread and the board."""
        if self.board is None:
            return
        from cascade_ray.logs import set_print_guard

        set_print_guard(None)
        if self.display is not None:
            self.display.stop()
        try:
            import ray

            ray.kill(self.board)
        except Exception:  # noqa: BLE001 - Ray already gone
            pass
        self.board = None


def format_trial(
    trial: str,
    state: str,
    *,
    metric: str,
    epoch: int | None = None,
    epochs: int | None = None,
    value: float | None = None,
    best: float | None = None,
    leader: bool = False,
) -> str:
    """One sweep line per trial (a Tune trial, or a replica of a batched sweep), e.g.
    ``trial 3f2a_00001 RUNNING    | epoch 2/4 | val_accuracy 0.9132 | best 0.9200 *``;
    ``*`` marks the trial holding the sweep's best so far, ``-`` what is not known yet."""

    def num(x: float | None) -> str:
        return f"{x:.4f}" if x is not None and math.isfinite(x) else "-"

    done = f"{epoch if epoch is not None else 0}/{epochs if epochs is not None else '?'}"
    return (
        f"trial {trial} {state:<10} | epoch {done} | {metric} {num(value)} | best {num(best)}{' *' if leader else ''}"
    )
