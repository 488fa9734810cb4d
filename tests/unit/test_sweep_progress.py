"""The sweep's progress lines: one per trial, plain lines in job logs, a block redrawn on a terminal.

Tune's hooks are called here as its controller calls them (trials are plain objects with the two
attributes the callback reads), so the rendering is checked without Ray; the integration sweep
(tests/integration/test_tune.py) checks the lines of a real one.
"""

from __future__ import annotations

import io
import pickle
from types import SimpleNamespace

from cascade_ray import logs
from cascade_ray.stage.progress import format_trial
from cascade_ray.tune.progress import SweepBoard, SweepProgress


def _trials(*ids: str, status: str = "PENDING") -> list[SimpleNamespace]:
    return [SimpleNamespace(trial_id=t, status=status) for t in ids]


def _sweep(progress: SweepProgress) -> None:
    """Two trials of 2 epochs each; the controller loop steps several times between events."""
    a, b = _trials("a_00000", "b_00001")
    progress.setup()
    for _ in range(3):
        progress.on_step_end(0, [a, b])  # PENDING, once each however often the loop steps
    a.status = "RUNNING"
    progress.on_trial_start(1, [a, b], a)
    progress.on_step_end(1, [a, b])
    progress.on_trial_result(2, [a, b], a, {"epoch": 1, "val_accuracy": 0.5})
    progress.on_trial_result(2, [a, b], a, {"epoch": 1, "val_accuracy": 0.5})  # same epoch: no new line
    b.status = "RUNNING"
    progress.on_trial_start(3, [a, b], b)
    progress.on_trial_result(4, [a, b], b, {"epoch": 1, "val_accuracy": 0.7})
    progress.on_trial_result(5, [a, b], a, {"epoch": 2, "val_accuracy": 0.6})
    a.status = "TERMINATED"
    progress.on_trial_complete(6, [a, b], a)
    b.status = "ERROR"
    progress.on_trial_error(7, [a, b], b)
    progress.on_experiment_end([a, b])


def test_a_trial_line_names_state_epoch_metric_and_best():
    line = format_trial("a_00000", "RUNNING", metric="val_loss", epoch=2, epochs=4, value=0.31, best=0.25, leader=True)
    assert line == "trial a_00000 RUNNING    | epoch 2/4 | val_loss 0.3100 | best 0.2500 *"
    assert format_trial("b", "PENDING", metric="val_loss") == "trial b PENDING    | epoch 0/? | val_loss - | best -"


def test_the_board_keeps_each_trials_best_by_the_mode_and_the_sweeps_leader():
    board = SweepBoard("val_loss", "min", epochs=3)
    assert board.update("a", state="RUNNING")
    assert board.update("a", result={"epoch": 1, "val_loss": 0.5})
    assert not board.update("a", result={"epoch": 1, "val_loss": 0.5})  # nothing a log line would show changed
    board.update("a", result={"epoch": 2, "val_loss": 0.7})
    board.update("b", result={"epoch": 1, "val_loss": 0.6, "config": {"train.epochs": 5}})
    assert (board.rows["a"].value, board.rows["a"].best) == (0.7, 0.5)
    assert board.leader() == "a" and board.rows["b"].epochs == 5
    assert board.lines() == [
        "trial a RUNNING    | epoch 2/3 | val_loss 0.7000 | best 0.5000 *",
        "trial b PENDING    | epoch 1/5 | val_loss 0.6000 | best 0.6000",
    ]


def test_job_logs_get_a_line_per_trial_at_each_state_or_epoch_change():
    out = io.StringIO()
    _sweep(SweepProgress("val_accuracy", "max", 2, stream=out, tty=False))
    assert out.getvalue().splitlines() == [
        "trial a_00000 PENDING    | epoch 0/2 | val_accuracy - | best -",
        "trial b_00001 PENDING    | epoch 0/2 | val_accuracy - | best -",
        "trial a_00000 RUNNING    | epoch 0/2 | val_accuracy - | best -",
        "trial a_00000 RUNNING    | epoch 1/2 | val_accuracy 0.5000 | best 0.5000 *",
        "trial b_00001 RUNNING    | epoch 0/2 | val_accuracy - | best -",
        "trial b_00001 RUNNING    | epoch 1/2 | val_accuracy 0.7000 | best 0.7000 *",
        "trial a_00000 RUNNING    | epoch 2/2 | val_accuracy 0.6000 | best 0.6000",
        "trial a_00000 TERMINATED | epoch 2/2 | val_accuracy 0.6000 | best 0.6000",
        "trial b_00001 ERROR      | epoch 1/2 | val_accuracy 0.7000 | best 0.7000 *",
    ]
    assert "\x1b" not in out.getvalue()


