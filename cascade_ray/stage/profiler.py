"""``--profile``: a torch.profiler trace of a few optimizer steps of a stage, and its top operators.

The profiler skips ``PROFILE_WAIT_STEPS`` optimizer steps (setup, first-step allocations),
warms up for ``PROFILE_WARMUP_STEPS`` and records ``PROFILE_ACTIVE_STEPS``; the trace is a
Chrome / Perfetto JSON (open it at https://ui.perfetto.dev or chrome://tracing; TensorBoard's
profiler plugin reads it too). Only rank 0 profiles.

``cascade-ray diagnose --profile`` profiles in-process; ``cascade-ray run --profile [STAGE]``
puts the checked stage names in :class:`~cascade_ray.options.RunOptions`, and ``fit_stage``
tells the stage's workers where to write (:func:`trace_path_for`): ``{run}/profile/<stage>.trace.json``,
on local storage or a URI (exported to a local temp file on the worker's node, then uploaded).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import ConfigError, ConfigIssue
from cascade_ray.stage.hooks import LoopHooks, LoopState
from cascade_ray.storage import as_storage, full_uri, local_path

PROFILE_WAIT_STEPS, PROFILE_WARMUP_STEPS, PROFILE_ACTIVE_STEPS = 2, 2, 5
PROFILE_DIR = "profile"
TOP_OPERATORS = 10


def check_profile_stages(cfg: PipelineConfig, value: str) -> set[str]:
    """``--profile`` value -> stage names: ``all`` or a comma-separated list of stage names."""
    from cascade_ray.text import did_you_mean

    names = [s.name for s in cfg.stages]
    if value == "all":
        return set(names)
    wanted = [v.strip() for v in value.split(",") if v.strip()]
    issues = [
        ConfigIssue(
            "--profile",
            f"no stage {w!r}{did_you_mean(w, names)} (stages: {', '.join(names)})",
            "name a stage, or pass --profile alone for every stage",
        )
        for w in wanted
        if w not in names
    ]
    if issues or not wanted:
        raise ConfigError(
            issues
            or [ConfigIssue("--profile", "no stage named", "pass --profile alone for every stage, or --profile STAGE")]
        )
    return set(wanted)


def trace_path_for(stage: str, run_dir: Any, profile: frozenset[str]) -> str:
    """Where a stage's workers write its trace: "" when `stage` is not in `profile` (the run's
    ``--profile`` stages), else ``{run}/profile/<stage>.trace.json`` as a local path or a full URI
    (the worker writes a local file, then uploads it)."""
    if stage not in profile:
        return ""
    return full_uri(as_storage(run_dir) / PROFILE_DIR / f"{stage}.trace.json")


class StepProfiler:
    """Hooks that run torch.profiler over a few optimizer steps; :meth:`finish` writes the summary.

    Args:
        trace_path: the Chrome trace JSON to write.
        device: the training device (CUDA activity is recorded on a GPU).
        stage: the stage's name, for the summary.
        where: said after the trace path (e.g. the node that wrote it).
    """

    def __init__(
        self,
        trace_path: str | Path,
        device: torch.device,
        stage: str,
        where: str = "",
        *,
        wait: int = PROFILE_WAIT_STEPS,
        warmup: int = PROFILE_WARMUP_STEPS,
        active: int = PROFILE_ACTIVE_STEPS,
    ):
        self.target = as_storage(trace_path, "--profile")
        local = local_path(self.target)
        self.remote = local is None  # object storage: exported to a local temp file, then uploaded
        self.path = local or Path(tempfile.mkdtemp(prefix="cascade-ray-profile-")) / f"{stage}.trace.json"
        self.device, self.stage, self.where = device, stage, "" if self.remote else where
        self.wait, self.warmup, self.active = wait, warmup, active
        self.prof: torch.profiler.profile | None = None
        self.steps = 0
        self.summary: str | None = None

    def hooks(self) -> LoopHooks:
        return LoopHooks(on_setup=self._start, after_optimizer_step=self._step)

    def _start(self, state: LoopState) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=self._ready,
        )
        self.prof.start()

    def _step(self, state: LoopState) -> None:
        if self.prof is not None and self.summary is None:
            self.steps += 1
            self.prof.step()

    def _ready(self, prof: torch.profiler.profile) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        if self.remote:
            with self.path.open("rb") as src, self.target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        recorded = max(0, min(self.active, self.steps - self.wait - self.warmup))
        from torch.autograd.profiler_util import EventList

        # the per-step ranges are not operators: they would top the table with the profiler's own overhead
        ops = EventList([e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")])
        tables = [ops.table(sort_by="self_cpu_time_total", row_limit=TOP_OPERATORS)]
        if self.device.type == "cuda":
            tables.append(ops.table(sort_by="self_cuda_time_total", row_limit=TOP_OPERATORS))
        self.summary = (
            f"profile of stage {self.stage!r}: {recorded} optimizer step(s) recorded after {self.wait} skipped and {self.warmup} warm-up; "
            f"trace {self.target}{self.where} (open in https://ui.perfetto.dev or chrome://tracing)\n"
            f"top {TOP_OPERATORS} operators by self CPU time{' (then by self CUDA time)' if len(tables) > 1 else ''}:\n"
            + "\n".join(tables)
        )

    def finish(self) -> str:
        """Stop the profiler (writing the trace if recording was under way) and return the summary."""
        if self.prof is not None and self.summary is None:
            self.prof.stop()  # mid-recording: torch calls on_trace_ready with what it has
            self.prof = None
        return self.summary or (
            f"profile of stage {self.stage!r}: no trace; the stage stopped after {self.steps} optimizer step(s), "
            f"and the profiler records steps {self.wait + self.warmup + 1}..{self.wait + self.warmup + self.active}"
        )
