"""Worker failures a restart would only repeat end a stage's fit at once, not after ``max_failures`` restarts.

Ray Train 2.60 restarts a worker group after any worker exception while ``max_failures`` allows
(``-1``: for ever), from the latest checkpoint. That is right for a node that died, and wrong for
an error the stage's config, numbers or code decide: a health rule with policy ``error`` (a loss
that is NaN from this checkpoint on), frozen drift (a module that writes its own state), a config
the worker rejects. Restarted, these fail again the same way, after each restart's start-up and
the steps since the checkpoint; with ``max_failures: -1`` the stage never ends.

:class:`NoRetry` is a ``ray.train.UserCallback`` (Ray's callback interface for user code, called in
the Train controller's process). When a worker's exception is one of :data:`NOT_RETRIED`, it raises
it from ``after_exception``: Ray routes an error raised by a callback through its failure policy as
a controller error, which it does not retry, and ``trainer.fit()`` raises
``ray.train.ControllerError`` with the error as its ``controller_failure``
(:func:`cascade_ray.pipeline.fit.fit_stage` re-raises the error itself).

Kept light: the controller unpickles the callback, so this module imports only Ray Train and
:mod:`cascade_ray.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import ray.train

from cascade_ray.errors import CascadeError, ConfigError, FrozenDriftError, HealthError

# decided by the stage's config, numbers or code, not by the node it ran on
NOT_RETRIED: tuple[type[CascadeError], ...] = (HealthError, FrozenDriftError, ConfigError)


def not_retried(failures: Iterable[BaseException]) -> CascadeError | None:
    """The error behind the first of `failures` (workers' exceptions, as Ray wraps them) that is one of
    :data:`NOT_RETRIED`: the innermost one, not Ray's wrapper of it (``RayTaskError(HealthError)`` is a
    ``HealthError`` too, with Ray's traceback in its text)."""
    for failure in failures:
        found, seen = None, failure
        for _ in range(20):  # Ray's wrappers, then what caused them
            if seen is None:
                break
            if isinstance(seen, NOT_RETRIED):
                found = seen
            seen = getattr(seen, "cause", None) or seen.__cause__
        if found is not None:
            return found
    return None


class NoRetry(ray.train.UserCallback):
    """End the fit at the first worker error in :data:`NOT_RETRIED` (see the module docstring)."""

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        error = not_retried(worker_exceptions.values())
        if error is not None:
            raise error
