"""The Python API: what notebooks, services and the two doors (CLI, pipeline script) call.

from cascade_ray.api import load_cascade, predict, run_pipeline, serve

run = run_pipeline("pipelines/configs/debug.yaml", storage_path="/tmp/runs", stages__encoder__train__epochs=1)
print(run["test_accuracy"], [s["status"] for s in run.stages])
cascade = run.model()                      # or load_cascade("/tmp/runs/debug"), also s3:// / gs://
out = cascade.predict(images)              # {"prediction": ..., "probabilities": ...}
report = predict("/tmp/runs/debug", "new.parquet", "predictions/")   # Ray Data, on the cluster
print(report.rows_per_s)                   # predictions/*.parquet: prediction, probabilities
serving = serve("/tmp/runs/debug", port=8000)   # Ray Serve: POST {serving.url}/predict; serve(NEW, reload=True)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cascade_ray.checks import load_config, validate_config
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.options import RunOptions
from cascade_ray.pipeline import driver
from cascade_ray.pipeline.stages import StageRunner
from cascade_ray.tools.inference import Cascade, InputError, load_cascade
from cascade_ray.tools.predict import PredictReport, predict_file
from cascade_ray.tune.batched import BatchedSweepRunner, check_batchable
from cascade_ray.tune.run import SweepRunner
from cascade_ray.tune.space import load_space

__all__ = [
    "Cascade",
    "InputError",
    "PredictReport",
    "Run",
    "RunOptions",
    "load_cascade",
    "load_config",
    "predict",
    "run_pipeline",
    "serve",
    "stage_runners",
    "validate_config",
]


class Run(dict[str, Any]):
    """A finished (or ``stop_after``) pipeline run: the ``summary.json`` dict itself, plus its model.

    ``run["test_accuracy"]`` and ``json.dumps(run)`` work as on the summary; ``run.stages``
    (one record per stage: status, metrics, artifact, fingerprint, ...), ``run.run_dir``,
    ``run.cfg`` (the config it ran) and ``run.model()`` (the trained cascade, loaded from the
    run's files) are added.
    """

    def __init__(self, summary: Mapping[str, Any], cfg: PipelineConfig):
        super().__init__(summary)
        self.cfg = cfg

    @property
    def summary(self) -> dict[str, Any]:
        """The summary as a plain dict."""
        return dict(self)

    def __repr__(self) -> str:
        stages = ", ".join(f"{s['name']} {s['status']}" for s in self.stages)
        return f"Run({self.run_dir}: {stages})"

    @property
    def stages(self) -> list[dict[str, Any]]:
        """One record per stage that ran, in pipeline order."""
        return list(self["stages"])

    @property
    def run_dir(self) -> str:
        """``{storage_path}/{name}``: where the run's artifacts are."""
        return str(self["storage"])

    def model(self, stage: str | None = None, device: str | None = None) -> Cascade:
        """The trained cascade up to the last stage (or `stage`), from the run's own files."""
        if "test_loss" in self:  # a full run: its config.yaml has the swept values too
            return load_cascade(self.run_dir, stage=stage, device=device)
        # a stop_after run writes no config.yaml or summary.json: the last stage that ran predicts
        stage = stage or self.stages[-1]["name"]
        return load_cascade(f"{self.run_dir}/stages/{stage}", device=device, cfg=self.cfg)


def stage_runners(cfg: PipelineConfig, options: RunOptions) -> dict[str, StageRunner]:
    """A sweep runner for every stage ``options.spaces`` names; each space is read and checked
    against `cfg` here, before any Ray resource starts."""
    runners: dict[str, StageRunner] = {}
    for stage, path in options.spaces:
        space = load_space(path, cfg)
        if space.stage != stage:
            raise ConfigError(
                [ConfigIssue("stage", f"the space sweeps stage {space.stage!r}, asked for stage {stage!r}")], str(path)
            )
        if options.batched or space.batched:  # K configs in one TorchTrainer job, if the space allows it
            check_batchable(cfg, space, str(path), options.config_arg)
            runners[stage] = BatchedSweepRunner(space, str(path), resume=options.resume)
            continue
        runners[stage] = SweepRunner(space, str(path), resume=options.resume, trust_state=options.trust_tune_state)
    return runners


def _override_items(overrides: Mapping[str, Any]) -> list[str]:
    """Keyword overrides as ``key=value`` items: ``__`` separates keys (``stages__encoder__train__epochs``,
    ``stages__0__solver__lr`` for an index); values are written as JSON, which the override parser reads
    as YAML."""
    items = []
    for key, value in overrides.items():
        path = ""
        for part in key.split("__"):
            path += f"[{part}]" if part.isdigit() else f".{part}" if path else part
        items.append(f"{path}={json.dumps(value)}")
    return items


def as_config(
    config: PipelineConfig | str | Path | Mapping[str, Any], *, trust: Sequence[str] = (), **overrides: Any
) -> PipelineConfig:
    """A validated config from a YAML path, a mapping or a config, with keyword overrides applied
    and the `trust` packages added to its ``trusted_modules``."""
    items = _override_items(overrides)
    if isinstance(config, (str, Path)):
        return load_config(config, items, trust=trust)
    from cascade_ray.checks.validate import add_trust
    from cascade_ray.config.yaml_io import apply_overrides

    raw = config.model_dump(mode="json") if isinstance(config, PipelineConfig) else dict(config)
    if isinstance(config, PipelineConfig) and not items and not trust:
        return config
    issues = apply_overrides(raw, items) + add_trust(raw, trust, key="trust")
    return validate_config(raw, source="api", issues=issues)


def run_pipeline(
    config: PipelineConfig | str | Path | Mapping[str, Any],
    options: RunOptions | None = None,
    *,
    log: Callable[[str], None] = print,
    trust: Sequence[str] = (),
    **overrides: Any,
) -> Run:
    """Train (and, for stages in ``options.spaces``, sweep) every stage, then evaluate the composed model.

    Args:
        config: a YAML path, a config mapping or a validated :class:`PipelineConfig`.
        options: how the run behaves (cluster address, resume, sweeps, ...).
        log: where progress lines go.
        trust: packages whose ``package.module:Callable`` model / loss types the config may
            name (``--trust``), added to its ``trusted_modules``; never the standard library.
        **overrides: config overrides, ``__`` between keys: ``seed=3``,
            ``stages__encoder__solver__lr=3e-4`` (a stage by name or index).

    Returns:
        The :class:`Run`: the summary (also written to ``{storage_path}/{name}/summary.json``
        for full runs) and ``.model()``.

    Raises:
        ConfigError: a bad config, options or search spaces (before Ray starts), or
            resources the cluster does not have.
        CascadeError: a stage failed (earlier stages' artifacts stay, ``resume`` reuses them).
    """
    cfg = as_config(config, trust=trust, **overrides)
    options = options or RunOptions()
    summary = driver.run_pipeline(cfg, options, runners=stage_runners(cfg, options), log=log)
    return Run(summary, cfg)


def serve(run: str, *, reload: bool = False, **options: Any) -> Any:
    """Serve a finished run over HTTP with Ray Serve (``POST /predict``, ``GET /healthz``, ``GET /info``).

    ``serve(run, host=, port=, replicas=, max_batch_size=, batch_wait_ms=, max_rows=, stage=,
    name=, address=)`` starts the app and returns its ``Serving`` (``.url``, ``.gcs_address``)
    without blocking; ``serve(new_run, reload=True, name=, address=)`` swaps a running app to
    `new_run` in place and returns the new model's identity. Needs the ``serve`` extra.
    """
    from cascade_ray.tools.serve_control import reload_serving, start_serving

    return reload_serving(run, **options) if reload else start_serving(run, **options)


def predict(run: str | Path, data: str | Path, out: str | Path, **kwargs: Any) -> PredictReport:
    """Batch prediction with Ray Data: every row of the Parquet `data` through the run's cascade,
    written to the Parquet folder `out` in the input's row order (local paths or ``s3://`` /
    ``gs://`` URIs for all three).

    Keyword arguments are those of :func:`cascade_ray.tools.predict.predict_file`:
    ``input_column``, ``batch_rows``, ``actors``, ``keep_columns``, ``overwrite``, ``address``,
    ``stage``, ``log_level``.

    Raises:
        InputError: the input column is missing or does not fit the run (before Ray starts).
        CascadeError: not a finished run, or `out` is not empty (and no ``overwrite=True``).
    """
    return predict_file(run, data, out, **kwargs)
