"""The start-up phases a stage fit records (cascade_ray/stage/startup.py)."""

from __future__ import annotations

import os
import time

from cascade_ray.stage.startup import PHASES, StartupClock, process_start_time


def test_this_process_started_before_now_and_after_boot():
    started = process_start_time()
    assert started is not None and started <= time.time()
    with open("/proc/uptime") as f:
        assert started >= time.time() - float(f.read().split()[0]) - 1
    assert process_start_time(os.getppid()) <= started  # the parent started first


def test_phases_add_up_to_the_first_step_and_keep_the_first_mark():
    fit = time.time() - 5.0
    clock = StartupClock(fit)
    clock.marks["process"] = fit + 2.0
    clock.marks["loop"] = fit + 3.0
    clock.marks["inputs"] = fit + 3.5
    clock.on_setup(None)
    clock.marks["setup"] = fit + 4.0
    clock.marks["first_step"] = fit + 4.25
    clock.after_optimizer_step(None)  # a later step does not move the first-step mark
    record = clock.record()
    assert record == {
        "ray_train_s": 2.0,
        "worker_start_s": 1.0,
        "inputs_s": 0.5,
        "setup_s": 0.5,
        "first_step_s": 0.25,
        "to_first_step_s": 4.25,
    }
    assert sum(record[p] for p in PHASES) == record["to_first_step_s"]


def test_a_missing_mark_folds_its_phase_into_the_next_and_no_fit_time_records_nothing():
    fit = time.time() - 3.0
    clock = StartupClock(fit)
    clock.marks["process"] = None  # no /proc
    clock.marks["loop"] = fit + 2.0
    assert clock.record() == {"worker_start_s": 2.0}  # no step taken: no first-step figures
    assert StartupClock(None).record() is None
