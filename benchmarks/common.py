"""Pieces the benchmark scripts share (they run as scripts: ``benchmarks/`` is on sys.path)."""

from __future__ import annotations


class ListReporter:
    """Minimal single-rank Reporter for in-process ``run_stage`` calls: keeps the metrics and a
    reference to the last reported state (the idea of tests/support/fakes.ListReporter, without
    checkpoint copies)."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.reports: list[dict] = []
        self.last_state: dict | None = None

    def all_sum(self, values):
        return list(values)

    def report(self, metrics, state, trainer=None):
        self.reports.append(dict(metrics))
        if state is not None:
            self.last_state = state
