"""In-process stand-ins for Ray pieces, so loop logic is tested without a cluster."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from cascade_ray.models.weights import to_numpy_state


@dataclass
class ListReporter:
    """A single-rank Reporter that keeps every report (and the last checkpointed state)."""

    rank: int = 0
    world: int = 1
    reports: list[dict] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    trainers: list[dict] = field(default_factory=list)
    frozen: list[dict | None] = field(default_factory=list)  # per checkpoint: the entries named by digest

    def all_sum(self, values):
        return list(values)

    def report(self, metrics, state, trainer=None, frozen=None):
        self.reports.append(dict(metrics))
        if state is not None:
            self.states.append(to_numpy_state(state))
            self.frozen.append(dict(frozen) if frozen else None)
        if trainer is not None:
            self.trainers.append(copy.deepcopy(trainer))


class LogRecords(logging.Handler):
    """The messages a logger emits while this handler is attached to it (every level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def records_of(logger: logging.Logger, level: int = logging.INFO) -> Iterator[LogRecords]:
    """The messages `logger` emits inside the block, at `level` and up; its level and handlers
    are as before afterwards (``setLevel``, which also clears logging's per-level cache)."""
    records, before = LogRecords(), logger.level
    logger.addHandler(records)
    logger.setLevel(level)  # whatever an earlier test or Ray left on its parent loggers
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(before)


def shim_logger(shim: str) -> logging.Logger:
    """The Ray module logger a ``ray_compat`` shim filters (its PrivateSymbol's ``logger``)."""
    from cascade_ray import ray_compat

    return ray_compat.resolve(next(s for s in ray_compat.PRIVATE_SYMBOLS if s.shim == shim and s.attr == "logger"))


def checkpoint_manager_logger() -> logging.Logger:
    """Ray Train's checkpoint-manager logger, which ``ray_compat.read_run_result`` filters."""
    return shim_logger("read_run_result")


def wrong_handoff_digest(monkeypatch, key: str) -> str:
    """Make every hand-off the driver builds from here on carry a wrong digest for `key` (its arrays
    unchanged): a worker that checks its frozen upstream against the hand-off's digests then fails at
    its first epoch's end. Returns the drift message that names `key`."""
    from cascade_ray.pipeline import stages

    real = stages.Handoff
    monkeypatch.setattr(
        stages,
        "Handoff",
        lambda state, ref, fp, digests=None: real(state, ref, fp, digests and digests | {key: "0" * 64}),
    )
    return f"frozen tensor(s) changed since the stage was handed them: {key}"
