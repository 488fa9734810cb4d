"""Typed records of a run: the artifact manifest, each stage's record, and ``summary.json``.

Files are written from these models (``model_dump(mode="json")``, unset optional blocks
left out) and validated when read back: :func:`read_manifest` and :func:`read_summary`
turn a damaged, truncated or foreign file into an :class:`~cascade_ray.errors.ArtifactError`
naming the file and the key.

Adding a field is one line on the model, optional with a default when older files
lack it (``compile_s: float | None = Field(None, description="...")``). Fields that
both the manifest and the stage record carry live once, on :class:`StageResult`; a
reused stage's record copies every one of them from its manifest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from cascade_ray.errors import ArtifactError
from cascade_ray.storage import StorageDir, not_regular_reason

MANIFEST_FIX = "the artifact is damaged or from another version: re-run the stage (without --resume) to retrain it"
SUMMARY_FIX = "the run's summary is damaged or from another version: re-run the pipeline to write it again"
ERROR_CHARS = 2000  # an error's text kept in summary.json (a long Ray traceback is cut at the end)


def _has_val_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    for key in ("val_loss",):
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key!r} missing or not a number (found {value!r})")
    return metrics


class _Record(BaseModel):
    """A record whose writer is ours: unknown keys are errors, not silently dropped.

    NaN and infinite metrics stay ``NaN``/``Infinity`` in the JSON (as ``json.dumps`` writes
    them), not ``null``.
    """

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict; optional fields that are None are left out (older files never had them)."""
        return self.model_dump(mode="json", exclude_none=True)


class StageResult(_Record):
    """What a trained stage produced; carried by both its artifact manifest and its stage record."""

    metrics: Annotated[dict[str, Any], AfterValidator(_has_val_metrics)] = Field(
        description="Metrics of the best checkpoint's epoch (``val_loss``, ``train_loss``, lr, and the target "
        "kind's ``val_`` metrics: accuracy, micro_f1 / map, mae / rmse / r2)."
    )
    history: list[dict[str, Any]] = Field(
        description="One entry per epoch (its metrics), each with that epoch's per-step rows under ``steps``."
    )
    num_workers: int = Field(description="Ray Train workers the stage ran on (0: imported on the driver).")
    trainable_params: int = Field(description="Parameters the stage trained.")
    frozen_params: int = Field(description="Parameters of the frozen upstream stages.")
    fingerprint: str = Field(
        description="sha256 of the stage config, parent fingerprint, data, seed and package version."
    )
    ray_run: str = Field(
        description="Name of the stage's Ray Train run under ``{run}/ray/`` (a sweep's best trial); empty for an "
        "imported stage, which runs no Ray Train job."
    )
    precision: dict[str, Any] | None = Field(
        default=None,
        description="What the worker's device made of ``solver.precision``: requested, resolved, reason, hardware "
        "(absent in artifacts written before precision auto).",
    )
    memory_format: str | None = Field(
        default=None, description="``channels_last`` or ``contiguous``: the memory format the stage trained in."
    )
    compile: dict[str, Any] | None = Field(
        default=None, description="``stages[i].compile``: status (compiled | eager), compile seconds, message."
    )
    nodes: list[str] | None = Field(
        default=None,
        description="Ray node id (hex) of each worker, in rank order, of the worker group that wrote the "
        "stage's best checkpoint (after a worker-group restart, the group that wrote it); a reused stage's "
        "are those of the run that trained it (absent in artifacts written before nodes were recorded).",
    )


