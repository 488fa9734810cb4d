"""Pieces the benchmark scripts share (they run as scripts: ``benchmarks/`` is on sys.path)."""

from __future__ import annotations


class ListReporter:
    """Minimal single-rank Reporter for in-process ``run_stage`` calls: keeps the metrics only
    (the idea of tests/support/fakes.ListReporter, without checkpoint copies)."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.reports: list[dict] = []

    def all_sum(self, values):
        return list(values)

    def report(self, metrics, state, trainer=None):
        self.reports.append(dict(metrics))
