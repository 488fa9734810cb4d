"""``StageTrainer``: Ray Train's ``TorchTrainer`` without two fixed costs every stage fit pays.

Ray Train 2.60 adds the same controller callbacks to every fit. Two of them cost a stage
fit on a small machine about 1.2-1.3 s (``benchmarks/bench_startup.py``) and do nothing for
cascade-ray's fits:

- the Ray Data callback starts a ``DatasetManager`` actor (one more Python process) for Ray
  Data datasets. cascade-ray passes none (its workers read arrays from the object store),
  so it is left out when ``datasets`` is empty.
- the placement-group cleaner callback starts a detached actor that removes the worker
  group's placement group if the controller dies without shutting down (e.g. a Tune trial
  that is stopped early). It is kept, but its stop at the end of a fit no longer waits: the
  blocking stop joins a monitor thread that sleeps up to its 1 s check interval, about 1 s
  per fit. Not waiting is safe: the controller has already removed its placement group when
  the stop is sent, and a cleaner that instead sees the controller gone checks first that
  the group is removed and leaves it alone.

Both changes reach into Ray Train's internals, so they live in :mod:`cascade_ray.ray_compat`
(``LeanTorchTrainer``, ``lean_callbacks``). If another Ray version moved them, the trainer
falls back to Ray's own callbacks unchanged and logs one warning: the saving is lost,
nothing else.
"""

from __future__ import annotations

from cascade_ray.ray_compat import LeanTorchTrainer


class StageTrainer(LeanTorchTrainer):
    """The ``TorchTrainer`` of one cascade-ray stage fit (pipeline stages and Tune trials)."""
