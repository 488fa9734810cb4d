"""Running one stage inside a pipeline session: reuse a matching artifact, or fit, check and persist.

A :class:`Handoff` is a finished stage as the next one sees it: the composed numpy state
(put in the object store once), its object ref and its fingerprint. A :class:`StageRunner`
turns (session, stage index, upstream) into a :class:`StageOutcome`; the driver's default is
:meth:`StageSession.run` (reuse or fit), and a sweep runner (``cascade_ray.tune.run``) is
injected by the API for stages that have a search space.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import ray
import ray.train

from cascade_ray import __version__
from cascade_ray.config.metrics import retention_metric
from cascade_ray.config.schema import PipelineConfig
from cascade_ray.data import DataSplits
from cascade_ray.data.splits import DataInfo
from cascade_ray.errors import FrozenDriftError
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.freeze import apply_freeze, plan_trainable
from cascade_ray.models.meta import meta_device
from cascade_ray.models.plan import require_plans
from cascade_ray.models.pretrained import pretrained_sha256
from cascade_ray.models.weights import NumpyState, state_digests
from cascade_ray.options import RunOptions
from cascade_ray.pipeline.artifacts import frozen_changes, read_artifact, write_artifact
from cascade_ray.pipeline.features import FeatureCache, prepare_feature_cache
from cascade_ray.pipeline.fit import drop_last_checkpoint, fit_stage, resumable_run, unique_run_name
from cascade_ray.pipeline.imported import import_stage
from cascade_ray.pipeline.outputs import without_credentials
from cascade_ray.pipeline.records import Manifest, ManifestFields, StageRecord
from cascade_ray.pipeline.stream_cache import StreamedCache, prepare_streamed_cache
from cascade_ray.stage.worker import CHECKPOINT_NODES, CHECKPOINT_STATE, read_checkpoint
from cascade_ray.tracking import TrackingContext, flatten


@dataclass(frozen=True)
class Handoff:
    """A finished stage, ready to be the frozen upstream of the next one."""

    state: NumpyState
    ref: ray.ObjectRef
    fingerprint: str
    digests: Mapping[str, str] | None = None
    """Every tensor's digest, as the stage's artifact manifest records them: taken from `state` as it
    was written, or checked against it as it was read. None: unknown (hashed where needed)."""


@dataclass(frozen=True)
class StageOutcome:
    """What running one stage produced."""

    record: dict[str, Any]
    handoff: Handoff
    cfg: PipelineConfig
    """The pipeline config from this stage on: a sweep's best trial's values, else unchanged."""


class StageRunner(Protocol):
    """Runs stage `index` of `session` on top of `upstream` (a fit, a sweep, ...)."""

    def __call__(self, session: StageSession, index: int, upstream: Handoff | None) -> StageOutcome: ...


def stage_accounting(
    cfg: PipelineConfig, index: int, input_shape: tuple[int, ...], out_width: int
) -> tuple[int, list[str], int]:
    """(trainable params, frozen state-dict keys, frozen params) of stage `index`, built on meta."""
    plans = require_plans(cfg, input_shape, out_width)
    with meta_device():
        model = build_cascade(cfg, plans, out_width, upto=index)
    plan = plan_trainable(model, cfg, index)
    apply_freeze(model, plan)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, list(plan.frozen_keys), sum(p.numel() for p in model.parameters()) - trainable


# Stage-record and manifest entries the worker decides on its device (StageOutcome fields).
DEVICE_KEYS = ("precision", "memory_format", "compile")


def fingerprint_inputs(cfg: PipelineConfig, index: int, parent: str, data_fp: str) -> dict[str, Any]:
    """What stage `index`'s fingerprint hashes (:func:`stage_fingerprint`): its config, its parent's
    fingerprint, the data's, the seed, the package version, and the sha256 of its pretrained file's
    bytes. Kept in the artifact's manifest, so a ``--resume`` that trains the stage again can say why."""
    stage = cfg.stages[index].model_dump(mode="json")
    stage.pop("freeze", None)  # how the inputs are computed (feature cache), not what is trained
    if stage.get("seed") is None:  # unset: the pipeline seed decides (below), as before the key existed
        stage.pop("seed", None)
    # how many checkpoints are kept changes no weights; which one becomes the artifact does, so a
    # non-default ranking enters (and the default leaves every fingerprint as it was)
    retention = stage["train"].pop("checkpoint", {})
    ranking = {k: retention[k] for k in ("metric", "mode") if retention.get(k, "auto") != "auto"}
    parts = {"stage": stage, "parent": parent, "data": data_fp, "seed": cfg.seed, "version": __version__}
    if ranking:
        parts["checkpoint"] = ranking
    pretrained = cfg.stages[index].pretrained
    if pretrained is not None:  # only then, so other stages keep the fingerprints they had
        parts["pretrained_sha256"] = pretrained_sha256(pretrained.path)
    return parts