class ManifestFields(StageResult):
    """The part of ``manifest.json`` a stage supplies; :func:`write_artifact` adds the integrity fields."""

    stage: str = Field(description="Name of the stage the artifact is the output of.")
    index: int = Field(description="Position of the stage in the pipeline, from 0.")
    parent_fingerprint: str = Field(description="Fingerprint of the upstream stage; empty for the first stage.")
    data_fingerprint: str = Field(description="Fingerprint of the data splits the stage trained on.")
    frozen_digest: dict[str, str] = Field(description="State-dict key -> digest of every tensor frozen in the stage.")
    data_spec: dict[str, Any] | None = Field(
        default=None,
        description="What the model takes and predicts, so the artifact is usable without its training data: "
        "input_shape, input_dtype, target_kind, num_classes (output width), and the normalization mean / std "
        "(stats_shape: how they broadcast to one input row). Absent in artifacts written before it existed.",
    )
    fingerprint_inputs: dict[str, Any] | None = Field(
        default=None,
        description="What ``fingerprint`` hashes: the stage's config (``stage``), the parent's and the data's "
        "fingerprints, the seed, the package version, a non-default checkpoint ranking and the pretrained file's "
        "sha256. A ``--resume`` that trains the stage again names the keys that differ. Absent in artifacts "
        "written before it existed.",
    )


class Manifest(ManifestFields):
    """``stages/<stage>/manifest.json``: what the artifact is, and how to verify its weights."""

    cascade_ray_version: str = Field(description="Package version that wrote the artifact.")
    weights_sha256: str = Field(description="sha256 of ``weights.safetensors``.")
    tensor_digests: dict[str, str] = Field(description="State-dict key -> digest of every tensor in the file.")
    manifest_sha256: str = Field(
        description="sha256 of the manifest's canonical JSON without this field (keys sorted, no spaces): an edited "
        "fingerprint, metric or digest no longer matches it (:func:`seal_manifest`, checked by :func:`read_manifest`)."
    )


class FeatureCacheRecord(_Record):
    """The cached upstream outputs a stage trained on."""

    status: Literal["computed", "read"] = Field(description="Computed in this run, or read from the Parquet copy.")
    shape: list[int] = Field(description="One sample's feature shape.")
    path: str = Field(description="The Parquet copy in storage.")
    seconds: float = Field(description="Wall time to compute or read the features.")
    nodes: list[str] | None = Field(
        None,
        description="Ray node ids that computed the features: one per Ray task, in shard order, or the "
        "driver's node when the driver computed them; absent when they were read from storage.",
    )


class SweepRecord(_Record):
    """Where a swept stage's Tune outputs are."""

    results: str = Field(description="``results.parquet``: one row per trial, best first.")
    best: str = Field(description="``best.yaml``: the best trial's values as config overrides.")
    trials: int = Field(description="Trials that reported the metric.")


class StageRecord(StageResult):
    """One stage's entry in ``summary.json`` (and what :class:`StageSession` returns per stage)."""

    name: str = Field(description="Stage name.")
    type: str = Field(description="Stage type (``stages[i].type``).")
    status: Literal["trained", "reused", "tuned", "imported"] = Field(
        description="Trained in this run, reused from a matching artifact (``--resume``), the best trial of a "
        "sweep, or imported from ``pretrained`` with no training (``train.epochs: 0``, on the driver)."
    )
    wall_s: float = Field(description="Seconds from the stage's start to its artifact written; 0 when reused.")
    artifact: str = Field(description="The stage's artifact folder.")
    digest: str = Field(description="sha256 of the artifact's ``weights.safetensors``.")
    feature_cache: FeatureCacheRecord | None = Field(None, description="Set when the stage trained on cached inputs.")
    sweep: SweepRecord | None = Field(None, description="Set when the stage was swept with Ray Tune.")
    resumed_from_epoch: int | None = Field(
        None,
        description="Epochs done at the checkpoint this stage's training last continued from (``--resume`` of an "
        "interrupted stage, or a worker-group restart after a failure); None when it ran through from epoch 0.",
    )
    startup: dict[str, float] | None = Field(
        None,
        description="Seconds of the stage fit before its first optimizer step, by phase (rank 0): ``ray_train_s`` "
        "(``fit()`` to the worker process), ``worker_start_s`` (to the loop function), ``inputs_s`` (data, upstream "
        "and cached features fetched), ``setup_s`` (model and solver built), ``first_step_s``, and "
        "``to_first_step_s`` (their sum); see ``cascade_ray/stage/startup.py``. None when not trained here.",
    )

    @classmethod
    def from_manifest(cls, manifest: Manifest, **fields: Any) -> StageRecord:
        """The record of the stage `manifest` describes; `fields` are the record's own (name, status, ...)."""
        shared = {k: getattr(manifest, k) for k in StageResult.model_fields}
        return cls(**shared, digest=manifest.weights_sha256, **fields)


