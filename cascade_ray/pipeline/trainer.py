"""``StageTrainer``: Ray Train's ``TorchTrainer`` without two fixed costs every stage fit pays.

Ray Train 2.60 adds the same controller callbacks to every fit. Two of them cost a stage
fit on a small machine about 1.2 s (``benchmarks/bench_startup.py``) and do nothing for
cascade-ray's fits:

- ``DatasetsCallback`` starts a ``DatasetManager`` actor (one more Python process) for Ray
  Data datasets. cascade-ray passes none (its workers read arrays from the object store),
  so it is left out when ``datasets`` is empty.
- ``PlacementGroupCleanerCallback`` starts a detached actor that removes the worker group's
  placement group if the controller dies without shutting down (e.g. a Tune trial that is
  stopped early). It is kept, but its stop at the end of a fit no longer waits: the blocking
  stop joins a monitor thread that sleeps up to its 1 s check interval, about 1 s per fit.
  Not waiting is safe: the controller has already removed its placement group when the
  stop is sent, and a cleaner that instead sees the controller gone checks first that the
  group is removed and leaves it alone.

If Ray's internals here change (another Ray version), the trainer falls back to Ray's own
callbacks unchanged: the saving is lost, nothing else.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ray.train.torch import TorchTrainer

logger = logging.getLogger(__name__)


def _internal_callbacks() -> tuple[type, type] | None:
    """Ray's ``(DatasetsCallback, PlacementGroupCleanerCallback)`` classes, or None if moved."""
    try:
        from ray.train.v2._internal.callbacks import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return None
    return DatasetsCallback, PlacementGroupCleanerCallback


@functools.cache
def _quick_stop_cleaner_class(base: type) -> type | None:
    """A ``PlacementGroupCleanerCallback`` whose stop is sent without waiting for the reply (made once)."""
    if not callable(getattr(base, "_stop_cleaner", None)):
        return None

    class QuickStopCleanerCallback(base):  # type: ignore[misc, valid-type]
        def _stop_cleaner(self) -> None:
            cleaner = getattr(self, "_cleaner", None)
            if cleaner is None:
                return
            try:
                cleaner.stop.remote()
            except Exception:
                logger.debug("placement group cleaner already gone at stop", exc_info=True)
            finally:
                self._cleaner = None

    return QuickStopCleanerCallback


def lean_callbacks(callbacks: list[Any], *, has_datasets: bool) -> list[Any]:
    """Ray's default controller callbacks with the two changes above (unchanged if Ray moved them)."""
    found = _internal_callbacks()
    if found is None:
        return callbacks
    datasets_cls, cleaner_cls = found
    quick = _quick_stop_cleaner_class(cleaner_cls)
    out = []
    for cb in callbacks:
        if isinstance(cb, datasets_cls) and not has_datasets:
            continue
        if quick is not None and type(cb) is cleaner_cls:
            cb.__class__ = quick  # the same instance: Ray's check interval and timeouts
        out.append(cb)
    return out


class StageTrainer(TorchTrainer):
    """The ``TorchTrainer`` of one cascade-ray stage fit (pipeline stages and Tune trials)."""

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        try:
            return lean_callbacks(callbacks, has_datasets=bool(getattr(self, "datasets", None)))
        except Exception:
            logger.debug("kept Ray Train's default callbacks", exc_info=True)
            return callbacks