def fingerprint_of(parts: Mapping[str, Any]) -> str:
    """The fingerprint of :func:`fingerprint_inputs`' parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def stage_fingerprint(cfg: PipelineConfig, index: int, parent: str, data_fp: str) -> str:
    """Hash of the stage's config, its parent's fingerprint, the data, the seed and the package version,
    and the sha256 of its pretrained file's bytes (a changed file never reuses an old artifact)."""
    return fingerprint_of(fingerprint_inputs(cfg, index, parent, data_fp))


# changed config keys named in a resume's "training again" line; the rest are counted
CHANGES_SHOWN = 5


def fingerprint_changes(manifest: Manifest, now: Mapping[str, Any], *, stage: str, parent: str | None = None) -> str:
    """Why a stored artifact's fingerprint differs from the config's now (`now`:
    :func:`fingerprint_inputs`), as a resume logs it (:func:`input_changes`). An artifact written
    before its manifest kept ``fingerprint_inputs`` tells only the parent and the data apart (every
    manifest records their fingerprints)."""
    stored = manifest.fingerprint_inputs or {"parent": manifest.parent_fingerprint, "data": manifest.data_fingerprint}
    return input_changes(stored, now, stage=stage, parent=parent)


def input_changes(old: Mapping[str, Any], now: Mapping[str, Any], *, stage: str, parent: str | None = None) -> str:
    """What differs between two :func:`fingerprint_inputs`: ``stages.classifier.solver.lr: 0.001 -> 0.003``,
    ``the upstream stage 'encoder' changed``, ``the data changed``, ``seed: 0 -> 1``, ...; `old` without
    a ``stage`` entry (only ``parent`` and ``data`` known) adds a general reason when those match."""
    why: list[str] = []
    if old.get("parent") != now["parent"]:
        why.append(f"the upstream stage{f' {parent!r}' if parent else ''} changed")
    if old.get("data") != now["data"]:
        why.append("the data changed")
    if "stage" not in old:
        return "; ".join(why) or "the config, the seed or the package version changed (the artifact records no more)"
    before = flatten({"stage": old["stage"]})
    after = flatten({"stage": now["stage"]})
    keys = changed_keys(before, after)
    named = [
        f"stages.{stage}.{k[len('stage.') :]}: {_shown(before.get(k, _UNSET))} -> {_shown(after.get(k, _UNSET))}"
        for k in keys
    ]
    if len(named) > CHANGES_SHOWN:
        named = [*named[:CHANGES_SHOWN], f"and {len(named) - CHANGES_SHOWN} more config key(s)"]
    why += named
    for key, label in (("checkpoint", f"stages.{stage}.train.checkpoint"), ("seed", "seed")):
        if old.get(key) != now.get(key):
            why.append(f"{label}: {_shown(old.get(key, _UNSET))} -> {_shown(now.get(key, _UNSET))}")
    if old.get("pretrained_sha256") != now.get("pretrained_sha256"):
        why.append(f"stages.{stage}.pretrained.path: the file's bytes changed")
    if old.get("version") != now.get("version"):
        why.append(f"cascade-ray {old.get('version')} wrote it, this is {now.get('version')}")
    return "; ".join(why) or "its fingerprint differs"


_UNSET = object()


