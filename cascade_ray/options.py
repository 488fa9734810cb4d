"""Run options: how one pipeline run behaves, as opposed to what it trains (the config).

Built once by a door (the ``cascade-ray`` CLI or ``pipelines/three_stage.py``, both through
:func:`cascade_ray.cli.run_options`) and passed down explicitly: ``api.run_pipeline`` -> the
driver -> the stage session -> ``fit_stage`` -> the train loop config of every worker (and
every Tune trial). No module global carries any of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade_ray.errors import ConfigError, ConfigIssue

LOG_LEVELS = ("debug", "info", "warning")


@dataclass(frozen=True)
class RunOptions:
    """How a pipeline run behaves. Frozen: a run's options never change while it runs."""

    address: str | None = None
    """Ray cluster address; ``None``: ``RAY_ADDRESS``, else an embedded Ray."""
    resume: bool = False
    """Reuse stage artifacts whose fingerprint matches and whose digests verify; restore sweeps."""
    log_level: str = "info"
    """``debug`` | ``info`` | ``warning``: how much of Ray's and cascade-ray's output is shown
    (see :mod:`cascade_ray.logs`)."""
    profile: frozenset[str] = field(default_factory=frozenset)
    """Stage names whose steps torch.profiler records (``--profile``)."""
    spaces: tuple[tuple[str, str], ...] = ()
    """(stage name, Tune space file) pairs: these stages are swept, the best trial kept."""
    stop_after: str | None = None
    """Stop after this stage (no composed-model evaluation); ``cascade-ray tune`` uses it."""
    break_lock: bool = False
    """Take the run lock (``{run}/.lock``) even from a driver that looks alive (``--break-lock``)."""
    overwrite: bool = False
    """Train again over a finished run (``{run}/summary.json``, status finished) without ``resume``; every file
    the run writes is rewritten (``--overwrite``)."""
    trust_tune_state: bool = False
    """Restore sweeps without checking their Tune state's sha256 sidecar (``--trust-tune-state``)."""
    batched: bool = False
    """Run every sweep in ``spaces`` batched: one TorchTrainer job for all its configs (``--batched``)."""
    config_arg: str = "CONFIG"
    """The config as the user named it on the command line, with its overrides (``debug
    stages.classifier.train.epochs=3``): the commands an error suggests repeat it, so they run as printed, and
    a sweep's ``best.yaml`` names it (credentials redacted) as what its swept values apply to."""

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(
                [
                    ConfigIssue(
                        "--log-level", f"unknown log level {self.log_level!r}", f"use one of {', '.join(LOG_LEVELS)}"
                    )
                ]
            )
        object.__setattr__(self, "profile", frozenset(self.profile))
        object.__setattr__(self, "spaces", tuple(tuple(pair) for pair in self.spaces))

    @property
    def show_progress(self) -> bool:
        """The live progress display (and its board actor) runs unless ``--log-level warning``."""
        return self.log_level != "warning"
