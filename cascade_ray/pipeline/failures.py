"""A failed stage fit, told as what happened and what to do, when the cause is not cascade-ray's own.

Ray Train 2.60 ends a fit whose workers failed (out of ``max_failures`` restarts) with a
``WorkerGroupError`` holding each failed worker's exception. Two causes come from outside the
training code and deserve their own message: a worker process that died without an exception
(Ray's ``ActorDiedError``: a signal, nearly always SIGKILL from the kernel's out-of-memory killer),
storage that is full (``ENOSPC`` while a checkpoint is written) and storage that could not be
reached (Ray's storage check before a checkpoint upload). An exception the training code raised
(a user's module, a torch op it called) ends as the exception's last line and the frame it came from
(:func:`training_error`); only a failure with no traceback keeps Ray's error.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Iterable, Iterator
from typing import Any

import ray.exceptions

from cascade_ray.errors import CascadeError, StageFailedError
from cascade_ray.ray_compat import worker_failure_cause
from cascade_ray.stage.raised import own_frame, raised_at

_NO_SPACE = "No space left on device"
# Ray Train 2.60 (storage.py, public message): the storage check before each checkpoint upload failed
_UNREACHABLE = "Unable to set up cluster storage"


def stage_failure(failures: Iterable[BaseException], stage: str, index: int, storage: str) -> StageFailedError | None:
    """A :class:`StageFailedError` for `failures` (the workers' exceptions) when the cause is full
    storage or a killed worker process; None otherwise.

    Args:
        failures: the exceptions of the failed workers (``WorkerGroupError.worker_failures.values()``).
        stage: the stage's name.
        index: the stage's index in ``stages``.
        storage: where the stage writes (its Ray Train storage folder), named in the message.
    """
    chains = [list(_chain(f)) for f in failures]
    for seen in (e for chain in chains for e in chain):
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or _NO_SPACE in str(seen):
            return StageFailedError(
                stage,
                f"no space left on the storage: a write under {storage} failed ({_first_line(seen)[:300]})",
                "free space there or point storage_path at a larger volume, then rerun with --resume "
                "(finished stages are reused)",
            )
    for seen in (e for chain in chains for e in chain):
        if _UNREACHABLE in str(seen):
            return StageFailedError(
                stage,
                f"the storage {storage} could not be read back while a checkpoint was written (the server or "
                "network was down, or this node cannot reach it)",
                "check that every node reaches the storage (server up, network, credentials), then rerun with "
                f"--resume (finished stages are reused); stages[{index}].max_failures retries the stage in place",
            )
    for seen in (e for chain in chains for e in chain):
        if isinstance(seen, ray.exceptions.ActorDiedError | ray.exceptions.WorkerCrashedError):
            return StageFailedError(
                stage,
                "a worker process died without raising an exception (killed by a signal; SIGKILL is usually "
                "the kernel's out-of-memory killer: check `dmesg` / the node's memory)",
                f"use less memory per worker: lower stages[{index}].train.batch_size or the model size, run "
                f"fewer workers per node, or give them more memory (stages[{index}].scaling.resources_per_worker"
                f".memory reserves it); stages[{index}].max_failures restarts the worker group from its last "
                "checkpoint; rerun with --resume (finished stages are reused)",
            )
    return None


# the frames of a worker's traceback in Ray Train 2.60's WorkerGroupError text ("[Rank 0 Error Snippet]:",
# the traceback with its middle cut when long; its public message) and the package's own folder
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_SNIPPET = re.compile(r"^\[Rank [0-9,]+ Error Snippet\]:$", re.MULTILINE)
# known messages of errors raised inside torch by a user's module -> what in the config causes them
_HINTS = (
    (
        "Expected more than 1 value per channel when training",
        "a training batch of 1 sample reached a BatchNorm layer: an epoch's last batch holds the rows left "
        "after the full batches, so pick stages[{index}].train.batch_size so that a worker's training rows "
        "modulo batch_size is not 1",
    ),
)


def training_error(exc: BaseException, stage: str, index: int) -> StageFailedError | None:
    """A :class:`StageFailedError` for an exception the training code raised in a worker (a user's module,
    a torch op it called), from Ray Train's ``WorkerGroupError`` `exc`: the worker's exception (type and
    first line) and the deepest frame of its traceback outside torch, Ray and cascade-ray, where the fix
    most likely is (the worker's note, :mod:`cascade_ray.stage.raised`; else the frames left in Ray's text). None when no worker's error has a traceback (Ray's error stays). The whole traceback stays
    where Ray Train logged it ("Error in training function", above in the driver's output)."""
    failures = list((getattr(exc, "worker_failures", None) or {}).values())
    first = (_SNIPPET.split(str(exc)) + [""])[1]  # the first rank group's error
    if not failures or "Traceback (most recent call last)" not in first:
        return None  # no exception was raised (a health-check failure, a killed process)
    raised = failures[0]
    said = f"{type(raised).__name__}: {_first_line(raised)[:500]}"
    own = own_frame(_FRAME.findall(first))  # when the worker's note is missing (a Python 3.10 worker)
    at = raised_at(raised) or (f"{own[0]}:{own[1]}, in {own[2]}" if own else None)
    where = f" (at {at})" if at else ""
    hint = next((h.format(index=index) for known, h in _HINTS if known in said), None)
    fix = (
        "fix the code or the config it points at (the worker's whole traceback is above, after "
        '"Error in training function"), then rerun with --resume (finished stages are reused)'
    )
    return StageFailedError(stage, f"the training raised {said}{where}", f"{hint}; or {fix}" if hint else fix)


def error_message(exc: BaseException) -> str:
    """What went wrong in `exc`, for a table or a log line: the message of the cascade-ray error
    behind it (Ray's task and Tune's trial wrappers unwrapped), else the first line of the
    innermost cause, with its type."""
    chain = list(_chain(exc))
    for seen in chain:
        if isinstance(seen, CascadeError) and not isinstance(seen, ray.exceptions.RayError):
            return str(seen)
    return f"{type(chain[-1]).__name__}: {_first_line(chain[-1])}"


def _chain(exc: Any) -> Iterator[Any]:
    """`exc`, then what caused it (a health-check failure's error, Ray's ``cause``, ``__cause__``), at most 20 deep."""
    for _ in range(20):
        if exc is None:
            return
        yield exc
        causes = (worker_failure_cause(exc), getattr(exc, "cause", None), exc.__cause__, exc.__context__)
        exc = next((c for c in causes if isinstance(c, BaseException)), None)  # some errors' `cause` is text


def _first_line(exc: Any) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        if _NO_SPACE in line:
            return line.strip()
    return text.splitlines()[0] if text else type(exc).__name__