def changed_keys(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The keys of two flat mappings whose values differ (one side missing counts), in first-seen order."""
    return [k for k in dict.fromkeys([*before, *after]) if before.get(k, _UNSET) != after.get(k, _UNSET)]


def _shown(value: Any) -> str:
    return "(unset)" if value is _UNSET else json.dumps(value)


@dataclass
class StageSession:
    """What every stage of one pipeline run shares: config, output folder, data in the object store."""

    cfg: PipelineConfig
    out: Path
    data_ref: ray.ObjectRef | None  # the in-memory splits; None when the data is streamed (`stream`)
    data_fp: str
    input_shape: tuple[int, ...]
    out_width: int  # outputs of the last head: classes, or regression values
    log: Callable[[str], None] = print
    data_spec: dict[str, Any] = field(default_factory=dict)  # DataSplits.spec(): into every manifest
    split_sizes: dict[str, int] = field(default_factory=dict)  # samples per split, for the feature cache
    options: RunOptions = field(default_factory=RunOptions)
    board: Any = None  # the run's progress board (None: no live display)
    stream: Any = None  # pipeline.streaming.StreamedData when data.streaming streams the rows
    tracking: TrackingContext | None = None  # the pipeline run's trackers (cascade_ray/tracking/)
    # (stage index, the cached inputs it trained on) of the newest cached stage only: the next
    # stage computes its own from it, older ones would pin object-store memory to the end
    newest_cache: tuple[int, FeatureCache | StreamedCache] | None = None

    def artifact_dir(self, index: int) -> Path:
        return self.out / "stages" / self.cfg.stages[index].name

    def run(self, index: int, upstream: Handoff | None, *, resume: bool) -> tuple[dict[str, Any], Handoff]:
        """Reuse (with ``resume``) or train stage `index`; return its summary record and hand-off."""
        stage = self.cfg.stages[index]
        parent = upstream.fingerprint if upstream else ""
        fp = stage_fingerprint(self.cfg, index, parent, self.data_fp)
        if resume:
            reused = self._reuse(index, fp, parent)
            if reused is not None:
                return reused
        t0 = time.perf_counter()
        if stage.train.epochs == 0:
            return self._import(index, upstream, fp=fp, started=t0)
        cache = self.feature_cache(index, upstream)
        name = self._resumable(index, fp) if resume else None
        name = name or unique_run_name(self.out / "ray", stage, index, fp)
        result = fit_stage(
            self.cfg,
            index,
            data_ref=self.data_ref,
            upstream_ref=upstream.ref if upstream else None,
            upstream_digests=upstream.digests if upstream else None,
            ray_dir=self.out / "ray",
            run_name=name,
            features_ref=cache.ref if cache is not None and self.stream is None else None,
            options=self.options,
            board=self.board,
            stream=cache if cache is not None and self.stream is not None else self.stream,
            tracking=dataclasses.replace(self.tracking, fingerprint=fp) if self.tracking is not None else None,
        )
        return self.finish(index, upstream, result, fp=fp, run_name=name, started=t0)

    def _resumable(self, index: int, fp: str) -> str | None:
        """The Ray run name that continues an interrupted stage `index` from its latest checkpoint."""
        stage = self.cfg.stages[index]
        found = resumable_run(self.out / "ray", stage, index, fp, on_skip=self.log)
        if found is None:
            return None
        name, done = found
        self.log(
            f"  resuming stage {stage.name} at epoch {done + 1} of {stage.train.epochs} "
            f"(its Ray run {name} checkpointed after epoch {done})"
        )
        return name

    def feature_cache(self, index: int, upstream: Handoff | None) -> FeatureCache | StreamedCache | None:
        """Stage `index`'s cached upstream outputs (computed or read), or None when it trains on raw inputs."""
        if upstream is None:
            return None
        plan = next(
            p
            for p in require_plans(self.cfg, self.input_shape, self.out_width)
            if p.name == self.cfg.stages[index].name
        )
        # streamed data: computed by Ray Data, stored as shards, streamed back; else in the object store
        prepare, rows = (
            (prepare_streamed_cache, {"stream": self.stream})
            if self.stream is not None
            else (prepare_feature_cache, {"data_ref": self.data_ref, "sizes": self.split_sizes})
        )
        cache = prepare(
            self.cfg,
            index,
            out=self.out,
            in_shape=plan.in_shape,
            upstream=upstream,
            previous=self.cache_of(index - 1),
            log=self.log,
            **rows,
        )
        self.newest_cache = (index, cache) if cache is not None else None
        return cache

    def cache_of(self, index: int) -> FeatureCache | StreamedCache | None:
        """The cached inputs stage `index` trained on, if it is the newest cached stage."""
        return self.newest_cache[1] if self.newest_cache is not None and self.newest_cache[0] == index else None

    def finish(
        self,
        index: int,
        upstream: Handoff | None,
        result: ray.train.Result,
        *,
        fp: str,
        run_name: str,
        started: float,
        history: list[dict[str, Any]] | None = None,
    ) -> tuple[dict[str, Any], Handoff]:
        """Best checkpoint -> frozen hand-off check -> durable artifact -> one ray.put.

        `history` is taken from rank 0's return value when the fit returned one (a run
        read back from storage, e.g. a Tune trial, passes it in).
        """
        stage = self.cfg.stages[index]
        metric, mode = retention_metric(self.cfg, stage)
        best = result.get_best_checkpoint(metric, mode)
        with best.as_directory() as ckpt:
            # a reference checkpoint's frozen entries come from the upstream, their recorded digests checked
            weights = (
                read_checkpoint(ckpt, upstream.state, upstream.digests)
                if upstream is not None
                else read_checkpoint(ckpt)
            )
            state = weights.state
            metrics = json.loads((Path(ckpt) / CHECKPOINT_STATE).read_text())
            nodes_file = Path(ckpt) / CHECKPOINT_NODES  # where the workers ran (a Tune trial's too)
            nodes = json.loads(nodes_file.read_text()) if nodes_file.is_file() else None
        trainable, frozen_keys, frozen_params = stage_accounting(self.cfg, index, self.input_shape, self.out_width)
        referenced = weights.frozen_digests or {}
        if upstream is not None:
            # compare bits with the upstream, independent of the worker's own per-epoch check; the entries a
            # reference checkpoint named were compared as it was read: the worker's digests of its frozen
            # tensors after the epoch's validation (taken just before the checkpoint) against the upstream's
            changed = frozen_changes({k: upstream.state[k] for k in frozen_keys if k not in referenced}, state)
            if changed:
                raise FrozenDriftError(
                    f"stage {stage.name!r}: {len(changed)} frozen tensor(s) differ from the upstream artifact: {', '.join(changed[:5])}"
                )
        # a reference checkpoint's digests were checked against the upstream as it was read: not hashed again
        hashed = state_digests(state, [k for k in frozen_keys if k not in referenced])
        frozen_digests = dict(sorted((hashed | {k: referenced[k] for k in frozen_keys if k in referenced}).items()))
        outcome = result.return_value or {}
        fields = ManifestFields(
            metrics=metrics,
            history=outcome.get("history", history or []),
            num_workers=outcome.get("world_size", stage.scaling.num_workers),
            trainable_params=trainable,
            frozen_params=frozen_params,
            fingerprint=fp,
            ray_run=run_name,
            stage=stage.name,
            index=index,
            parent_fingerprint=upstream.fingerprint if upstream else "",
            data_fingerprint=self.data_fp,
            frozen_digest=frozen_digests,
            nodes=nodes,
            data_spec=self.data_spec or None,
            # what the worker's device made of precision auto / memory format / compile
            **{k: outcome.get(k) for k in DEVICE_KEYS},
        )
        cache = self.cache_of(index)
        done = self._persist(
            index,
            state,
            fields,
            "trained",
            frozen_digests,  # known: the artifact hashes only what the stage trained
            started,
            feature_cache=cache.record() if cache is not None else None,
            resumed_from_epoch=outcome.get("resumed_from_epoch"),
            startup=outcome.get("startup"),
        )
        if not stage.train.checkpoint.save_last:  # only now: the artifact is durable, nothing resumes the run
            drop_last_checkpoint(result, metric, mode, stage.train.checkpoint.top_k)
        return done

    def _persist(
        self,
        index: int,
        state: NumpyState,
        fields: ManifestFields,
        status: str,
        known: Mapping[str, str],
        started: float,
        **extra: Any,
    ) -> tuple[dict[str, Any], Handoff]:
        """Write stage `index`'s artifact; its record (`extra`: the record's own optional fields) and hand-off.

        `known`: digests of entries of `state` already taken from these very arrays, not hashed again.
        """
        stage = self.cfg.stages[index]
        parts = fingerprint_inputs(self.cfg, index, fields.parent_fingerprint, fields.data_fingerprint)
        if fingerprint_of(parts) == fields.fingerprint:  # what a later --resume compares with
            fields = fields.model_copy(update={"fingerprint_inputs": without_credentials(parts)})
        artifact = write_artifact(self.artifact_dir(index), state, fields, known=known)
        record = StageRecord.from_manifest(
            artifact.manifest,
            name=stage.name,
            type=stage.type,
            status=status,
            wall_s=round(time.perf_counter() - started, 2),
            artifact=str(artifact.path),
            **extra,
        ).to_json()
        # one put; every next-stage worker reads it
        return record, Handoff(state, ray.put(state), fields.fingerprint, artifact.manifest.tensor_digests)

    def _import(
        self, index: int, upstream: Handoff | None, *, fp: str, started: float
    ) -> tuple[dict[str, Any], Handoff]:
        """An import-only stage (``train.epochs: 0``): built, loaded, frozen and evaluated here on the
        driver (no Ray Train job, no Ray run folder), then persisted and handed on like a trained one."""
        stage = self.cfg.stages[index]
        if self.data_ref is not None:
            data: DataSplits | DataInfo = DataSplits.from_arrays(ray.get(self.data_ref))
        else:
            s = self.stream
            data = DataInfo(self.input_shape, self.out_width, s.target_kind, s.n_train, s.mean, s.std)
        done = import_stage(self.cfg, index, data, upstream.state if upstream else None, log=self.log)
        state = done.state
        if upstream is not None:  # the composed state carries the upstream bit for bit
            changed = frozen_changes(upstream.state, state)
            if changed:
                raise FrozenDriftError(
                    f"stage {stage.name!r}: {len(changed)} upstream tensor(s) differ after the import: {', '.join(changed[:5])}"
                )
        fields = ManifestFields(
            metrics=done.metrics,
            history=[],
            num_workers=0,
            trainable_params=0,
            frozen_params=done.frozen_params,
            fingerprint=fp,
            ray_run="",
            stage=stage.name,
            index=index,
            parent_fingerprint=upstream.fingerprint if upstream else "",
            data_fingerprint=self.data_fp,
            frozen_digest=state_digests(state),  # all of it: an imported stage trains nothing
            data_spec=self.data_spec or None,
        )
        return self._persist(index, state, fields, "imported", fields.frozen_digest, started)

    def _reuse(self, index: int, fp: str, parent: str) -> tuple[dict[str, Any], Handoff] | None:
        """The stored artifact when its fingerprint matches and it verifies; None to retrain.

        `parent`: the upstream's fingerprint `fp` was taken with."""
        path = self.artifact_dir(index)
        stage = self.cfg.stages[index]
        if not (path / "manifest.json").exists():
            self.log(f"  {stage.name}: no artifact to reuse, training")
            return None
        # a damaged artifact is an error, never silently retrained over nor reused
        artifact, state = read_artifact(path)
        manifest = artifact.manifest
        if manifest.fingerprint != fp:
            now = without_credentials(fingerprint_inputs(self.cfg, index, parent, self.data_fp))  # as stored
            parent_name = self.cfg.stages[index - 1].name if index > 0 else None
            why = fingerprint_changes(manifest, now, stage=stage.name, parent=parent_name)
            self.log(f"  {stage.name}: changed since the stored artifact ({why}), training")
            return None
        record = StageRecord.from_manifest(
            manifest, name=stage.name, type=stage.type, status="reused", wall_s=0.0, artifact=str(path)
        ).to_json()
        return record, Handoff(state, ray.put(state), fp, manifest.tensor_digests)
