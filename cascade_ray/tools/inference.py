"""Use a finished run: its composed model rebuilt from the run's own files, the preprocessing, predictions.

from cascade_ray.api import load_cascade

cascade = load_cascade("~/cascade-ray-runs/debug")  # or s3://bucket/runs/debug, or a stage artifact
out = cascade.predict(images)  # {"prediction": (N,) classes, "probabilities": (N, K)}
logits = cascade.module(cascade.preprocess(images))  # the torchvision idiom: model(preprocess(x))

Loading reads ``{run}/config.yaml`` (which modules to build), ``{run}/summary.json`` (which
stage is last) and the stage artifact (weights, verified against the manifest's sha256 and
per-tensor digests). What the model takes and predicts — input shape, normalization, target
kind, output width, class names — comes from the manifest's ``data_spec``: the training
data is never read. ``stages[i].pretrained`` files are not needed either: the artifact holds
the weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.config.yaml_io import parse_yaml
from cascade_ray.errors import ArtifactError, CascadeError, ConfigError, ConfigIssue
from cascade_ray.models.cascade import CascadeModel, build_cascade
from cascade_ray.models.metrics import output_predictions, output_probabilities
from cascade_ray.models.plan import require_plans
from cascade_ray.models.weights import load_numpy_state
from cascade_ray.pipeline.artifacts import MANIFEST, read_artifact
from cascade_ray.pipeline.outputs import CONFIG_FILE, require_run_folder
from cascade_ray.pipeline.records import RunSummary, read_summary
from cascade_ray.storage import StorageDir, as_storage

SUMMARY_FILE = "summary.json"
PREDICT_BATCH_ROWS = 1024


class InputError(CascadeError, ValueError):
    """Inputs that do not fit the model (shape, type, non-finite values); the message says what fits."""


class InputScaleWarning(UserWarning):
    """Inputs that look rescaled or normalized compared with the training data (:meth:`InputSpec.scale_warning`)."""


@dataclass(frozen=True)
class InputSpec:
    """What a trained cascade takes and predicts (a manifest's ``data_spec``)."""

    input_shape: tuple[int, ...]
    target_kind: str
    out_width: int
    mean: np.ndarray
    std: np.ndarray
    class_names: tuple[str, ...] | None = None

    @classmethod
    def from_manifest(cls, spec: Mapping[str, Any] | None, where: str) -> InputSpec:
        """The spec of a manifest's ``data_spec``; :class:`ArtifactError` when it is absent or incomplete."""
        if not spec:
            raise ArtifactError(
                f"{where}: the manifest has no data_spec (written by a version before it existed); "
                "retrain the run with this version to use it without its training data"
            )
        try:
            shape = tuple(int(d) for d in spec["input_shape"])
            stats = tuple(int(d) for d in spec["stats_shape"])
            mean = np.asarray(spec["mean"], dtype=np.float32).reshape(stats)
            std = np.asarray(spec["std"], dtype=np.float32).reshape(stats)
            names = spec.get("class_names")
            return cls(
                shape, str(spec["target_kind"]), int(spec["num_classes"]), mean, std, tuple(names) if names else None
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{where}: data_spec is malformed ({exc!r}); retrain the stage") from None

    def describe(self) -> str:
        """e.g. ``inputs (1, 8, 8) -> class, 10 outputs``."""
        return f"inputs {self.input_shape} -> {self.target_kind}, {self.out_width} outputs"

    def scale_warning(self, x: torch.Tensor) -> str | None:
        """Why raw inputs `x` (checked, float) look like they are not on the training data's scale, or
        None. The model normalizes raw inputs itself (``mean`` / ``std`` of the training data), so inputs
        a user normalized or rescaled first are predicted, silently, as near-constant images. Two cases,
        each far outside what one batch of real inputs does:

        - the training inputs are large (a channel's mean at least 2, e.g. pixels 0..255 or 0..16), and
          every value of `x` lies in [-1, 1] with fractions among them: divided by 255 (or normalized);
        - some value of `x` is over 100x the training inputs' largest channel mean + std: the other way
          round (0..255 pixels to a model trained on 0..1).
        """
        if not x.numel():
            return None
        mean, std = float(np.abs(self.mean).max()), float(np.abs(self.std).max())
        top = float(x.abs().max())
        seen = f"the training inputs' mean is {mean:.4g} and std {std:.4g} (a channel's largest)"
        if mean >= 2.0 and 0.0 < top <= 1.0 and bool((x != x.round()).any()):
            return (
                f"inputs all lie within [-1, 1] with fractions, but {seen}: they look rescaled (e.g. divided by "
                "255) or normalized; pass them on the training data's scale (the model normalizes them itself)"
            )
        if top > 100.0 * (mean + std):
            return (
                f"inputs reach {top:.4g}, over 100x the training inputs' mean + std ({mean:.4g} + {std:.4g}, a "
                "channel's largest): pass them on the training data's scale (e.g. pixels in 0..1 if it was "
                "trained on 0..1)"
            )
        return None


class LastHead(nn.Module):
    """The composed cascade, returning the last stage's head output as one tensor (normalized inputs)."""

    def __init__(self, cascade: CascadeModel):
        super().__init__()
        self.cascade = cascade
        self.head = cascade.order[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cascade(x, heads=[self.head])[self.head]


class Composed(nn.Module):
    """Raw inputs -> the run's normalization -> every stage in order -> the last head's outputs.

    What ``export`` writes and ``serve`` runs: the preprocessing travels with the weights.
    """

    def __init__(self, module: LastHead, mean: np.ndarray, std: np.ndarray):
        super().__init__()
        self.module = module
        # per channel (C, 1, 1), per feature (D,) or one value: broadcast to an input row
        self.register_buffer("mean", torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.register_buffer("std", torch.as_tensor(np.asarray(std, dtype=np.float32)))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.module((inputs - self.mean) / self.std)


class Cascade:
    """A trained cascade, ready to predict.

    Attributes:
        module: the composed model (normalized inputs -> the last head's outputs), eval mode.
        composed: the same with the normalization inside (raw inputs -> outputs).
        spec: input shape, target kind, output width, statistics and class names.
        cfg: the run's resolved config; `stage`: the stage whose head predicts; `run`: the run folder.
    """

    def __init__(self, cfg: PipelineConfig, stage: str, spec: InputSpec, cascade: CascadeModel, run: StorageDir):
        self.cfg, self.stage, self.spec, self.run = cfg, stage, spec, run
        self.module = LastHead(cascade).eval()
        self.composed = Composed(self.module, spec.mean, spec.std).eval()

    def __repr__(self) -> str:
        return f"Cascade({self.run}, stage {self.stage!r}: {self.spec.describe()})"

    @property
    def device(self) -> torch.device:
        return self.composed.mean.device

    def to(self, device: str | torch.device) -> Cascade:
        """Move the model (in place) to `device`; returns self."""
        self.composed.to(device)
        return self

    def check_inputs(self, inputs: Any) -> torch.Tensor:
        """`inputs` as a float32 tensor of shape (N, *input_shape) on CPU, or :class:`InputError`.

        Takes a numpy array, a tensor or nested lists; one row without the batch axis (shaped or
        flat), and flat rows of ``prod(input_shape)`` values, are accepted too.
        """
        shape = self.spec.input_shape
        try:
            if isinstance(inputs, torch.Tensor):
                x = inputs.detach().cpu()
            else:
                array = np.asarray(inputs)
                if array.dtype == object or not (
                    np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.bool_)
                ):
                    raise InputError(
                        f"inputs must be numbers shaped (N, {', '.join(map(str, shape))}); "
                        f"got {'ragged or mixed values' if array.dtype == object else array.dtype}"
                    )
                with warnings.catch_warnings():
                    # a read-only array (Arrow / object-store memory) is never written: every step
                    # below makes new tensors, so torch's non-writable warning does not apply
                    warnings.simplefilter("ignore", UserWarning)
                    x = torch.from_numpy(np.ascontiguousarray(array))
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, InputError):
                raise
            why = "rows of different lengths" if "inhomogeneous" in str(exc) else str(exc)[:120]
            raise InputError(f"inputs are not an array of numbers ({why})") from None
        if x.is_complex():
            raise InputError("inputs are complex numbers; the model takes real values")
        x = x.float()
        size = int(np.prod(shape))
        if tuple(x.shape) == shape:
            x = x.unsqueeze(0)
        elif x.ndim == 1 and len(shape) > 1 and x.shape[0] == size:  # one flat row
            x = x.reshape(1, *shape)
        elif x.ndim == 2 and len(shape) > 1 and x.shape[1] == size:
            x = x.reshape(-1, *shape)
        if tuple(x.shape[1:]) != shape:
            raise InputError(
                f"inputs have shape {tuple(x.shape)}; the model takes (N, {', '.join(map(str, shape))}) "
                f"(or flat rows of {size} values; one row alone as {shape} or {size} values)"
            )
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise InputError("inputs contain NaN or infinite values")
        return x

    def preprocess(self, inputs: Any) -> torch.Tensor:
        """Checked, normalized inputs on the model's device: what :attr:`module` takes."""
        x = self.check_inputs(inputs).to(self.device)
        return (x - self.composed.mean) / self.composed.std

    @torch.inference_mode()
    def outputs(self, inputs: Any, batch_rows: int = PREDICT_BATCH_ROWS) -> torch.Tensor:
        """The last head's raw outputs (logits, or values) for `inputs`, on CPU, in batches."""
        x = self.check_inputs(inputs)
        note = self.spec.scale_warning(x)
        if note:  # the text names no value of this batch: Python's filter shows it once per place, not per call
            warnings.warn(note, InputScaleWarning, stacklevel=3)
        chunks = [
            self.composed(x[i : i + batch_rows].to(self.device)).float().cpu() for i in range(0, len(x), batch_rows)
        ]
        return torch.cat(chunks) if chunks else torch.empty(0, self.spec.out_width)

    def predict(self, inputs: Any, batch_rows: int = PREDICT_BATCH_ROWS) -> dict[str, np.ndarray]:
        """Predictions for `inputs`.

        Returns:
            ``prediction``: class indices (N,) int64 (class), 0/1 flags (N, K) int64
            (multilabel), or values (N, D) float32 (regression; (N,) when D is 1);
            ``probabilities``: (N, K) float32 softmax (class) or sigmoid (multilabel) outputs;
            absent for regression.
        """
        return prediction_columns(self.outputs(inputs, batch_rows), self.spec.target_kind)

    def label_names(self, prediction: np.ndarray) -> list[str] | None:
        """Class names of predicted class indices, or None when the data set has no names."""
        if self.spec.class_names is None or self.spec.target_kind != "class":
            return None
        return [self.spec.class_names[int(i)] for i in prediction]


def prediction_columns(out: torch.Tensor, kind: str) -> dict[str, np.ndarray]:
    """``prediction`` (and ``probabilities`` for class kinds) of raw outputs, as numpy arrays."""
    prediction = output_predictions(out, kind).numpy()
    if kind != "regression":  # class indices, multilabel 0/1 flags
        prediction = prediction.astype(np.int64)
    elif prediction.ndim == 2 and prediction.shape[1] == 1:
        prediction = prediction[:, 0]
    columns = {"prediction": prediction}
    probabilities = output_probabilities(out, kind)
    if probabilities is not None:
        columns["probabilities"] = probabilities.numpy().astype(np.float32)
    return columns


def resolve_run(location: str | StorageDir) -> tuple[StorageDir, str | None]:
    """The run folder of `location` (a run, or one of its stage artifacts) and the stage it names, if any."""
    path = as_storage(location, "run")
    require_run_folder(path)
    if (path / MANIFEST).is_file():  # {run}/stages/<stage>
        return path.parent.parent, path.name
    return path, None


def read_run_config(run: StorageDir) -> PipelineConfig:
    """The run's resolved ``config.yaml`` (see :func:`usable_config`)."""
    file = run / CONFIG_FILE
    if not file.is_file():
        raise CascadeError(f"{run} is not a finished run (no {CONFIG_FILE}): pass {{storage_path}}/{{name}}")
    return usable_config(parse_yaml(file.read_text(), str(file)), str(file))  # strict, like every config


def usable_config(raw: Any, source: str) -> PipelineConfig:
    """A trained run's config, read without touching what it trained from.

    Only the schema pass runs (the run was fully validated when it trained), and
    ``pretrained`` files are left out (the artifact holds the weights), so the config loads
    on a machine that has neither the pretrained files nor the data; the manifest's input
    shape drives the shape plan.
    """
    from cascade_ray.config.loader import parse_config

    if isinstance(raw, PipelineConfig):
        raw = raw.model_dump(mode="json")
    if not isinstance(raw, dict):
        raise ArtifactError(f"{source}: not a mapping; the run's config is damaged")
    issues: list[ConfigIssue] = []
    cfg, _ = parse_config(raw, issues)
    if issues or cfg is None:
        problems = "; ".join(issue.render() for issue in issues[:3])
        raise ArtifactError(
            f"{source}: not a config this version reads ({problems}); retrain the run with this version"
        )
    stages = [s.model_copy(update={"pretrained": None}) for s in cfg.stages]
    return cfg.model_copy(update={"stages": stages})


def with_trust(cfg: PipelineConfig, trust: Sequence[str] = (), trust_run: bool = True) -> PipelineConfig:
    """`cfg` with its ``trusted_modules`` replaced by (the run's own, when `trust_run`) + `trust`.

    Raises:
        ConfigError: a `trust` entry that can never be trusted (the standard library), under ``--trust``,
            or, with `trust_run`, a run's own entry of that kind (a tampered ``config.yaml``).
    """
    from cascade_ray.config.trust import module_refusal

    own = list(cfg.trusted_modules) if trust_run else []
    issues = [
        ConfigIssue(key, problem, "trust only your own packages")
        for key, names in (("trusted_modules", own), ("--trust", list(trust)))
        for problem in map(module_refusal, names)
        if problem is not None
    ]
    if issues:
        raise ConfigError(issues)
    merged = [*own, *(name for name in trust if name not in own)]
    return cfg if merged == cfg.trusted_modules else cfg.model_copy(update={"trusted_modules": merged})


def run_summary(run: StorageDir) -> RunSummary:
    """The run's validated ``summary.json``, or a :class:`CascadeError` saying the run is not finished
    (no summary, or one whose status is running or failed)."""
    if not (run / SUMMARY_FILE).is_file():
        raise CascadeError(
            f"{run} is not a finished run (no {SUMMARY_FILE}): pass {{storage_path}}/{{name}} of a run that "
            "completed, or a stage artifact folder {run}/stages/<stage>"
        )
    summary = read_summary(run / SUMMARY_FILE)
    if summary.status != "finished":
        done = ", ".join(s.name for s in summary.done) or "none"
        raise CascadeError(
            f"{run} is not a finished run (summary.json: {summary.describe()}): its composed model was never "
            f"tested; finish it with `cascade-ray run CONFIG --resume` (done stages are reused), or load a done "
            f"stage's artifact {run}/stages/<stage> (done: {done}); `cascade-ray report {run}` shows what it has"
        )
    return summary


def load_cascade(
    location: str | StorageDir,
    stage: str | None = None,
    device: str | None = None,
    *,
    cfg: PipelineConfig | None = None,
    trust: Sequence[str] = (),
    trust_run: bool = True,
) -> Cascade:
    """The trained cascade of a run, up to its last stage (or `stage`).

    A run's ``config.yaml`` is code: its ``model.type`` import paths are imported and called
    (within its ``trusted_modules``; never the standard library). Load a run you did not
    write with ``trust_run=False``: then only `trust` (and cascade-ray's own models) count.

    Args:
        location: ``{storage_path}/{name}`` (local folder or ``s3://`` / ``gs://`` URI), or a
            stage artifact folder ``{run}/stages/<stage>``.
        stage: the stage whose head predicts (default: the folder's stage, else the run's last).
        device: where the model runs (default cpu).
        cfg: the run's config, when the caller has it (a ``stop_after`` run writes no
            ``config.yaml``); default: read ``{run}/config.yaml``.
        trust: packages whose callables the config may name, beyond what it trusts itself
            (``--trust``); refused names (the standard library) are an error.
        trust_run: honor the run's own ``trusted_modules`` (default; your own runs); False
            for a run from elsewhere (``--untrusted-run``).

    Raises:
        CascadeError: not a finished run, or no such stage.
        ArtifactError: damaged files (a weights hash or tensor digest that does not match).
    """
    run, named = resolve_run(location)
    cfg = usable_config(cfg, "cfg") if cfg is not None else read_run_config(run)
    cfg = with_trust(cfg, trust, trust_run)
    stage = stage or named or run_summary(run).stages[-1].name
    names = [s.name for s in cfg.stages]
    if stage not in names:
        from cascade_ray.text import did_you_mean

        raise CascadeError(f"{run}: no stage {stage!r}{did_you_mean(stage, names)} (stages: {', '.join(names)})")
    artifact, state = read_artifact(run / "stages" / stage)
    spec = InputSpec.from_manifest(artifact.manifest.data_spec, str(artifact.path / MANIFEST))
    model = assemble_cascade(cfg, stage, spec, state, run)
    return model.to(device) if device else model


def assemble_cascade(
    cfg: PipelineConfig, stage: str, spec: InputSpec, state: Mapping[str, np.ndarray], run: StorageDir
) -> Cascade:
    """A :class:`Cascade` built from parts already read and verified (what :func:`load_cascade`
    reads): the modules up to `stage`, with the numpy `state` copied in. Batch prediction's
    actors use it with the state the driver read once and put in Ray's object store."""
    plans = require_plans(cfg, spec.input_shape, spec.out_width)
    cascade = build_cascade(cfg, plans, spec.out_width, upto=cfg.stage_index(stage))
    load_numpy_state(cascade, state)
    return Cascade(cfg, stage, spec, cascade, run)
