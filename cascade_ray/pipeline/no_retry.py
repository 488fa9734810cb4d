"""Worker failures a restart would only repeat end a stage's fit at once, not after ``max_failures`` restarts.

Ray Train 2.60 restarts a worker group after any worker exception while ``max_failures`` allows
(``-1``: for ever), from the latest checkpoint. That is right for a node that died, and wrong for
an error the stage's config, numbers or code decide: a training health rule with policy ``error`` (a
loss that is NaN from this checkpoint on), frozen drift (a module that writes its own state).
Restarted, these fail again the same way, after each restart's start-up and
the steps since the checkpoint; with ``max_failures: -1`` the stage never ends.

:class:`NoRetry` is a ``ray.train.UserCallback`` (Ray's callback interface for user code, called in
the Train controller's process). When a worker's exception is one of those (:func:`repeats`), it raises
it from ``after_exception``: Ray routes an error raised by a callback through its failure policy as
a controller error, which it does not retry, and ``trainer.fit()`` raises
``ray.train.ControllerError`` with the error as its ``controller_failure``
(:func:`cascade_ray.pipeline.fit.fit_stage` re-raises the error itself). This relies on Ray 2.60
calling user callbacks from the worker group's poll, outside its controller-callback manager
(``execution/worker_group/worker_group.py``, ``callbacks/user_callback.py``); should a later Ray
catch a callback's error instead, these errors are retried as before and nothing else changes.

Kept light: the controller unpickles the callback, so this module imports only Ray Train and
:mod:`cascade_ray.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray.train

from cascade_ray.errors import CascadeError, FrozenDriftError, HealthError, innermost

# the health rules whose firing the stage's config, data and code decide, not the node or device it ran on
# (``emulated_bf16`` depends on the CPU a worker got: not here); "batched": every replica of a batched
# sweep failed by these
TRAINING_RULES = frozenset(
    {"nonfinite", "grad_flow", "stall", "clip_saturation", "scale_collapse", "lr_drift", "batched"}
)


def repeats(error: BaseException) -> bool:
    """Whether a restart from the latest checkpoint would raise `error` again: frozen drift, or a health
    rule of :data:`TRAINING_RULES`. A config error a worker raises is not: the driver checked the config
    first, so in a worker it depends on the node (a pretrained file it cannot read, a GPU without bf16)."""
    return isinstance(error, FrozenDriftError) or (isinstance(error, HealthError) and error.rule in TRAINING_RULES)


def not_retried(failures: Iterable[BaseException]) -> CascadeError | None:
    """The error behind the first of `failures` (workers' exceptions, as Ray wraps them) that a restart
    would repeat (:func:`repeats`): the innermost one, not Ray's wrapper of it (``RayTaskError(HealthError)``
    is a ``HealthError`` too, with Ray's traceback in its text)."""
    for failure in failures:
        found = innermost(failure, repeats)
        if found is not None:
            return found
    return None


class NoRetry(ray.train.UserCallback):
    """End the fit at the first worker error a restart would repeat (:func:`repeats`; see the module docstring)."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        error = not_retried(worker_exceptions.values())
        if error is not None:
            raise error
