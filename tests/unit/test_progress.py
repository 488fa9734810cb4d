"""Progress (no Ray): rank 0's rate-limited pushes, the driver's plain and live rendering, hook chaining."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import pytest
import torch

from cascade_ray.stage.hooks import LoopHooks, chain_hooks
from cascade_ray.stage.progress import ProgressDisplay, ProgressHook, format_progress


class FakeBoard:
    """Records what a ProgressHook sends; `dead` makes every call raise like a killed actor."""

    def __init__(self, dead: bool = False):
        self.updates: list[dict] = []
        self.calls = 0
        self.push = SimpleNamespace(remote=self._push)
        self.dead = dead

    def _push(self, update):
        self.calls += 1
        if self.dead:
            raise RuntimeError("actor died")
        self.updates.append(update)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _state(step: int, total: int = 100, epoch: int = 0, rank: int = 0):
    return SimpleNamespace(
        rank=rank,
        step=step,
        total_steps=total,
        epoch=epoch,
        loss=torch.tensor(0.5),
        stage=SimpleNamespace(train=SimpleNamespace(log_interval=10)),
    )


def _hook(board, clock):
    return ProgressHook(
        board, stage="encoder", index=1, stages=3, epochs=2, samples_per_step=64, interval_s=0.5, clock=clock
    )


def test_pushes_are_rate_limited_by_time_and_include_the_first_and_last_step():
    board, clock = FakeBoard(), Clock()
    hook = _hook(board, clock)
    for step in range(1, 101):
        clock.now += 0.02  # 50 steps/s
        hook(_state(step))
    pushed = [u["step"] for u in board.updates]
    assert pushed[0] == 1 and pushed[-1] == 100
    assert 4 <= len(pushed) <= 6  # 2 s of training at most every 0.5 s, plus first and last
    last = board.updates[-1]
    assert last["samples_per_s"] == pytest.approx(50 * 64) and last["eta_s"] == 0 and last["loss"] == 0.5
    assert math.isnan(board.updates[0]["samples_per_s"])  # no rate before a second step
    assert (last["stage"], last["index"], last["stages"], last["epochs"], last["total_steps"]) == (
        "encoder",
        1,
        3,
        2,
        100,
    )


def test_a_dead_board_never_fails_the_stage_and_is_not_called_again():
    board, clock = FakeBoard(dead=True), Clock()
    hook = _hook(board, clock)
    for step in range(1, 50):
        clock.now += 1.0
        hook(_state(step))
    assert board.calls == 1 and hook.board is None


def test_only_rank_zero_pushes():
    board, clock = FakeBoard(), Clock()
    hook = _hook(board, clock)
    hook(_state(1, rank=1))
    assert board.calls == 0


def _update(stage="features", index=0, step=1, total=72, epoch=1):
    return {
        "stage": stage,
        "index": index,
        "stages": 3,
        "epoch": epoch,
        "epochs": 2,
        "step": step,
        "total_steps": total,
        "loss": 1.25,
        "samples_per_s": 5000.0,
        "eta_s": 75.0,
        "log_interval": 10,
    }


class Script:
    """A fetch function that replays board states."""

    def __init__(self):
        self.version, self.latest, self.notes = 0, None, []

    def set(self, update):
        self.version, self.latest = self.version + 1, update

    def __call__(self, seen):
        return self.version, self.latest, self.notes[seen:]


def test_format_progress_names_stage_epoch_step_loss_rate_and_eta():
    assert (
        format_progress(_update(step=12))
        == "stage 1/3 features | epoch 1/2 | step 12/72 | loss 1.2500 | 5000 samples/s | ETA 1m15s"
    )
    assert "? samples/s | ETA ?" in format_progress(_update() | {"samples_per_s": math.nan, "eta_s": math.nan})


def test_plain_lines_first_update_then_the_rarer_of_interval_and_log_interval_then_stage_end():
    script, clock, out = Script(), Clock(), io.StringIO()
    display = ProgressDisplay(script, out, tty=False, line_interval_s=10.0, clock=clock)
    for step, dt in [(1, 0), (3, 4), (5, 7), (8, 1), (14, 0.5), (20, 12)]:
        clock.now += dt
        script.set(_update(step=step))
        display.poll()
    # 1: first of the stage; 5: 11 s later but only 4 steps (< log_interval 10); 14: 10 steps, 12.5 s later
    script.set(_update(step=30))
    display.poll()  # 30: 10 more steps but only 0 s later: not yet
    script.set(_update(stage="encoder", index=1, step=1, total=36))
    display.poll()  # a new stage: the previous stage's last update first
    script.notes.append("profile of stage 'encoder': ...")
    display.poll()
    display.wrap(out.write)("  encoder trained\n")
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[2] if " | " in line else line for line in lines] == [
        "step 1/72",
        "step 14/72",
        "step 30/72",
        "step 1/36",
        "profile of stage 'encoder': ...",
        "  encoder trained",
    ]
    assert lines[3].startswith("stage 2/3 encoder |")


def test_driver_lines_after_stop_never_poll_the_board():
    """After the pipeline's stop (Ray shut down), a poll would start a new local Ray instance."""
    script, out = Script(), io.StringIO()
    display = ProgressDisplay(script, out, tty=False)
    script.set(_update(step=72))
    display.stop()
    polled = []
    display.fetch = lambda seen: polled.append(seen)
    display.wrap(lambda line: print(line, file=out))("summary table")
    assert polled == [] and out.getvalue().splitlines()[-1] == "summary table"


def test_plain_mode_prints_the_last_step_of_a_stage():
    script, clock, out = Script(), Clock(), io.StringIO()
    display = ProgressDisplay(script, out, tty=False, line_interval_s=10.0, clock=clock)
    for step in (1, 2, 72):
        script.set(_update(step=step))
        display.poll()
    assert [line.split(" | ")[2] for line in out.getvalue().splitlines()] == ["step 1/72", "step 72/72"]


def test_live_line_is_redrawn_in_place_and_driver_lines_do_not_tear_it():
    script, out = Script(), io.StringIO()
    display = ProgressDisplay(script, out, tty=True)
    script.set(_update(step=1))
    display.poll()
    script.set(_update(step=2))
    display.poll()
    display.wrap(lambda line: print(line, file=out))("stage 2/3: encoder")
    display.stop()
    text = out.getvalue()
    assert text.count("\r\x1b[2K") == 3  # before the redraw, before the driver line, at stop
    assert "\r\x1b[2Kstage 2/3: encoder\nstage 1/3 features | epoch 1/2 | step 2/72" in text
    assert text.endswith("\r\x1b[2K")


def test_chain_hooks_runs_every_callback_in_order_and_keeps_the_last_single_slot():
    calls = []
    first = LoopHooks(after_optimizer_step=lambda s: calls.append("a"), on_log=lambda s: calls.append("log1"))
    second = LoopHooks(
        after_optimizer_step=lambda s: calls.append("b"),
        on_setup=lambda s: calls.append("setup"),
        on_log=lambda s: calls.append("log2"),
    )
    hooks = chain_hooks(first, second, LoopHooks())
    hooks.on_setup(None)
    hooks.after_optimizer_step(None)
    hooks.on_log(None)
    assert calls == ["setup", "a", "b", "log2"]
    assert chain_hooks(LoopHooks()).on_log is None  # nobody took the progress line: the loop prints it
    single = LoopHooks(after_backward=print)
    assert chain_hooks(single, LoopHooks()).after_backward is print  # no wrapper on the per-step path
