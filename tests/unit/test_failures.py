"""A stage's worker failures from outside the training code, told with the stage, the path and the fix."""

from __future__ import annotations

import errno
import pickle

import ray.exceptions
import ray.train
from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

from cascade_ray.errors import StageFailedError
from cascade_ray.pipeline.failures import stage_failure


def test_a_full_disk_names_the_stage_the_storage_and_no_space():
    # what pyarrow raised in tests/e2e/test_faults.py (storage_full), wrapped as Ray Train wraps it
    disk = OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
    wrapped = RuntimeError("checkpoint upload failed")
    wrapped.__cause__ = disk
    error = stage_failure([wrapped], "head", 1, "/mnt/runs/faults/ray")
    assert isinstance(error, StageFailedError)
    text = str(error)
    assert text.startswith("stage 'head': no space left") and "/mnt/runs/faults/ray" in text
    assert "--resume" in text
    assert str(pickle.loads(pickle.dumps(error))) == text  # it crosses process boundaries


def test_a_killed_worker_names_the_stage_and_suggests_memory():
    died = WorkerHealthCheckFailedError("Worker health check failed", ray.exceptions.ActorDiedError())
    text = str(stage_failure([died], "head", 1, "/runs"))
    assert text.startswith("stage 'head': a worker process died") and "out-of-memory" in text
    assert "stages[1].train.batch_size" in text and "stages[1].scaling.resources_per_worker.memory" in text


def test_other_failures_keep_rays_error():
    assert stage_failure([ValueError("bad"), OSError(errno.ENOENT, "gone")], "head", 1, "/runs") is None


def test_unreachable_storage_names_the_stage_and_the_storage():
    # Ray Train's check before a checkpoint upload, as the S3 restart in tests/e2e/test_faults.py hit it
    down = RuntimeError("Unable to set up cluster storage with the following settings:\n<StorageContext ...>")
    text = str(stage_failure([down], "head", 1, "s3://cascade/restart/faults/ray"))
    assert text.startswith("stage 'head': the storage s3://cascade/restart/faults/ray could not be read back")
    assert "--resume" in text and "stages[1].max_failures" in text


def test_errors_a_restart_would_repeat_are_found_behind_rays_wrappers_and_crashes_are_not():
    """NoRetry (the Train controller's callback) ends a fit at a training health error or frozen drift a
    worker raised, whatever max_failures allows; a killed worker, a node-dependent error or another error
    is Ray's to retry."""
    import pytest
    import ray.exceptions

    from cascade_ray.errors import ConfigError, ConfigIssue, FrozenDriftError, HealthError
    from cascade_ray.pipeline.no_retry import NoRetry, not_retried

    health = HealthError("nonfinite", "encoder", 3, "loss is nan", "stages[1].solver.lr", "lower the lr")
    wrapped = ray.exceptions.RayTaskError("train_fn", "Traceback ...", health).as_instanceof_cause()
    assert not_retried({0: RuntimeError("other rank"), 1: wrapped}.values()) is health
    drift = FrozenDriftError("stage 'encoder': 1 frozen tensor(s) changed")
    try:
        raise RuntimeError("the loop's wrapper") from drift
    except RuntimeError as exc:
        assert not_retried([exc]) is drift
    # a worker's config error depends on its node (the driver checked the config): a pretrained file that
    # node cannot read, a GPU without bf16; so does the emulated-bf16 rule: Ray's to retry, as a crash
    config = ConfigError([ConfigIssue("stages[1].pretrained", "cannot read '/nfs/w.safetensors': EIO")])
    device = HealthError("emulated_bf16", "encoder", 0, "bf16 is emulated here", "stages[1].solver.precision", "fp32")
    assert not_retried([config, device.__class__(*device.__reduce__()[1])]) is None
    assert not_retried([ray.exceptions.ActorDiedError(), OSError("connection reset"), RuntimeError("x")]) is None
    with pytest.raises(HealthError):
        NoRetry().after_exception(None, {1: wrapped})
    NoRetry().after_exception(None, {0: ray.exceptions.ActorDiedError()})  # left to max_failures