class StageState(_Record):
    """A stage of an unfinished run that has no record (yet): in ``summary.json`` while the run goes."""

    name: str = Field(description="Stage name.")
    type: str = Field(description="Stage type (``stages[i].type``).")
    status: Literal["running", "failed", "pending"] = Field(
        description="Running now, failed (the run stopped there; see ``error``), or not started yet."
    )
    error: str | None = Field(None, description="A failed stage's error: its type and message, cut at 2000 characters.")


class RunSummary(_Record):
    """``{storage_path}/{name}/summary.json``: every stage and the composed model on the test split.

    Rewritten as the run goes (after each stage starts and ends, and when it fails); ``status``
    says whether the run finished. Only a finished summary has the test results and a record
    for every stage.
    """

    name: str = Field(description="The pipeline's name (``name`` in the config).")
    status: Literal["running", "failed", "finished"] = Field(
        default="finished",
        description="``finished``: every stage and the test evaluation done; ``running``: the run is (or was, "
        "when its driver died) under way; ``failed``: it stopped on ``error``. Summaries written before the "
        "status existed are finished ones.",
    )
    error: str | None = Field(None, description="A failed run's error: its type and message, cut at 2000 characters.")
    test_accuracy: float | None = Field(
        default=None, description="Class targets: accuracy of the composed model (last head) on the test split."
    )
    test_loss: float | None = Field(
        default=None,
        description="Mean loss (the last stage's loss.type) of the composed model on the test split; "
        "set in a finished summary.",
    )
    test_metrics: dict[str, float] | None = Field(
        default=None,
        description="Every test metric of the target kind (loss, accuracy / top5_accuracy, micro_f1 / map, "
        "mae / rmse / r2); absent in summaries written before it existed.",
    )
    target_kind: str = Field(default="class", description="``data.target.kind`` of the run.")
    stages: list[Annotated[StageRecord | StageState, Field(discriminator="status")]] = Field(
        min_length=1,
        description="One entry per stage, in pipeline order: the record of a done stage, else its state "
        "(running, failed, pending).",
    )
    storage: str = Field(description="The run's folder, ``{storage_path}/{name}``.")

    @model_validator(mode="after")
    def _finished_is_complete(self) -> RunSummary:
        if self.status == "finished":
            if self.test_loss is None:
                raise ValueError("'test_loss' missing (a finished summary has the test results)")
            unfinished = [s.name for s in self.stages if isinstance(s, StageState)]
            if unfinished:
                raise ValueError(f"a finished summary has stages without a record: {', '.join(unfinished)}")
        return self

    @property
    def done(self) -> list[StageRecord]:
        """The records of the stages that are done, in pipeline order."""
        return [s for s in self.stages if isinstance(s, StageRecord)]

    def describe(self) -> str:
        """``finished``, or e.g. ``failed in stage 'head' (ValueError: ...)`` / ``running stage 'head'``."""
        if self.status == "finished":
            return "finished"
        at = next((s.name for s in self.stages if isinstance(s, StageState) and s.status != "pending"), None)
        where = "" if at is None else (f" in stage {at!r}" if self.status == "failed" else f" stage {at!r}")
        first = self.error.splitlines()[0] if self.error else ""
        if len(first) > 200:  # at the last space of the first 200 characters, unless that loses over half
            cut = first[:200].rfind(" ")
            first = (first[:cut] if cut > 100 else first[:200]) + " ..."
        return f"{self.status}{where}" + (f" ({first})" if first else "")


