"""In-process stand-ins for Ray pieces, so loop logic is tested without a cluster."""

from __future__ import annotations

import copy
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

    def all_sum(self, values):
        return list(values)

    def report(self, metrics, state, trainer=None):
        self.reports.append(dict(metrics))
        if state is not None:
            self.states.append(to_numpy_state(state))
        if trainer is not None:
            self.trainers.append(copy.deepcopy(trainer))