def test_an_error_whose_cause_attribute_is_text_is_summarised_not_crashed_on():
    """Tune's trial-abort error (a failed actor reset) carries its reason as a ``cause`` string."""
    from cascade_ray.pipeline.failures import error_message

    class Aborted(RuntimeError):
        def __init__(self, text: str):
            super().__init__(text)
            self.cause = text

    assert error_message(Aborted("reset failed")) == "Aborted: reset failed"


def _worker_group_error(fn):
    """The WorkerGroupError Ray Train 2.60 ends a fit with when the train function raised: the worker's
    exception in ``worker_failures`` (no traceback), its traceback text in the message."""
    import traceback

    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the failure under test
        text = f"[Rank 0 Error Snippet]:\n{traceback.format_exc()}"
        return ray.train.WorkerGroupError(text, {0: exc.with_traceback(None)})
    raise AssertionError("fn did not raise")


def _user_module_step():
    import torch
    from torch import nn

    nn.BatchNorm1d(4).train()(torch.zeros(1, 4))  # the user's line: a training batch of one row


def test_an_exception_in_the_training_code_names_its_first_line_the_users_frame_and_a_known_fix():
    from cascade_ray.pipeline.failures import training_error

    error = training_error(_worker_group_error(_user_module_step), "classifier", 2)
    assert isinstance(error, StageFailedError)
    text = str(error)
    assert text.startswith("stage 'classifier': the training raised ValueError: Expected more than 1 value per channel")
    assert "test_failures.py:" in text and "in _user_module_step)" in text, text  # not torch's frame
    assert "stages[2].train.batch_size" in error.fix and "BatchNorm" in error.fix and "--resume" in error.fix
    assert str(pickle.loads(pickle.dumps(error))) == text
    died = WorkerHealthCheckFailedError("Worker health check failed", ray.exceptions.ActorDiedError())
    assert training_error(ray.train.WorkerGroupError("x", {0: died}), "classifier", 2) is None  # Ray's error stays


def test_the_workers_note_names_the_users_frame_even_when_rays_text_lost_it():
    """Ray's error text cuts a long traceback's middle, where the user's frame usually is; the worker's note
    (added in train_loop_per_worker, kept through pickling) still names it."""
    from cascade_ray.pipeline.failures import training_error
    from cascade_ray.stage.raised import mark_raised_at

    try:
        _user_module_step()
    except ValueError as exc:
        mark_raised_at(exc)
        raised = pickle.loads(pickle.dumps(exc))  # as it crosses from the worker
    cut = "[Rank 0 Error Snippet]:\nTraceback (most recent call last):\n... (Output truncated) ...\nValueError: x"
    text = str(training_error(ray.train.WorkerGroupError(cut, {0: raised}), "classifier", 2))
    assert "test_failures.py:" in text and "in _user_module_step)" in text, text


def test_the_users_frame_is_not_the_standard_librarys_nor_cascade_rays():
    """random.choice([]) in a user's forward is the user's line, not random.py's."""
    import random
    import sysconfig

    from cascade_ray.stage import raised
    from cascade_ray.stage.raised import own_frame

    user = ("/home/me/mypkg/stages.py", 12, "forward")
    stdlib = (random.__file__, 378, "choice")
    package = (raised.__file__, 30, "mark_raised_at")
    assert random.__file__.startswith(sysconfig.get_paths()["stdlib"])
    assert own_frame([user, stdlib]) == user and own_frame([user, package]) == user
    assert own_frame([stdlib, package]) is None


def test_an_unfinished_runs_status_keeps_a_long_first_word_of_its_error():
    from cascade_ray.pipeline.records import RunSummary

    summary = RunSummary.model_construct(status="failed", stages=[], error="OSError: s3://" + "x" * 300)
    assert summary.describe().startswith("failed (OSError: s3://xxx") and len(summary.describe()) < 230
