"""The ``diagnose`` and ``lr-find`` commands: resolve the stage, load data and upstream, print.

Both run in this process, without Ray. Upstream stages are built freshly initialized
unless ``--upstream RUN_DIR/stages/<previous stage>`` names a stage artifact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.storage import as_storage, staged_dir


def resolve_stage(cfg: PipelineConfig, name: str) -> int:
    """Index of stage `name`, or a ConfigError with a did-you-mean."""
    from cascade_ray.text import did_you_mean

    names = [s.name for s in cfg.stages]
    if name not in names:
        raise ConfigError(
            [ConfigIssue("--stage", f"no stage {name!r}{did_you_mean(name, names)} (stages: {', '.join(names)})")]
        )
    return names.index(name)


def load_upstream(cfg: PipelineConfig, index: int, path: str | None) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """The verified artifact of the stage before `index` (its composed state), or (None, None)."""
    if path is None:
        return None, None
    from cascade_ray.pipeline.artifacts import read_artifact

    if index == 0:
        raise ConfigError(
            [
                ConfigIssue(
                    "--upstream",
                    f"stage {cfg.stages[0].name!r} is the first stage and has no upstream",
                    "drop --upstream",
                )
            ]
        )
    want = cfg.stages[index - 1].name
    artifact, state = read_artifact(path)
    if artifact.manifest.stage != want:
        raise ConfigError(
            [
                ConfigIssue(
                    "--upstream",
                    f"{path} is the artifact of stage {artifact.manifest.stage!r}, but stage {cfg.stages[index].name!r} trains on {want!r}",
                    f"pass RUN_DIR/stages/{want}",
                )
            ]
        )
    return state, str(path)


def pick_device(cfg: PipelineConfig, index: int, device: str | None) -> torch.device:
    """`device` if given, else CUDA when the stage asks for a GPU and one is here, else CPU."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if cfg.stages[index].scaling.use_gpu and torch.cuda.is_available() else "cpu")


def diagnose_command(
    cfg: PipelineConfig,
    stage: str,
    *,
    steps: int,
    as_json: bool,
    upstream: str | None,
    device: str | None,
    profile: bool = False,
) -> int:
    """Print the diagnose report of one stage; exit 0 when healthy, 1 with alarms.

    With `profile`, a torch.profiler trace of a few steps goes to ``profile/<stage>.trace.json``.
    """
    from cascade_ray.data.source import load_data
    from cascade_ray.stage.profiler import PROFILE_DIR
    from cascade_ray.tools.diagnose import diagnose, format_report

    index = resolve_stage(cfg, stage)
    state, source = load_upstream(cfg, index, upstream)
    trace = Path(PROFILE_DIR) / f"{stage}.trace.json" if profile else None
    report = diagnose(
        cfg,
        index,
        load_data(cfg.data, cfg.seed),
        steps=steps,
        upstream=state,
        upstream_source=source,
        device=pick_device(cfg, index, device),
        profile=trace,
    )
    print(json.dumps(report, indent=2, default=str) if as_json else format_report(report))
    return 0 if report["verdict"]["ok"] else 1


def lr_find_command(
    cfg: PipelineConfig,
    stage: str,
    *,
    out: str | None,
    steps: int,
    start_lr: float,
    end_lr: float,
    upstream: str | None,
    device: str | None,
) -> int:
    """Run the LR range test of one stage, write the PNG and print the suggested lr."""
    from cascade_ray.data.source import load_data
    from cascade_ray.tools.lrfind import lr_find, plot_lr_find

    index = resolve_stage(cfg, stage)
    state, source = load_upstream(cfg, index, upstream)
    if index > 0 and state is None:
        print(
            f"note: upstream stages are freshly initialized, not trained (pass --upstream RUN_DIR/stages/{cfg.stages[index - 1].name} for trained weights)"
        )
    result = lr_find(
        cfg,
        index,
        load_data(cfg.data, cfg.seed),
        upstream=state,
        device=pick_device(cfg, index, device),
        start_lr=start_lr,
        end_lr=end_lr,
        steps=steps,
    )
    target = as_storage(out or f"lr_find_{stage}.png", "--out")  # a local path or a URI (uploaded)
    with staged_dir(target.parent) as folder:
        plot_lr_find(
            result, folder / target.name, title=f"lr range test: stage {stage!r} ({cfg.stages[index].solver.type})"
        )
    png = target
    print(
        f"lr-find stage {stage!r}: {len(result.lrs)} steps from {start_lr:g} to {result.lrs[-1] if result.lrs else start_lr:.3g}{' (stopped: loss diverged)' if result.diverged else ''}"
    )
    print(f"  loss minimum at lr {result.min_loss_lr:.3g}; steepest descent at lr {result.suggestion:.3g}")
    print(
        f"suggested lr: {result.suggestion:.3g}  (set stages[{index}].solver.lr; configured: {cfg.stages[index].solver.lr:g})"
    )
    print(f"plot: {png}")
    return 0