def error_text(exc: BaseException) -> str:
    """`exc` as summary.json keeps it: ``Type: message``, cut at :data:`ERROR_CHARS`."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 15] + " ... (cut here)"


def summary_status(path: StorageDir) -> str:
    """The ``status`` of the summary at `path`: ``absent`` when there is none; a file that does not
    parse as a summary with a running / failed status counts as ``finished`` (never trained over
    without --resume / --overwrite)."""
    if not path.exists():
        return "absent"
    if not_regular_reason(path) is not None:  # stat only: reading a FIFO would block
        return "finished"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return "finished"
    status = raw.get("status") if isinstance(raw, dict) else None
    return status if status in ("running", "failed") else "finished"


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _problem(exc: ValidationError) -> str:
    """The first problem pydantic found, in words, and how many more there are."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where, kind = _where(first["loc"]), first["type"]
    if kind == "json_invalid":
        text = f"not JSON ({first['msg'].removeprefix('Invalid JSON: ')})"
    elif kind == "model_type" and not first["loc"]:
        text = f"expected a JSON object, found {type(first['input']).__name__}"
    elif kind == "missing":
        text = f"{where!r} missing"
    elif kind == "extra_forbidden":
        text = f"unexpected key {where!r}"
    elif kind == "union_tag_invalid":  # a stage entry's status picks its kind (record or state)
        ctx = first.get("ctx", {})
        key = f"{where}.{ctx.get('discriminator', 'status')}".replace("'", "")
        text = f"{key!r}: {ctx.get('tag')!r} is not one of {ctx.get('expected_tags')}"
    elif kind == "value_error":
        text = f"{where!r}: {first['msg']}" if where else first["msg"].removeprefix("Value error, ")
    else:
        found = repr(first.get("input"))
        text = f"{where!r}: {first['msg']} (found {found[:60] + '...' if len(found) > 60 else found})"
    return text + (f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else "")


def _read(path: StorageDir, model: type[_Record], fix: str) -> Any:
    reason = not_regular_reason(path)  # stat only: reading a FIFO would block
    if reason is not None:
        raise ArtifactError(f"{path}: unreadable ({reason}); {fix}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: unreadable ({exc}); {fix}") from None
    try:
        return model.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise ArtifactError(f"{path}: {_problem(exc)}; {fix}") from None


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of `manifest`'s canonical JSON, every field but ``manifest_sha256`` (what it vouches for)."""
    fields = {k: v for k, v in manifest.to_json().items() if k != "manifest_sha256"}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal_manifest(manifest: Manifest) -> Manifest:
    """`manifest` with ``manifest_sha256`` set to the digest of its other fields."""
    return manifest.model_copy(update={"manifest_sha256": manifest_digest(manifest)})


def read_manifest(path: StorageDir) -> Manifest:
    """A ``manifest.json``, validated and checked against its own ``manifest_sha256``;
    :class:`ArtifactError` naming the file (and the bad key) otherwise."""
    manifest = _read(path, Manifest, MANIFEST_FIX)
    if manifest_digest(manifest) != manifest.manifest_sha256:
        raise ArtifactError(
            f"{path}: its fields do not match its manifest_sha256 (edited after it was written: a fingerprint, "
            f"metric or digest changed); {MANIFEST_FIX}"
        )
    return manifest


def read_summary(path: StorageDir) -> RunSummary:
    """A ``summary.json``, validated; :class:`ArtifactError` naming the file and the bad key otherwise."""
    return _read(path, RunSummary, SUMMARY_FIX)


def manifest_text(manifest: Manifest) -> str:
    """``manifest.json``'s content."""
    return json.dumps(manifest.to_json(), indent=2, sort_keys=True)


def summary_text(summary: RunSummary) -> str:
    """``summary.json``'s content."""
    return json.dumps(summary.to_json(), indent=2)