def test_a_terminal_gets_the_block_redrawn_in_place_and_worker_lines_above_it():
    out = io.StringIO()
    guard_before = logs.print_guard()
    progress = SweepProgress("val_accuracy", "max", 2, stream=out, tty=True)
    a, b = _trials("a_00000", "b_00001", status="RUNNING")
    progress.setup()
    assert logs.print_guard() == progress.paused  # forwarded worker lines clear the block first
    progress.on_step_end(0, [a, b])
    progress.on_trial_result(1, [a, b], a, {"epoch": 1, "val_accuracy": 0.5})
    with logs.print_guard()():
        out.write("(RayTrainWorker) a worker line\n")
    a.status = b.status = "TERMINATED"
    progress.on_experiment_end([a, b])
    assert logs.print_guard() is guard_before  # restored after the sweep
    text = out.getvalue()
    assert text.count("\x1b[2F\x1b[J") >= 3  # every redraw starts at the block's first line
    final = text.rsplit("\x1b[J", 1)[1].splitlines()  # what the screen shows at the end
    assert final == [
        "trial a_00000 TERMINATED | epoch 1/2 | val_accuracy 0.5000 | best 0.5000 *",
        "trial b_00001 TERMINATED | epoch 0/2 | val_accuracy - | best -",
    ]
    worker = text.index("a worker line")
    assert text.rfind("\x1b[2F\x1b[J", 0, worker) > text.rfind("trial", 0, worker)  # block cleared first


def test_the_callback_pickles_without_its_stream():
    """Tune pickles the run config (its callbacks) with the experiment, for a restore."""
    progress = SweepProgress("val_accuracy", "max", 2, stream=io.StringIO(), tty=False)
    progress.on_step_end(0, _trials("a"))
    copy = pickle.loads(pickle.dumps(progress))
    assert copy.stream_ is None and copy.board.lines() == progress.board.lines()


def test_a_resumed_sweeps_finished_trials_show_the_epochs_they_reported():
    """A restored experiment's finished trials report nothing more: their lines come from what Tune restored
    with them (the last result, the metric's best), not "epoch 0/2 | val_accuracy -"; a trial that had not
    finished starts from nothing as before."""
    done = SimpleNamespace(
        trial_id="a_00000",
        status="TERMINATED",
        last_result={"epoch": 2, "val_accuracy": 0.6, "trial_id": "a_00000"},
        metric_analysis={"val_accuracy": {"max": 0.7, "min": 0.6, "avg": 0.65, "last": 0.6}},
    )
    again = SimpleNamespace(trial_id="b_00001", status="PENDING", last_result={"trial_id": "b_00001"})
    out = io.StringIO()
    progress = SweepProgress("val_accuracy", "max", 2, stream=out, tty=False)
    progress.on_step_end(0, [done, again])
    progress.on_step_end(1, [done, again])  # nothing changed: no more lines
    assert out.getvalue().splitlines() == [
        "trial a_00000 TERMINATED | epoch 2/2 | val_accuracy 0.6000 | best 0.7000 *",
        "trial b_00001 PENDING    | epoch 0/2 | val_accuracy - | best -",
    ]
    lost = SimpleNamespace(trial_id="c", status="ERROR", last_result={"trial_id": "c"}, metric_analysis={})
    board = SweepProgress("val_loss", "min", 3, stream=io.StringIO(), tty=False)
    board.on_step_end(0, [lost])  # finished before its first report: nothing to show but its state
    assert board.board.lines() == ["trial c ERROR      | epoch 0/3 | val_loss - | best -"]
    # every trial had finished: Tune goes straight to the experiment's end, with no step
    ended = io.StringIO()
    SweepProgress("val_accuracy", "max", 2, stream=ended, tty=False).on_experiment_end([done])
    assert ended.getvalue().splitlines() == [
        "trial a_00000 TERMINATED | epoch 2/2 | val_accuracy 0.6000 | best 0.7000 *"
    ]


def test_a_nan_epoch_is_shown_as_the_value_never_as_the_best():
    """Tune's metric_analysis keeps max(value, old), so one NaN epoch can leave it NaN: the restored
    trial's best then comes from its finite values only, and a NaN result never becomes the best."""
    board = SweepBoard("val_accuracy", "max", epochs=2)
    board.update("a", result={"epoch": 1, "val_accuracy": 0.5})
    board.update("a", result={"epoch": 2, "val_accuracy": float("nan")})
    assert board.lines() == ["trial a PENDING    | epoch 2/2 | val_accuracy - | best 0.5000 *"]
    restored = SimpleNamespace(
        trial_id="b",
        status="ERROR",
        last_result={"epoch": 1, "val_accuracy": float("nan")},
        metric_analysis={"val_accuracy": {"max": float("nan")}},
    )
    progress = SweepProgress("val_accuracy", "max", 2, stream=io.StringIO(), tty=False)
    progress.on_step_end(0, [restored])
    assert progress.board.rows["b"].best is None
