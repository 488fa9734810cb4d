"""One stage as one Ray Train ``TorchTrainer`` job, and the checks around it."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import ray.train

from cascade_ray.config.metrics import retention_metric
from cascade_ray.config.schema import PipelineConfig, StageConfig
from cascade_ray.constants import FAULT_ONCE_ENV
from cascade_ray.errors import CascadeError, ResourceError, RunInterruptedError
from cascade_ray.logs import train_logging_config
from cascade_ray.models.plan import known_plans
from cascade_ray.options import RunOptions
from cascade_ray.pipeline.failures import stage_failure, training_error
from cascade_ray.pipeline.no_retry import NoRetry
from cascade_ray.pipeline.trainer import StageTrainer
from cascade_ray.ray_compat import autoscaler_node_groups, autoscaling_status, read_run_result, unreadable_run_errors
from cascade_ray.stage.observe import observer_config
from cascade_ray.stage.worker import train_loop_per_worker
from cascade_ray.storage import StorageDir, full_uri
from cascade_ray.tracking import TrackingContext


def unique_run_name(ray_dir: StorageDir, stage: StageConfig, index: int, fingerprint: str) -> str:
    """A deterministic Ray Train run name that no earlier run in `ray_dir` has used.

    Ray 2.60 silently resumes a run whose ``(storage_path, name)`` already exists, so
    a rerun of the same stage gets the next free attempt number instead.
    """
    prefix, taken = _attempts(ray_dir, stage, index, fingerprint)
    return f"{prefix}-a{max(taken, default=0) + 1}"


def _attempts(ray_dir: StorageDir, stage: StageConfig, index: int, fingerprint: str) -> tuple[str, list[int]]:
    prefix = f"{index:02d}-{stage.name}-{fingerprint[:12]}"
    taken = sorted(
        int(m.group(1))
        for p in ray_dir.glob(f"{prefix}-a*")
        if (m := re.fullmatch(re.escape(prefix) + r"-a(\d+)", p.name))
    )
    return prefix, taken


def resumable_run(
    ray_dir: StorageDir,
    stage: StageConfig,
    index: int,
    fingerprint: str,
    on_skip: Callable[[str], None] | None = None,
) -> tuple[str, int] | None:
    """The newest earlier Ray run of this exact stage (same fingerprint: config, upstream, data)
    that registered a checkpoint, and the epochs that checkpoint had done; None when there is none.

    Rerunning a Ray Train run under its ``(storage_path, name)`` restores it from its latest
    registered checkpoint (Ray's own convention), so ``--resume`` hands this name to
    :func:`fit_stage` to continue an interrupted stage instead of retraining it. When the newest
    run exists but Ray cannot read it back, `on_skip` gets a line saying so and why (the stage
    then trains from its start: progress is lost, and the user is told).
    """
    prefix, taken = _attempts(ray_dir, stage, index, fingerprint)
    if not taken:
        return None
    name = f"{prefix}-a{taken[-1]}"
    try:
        result = read_run_result(full_uri(ray_dir / name))
    # no checkpoint snapshot (the run never got to one), a snapshot cut short (the driver killed while
    # Ray rewrote it in place), or one naming a deleted checkpoint (save_last: false)
    except (*unreadable_run_errors(), OSError, ValueError) as exc:
        if on_skip is not None:
            on_skip(
                f"  stage {stage.name}: its interrupted Ray run {name} cannot be continued ({_unreadable(exc)}); "
                "it trains from its first epoch in a new attempt"
            )
        return None
    if result.checkpoint is None:
        return None
    return name, int((result.metrics or {}).get("epoch", 0))


def _unreadable(exc: BaseException) -> str:
    """Why Ray could not read a run folder back, for a user."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, json.JSONDecodeError):
            return (
                "its checkpoint snapshot is empty or cut short: the driver was most likely killed while Ray Train "
                "rewrote it"
            )
        cause = cause.__cause__ or cause.__context__
    return f"Ray cannot read it back: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"


@dataclass(frozen=True)
class Cluster:
    """What the cluster has (alive nodes) and may get (the autoscaler's node groups).

    Attributes:
        nodes: resources of each alive node.
        hosts: distinct machines among them.
        groups: ``(resources per node, max nodes)`` per autoscaler node group (-1: no
            limit), from Ray's cluster config when the autoscaler publishes one.
        autoscaling: an autoscaler runs (launcher / KubeRay), limits known or not.
    """

    nodes: tuple[Mapping[str, float], ...]
    hosts: int = 1
    groups: tuple[tuple[Mapping[str, float], int], ...] = ()
    autoscaling: bool = False

    @property
    def may_add_nodes(self) -> bool:
        return (
            self.autoscaling
            or any(count < 0 for _, count in self.groups)
            or sum(count for _, count in self.groups) > len(self.nodes)
        )

    def placeable(self, per_worker: Mapping[str, float], strategy: str = "PACK") -> float:
        """Workers asking `per_worker` each that fit at once: on the alive nodes, or on the
        largest cluster the autoscaler may build (Ray Train's own check uses the latter).

        `strategy` is the placement group's: ``STRICT_SPREAD`` counts at most one worker per
        node, ``STRICT_PACK`` only the workers one node holds; ``PACK``/``SPREAD`` are best
        effort and count every worker that fits anywhere.
        """
        alive = [(n, 1) for n in self.nodes]
        return max(_placeable(per_worker, alive, strategy), _placeable(per_worker, self.groups, strategy))

    def describe(self) -> str:
        total: dict[str, float] = {}
        for res in self.nodes:
            for key, value in res.items():
                total[key] = total.get(key, 0.0) + value
        shown = ", ".join(f"{total.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))
        text = f"{len(self.nodes)} alive node(s) with {shown} in total"
        if self.groups:
            text += "; autoscaler groups: " + ", ".join(
                f"{'unbounded' if c < 0 else c} x {_fmt(r)}" for r, c in self.groups
            )
        return text


def _placeable(per_worker: Mapping[str, float], nodes: Any, strategy: str = "PACK") -> float:
    wanted = {k: v for k, v in per_worker.items() if v > 0}
    count = 0.0
    for res, copies in nodes:
        fit = min((math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in wanted.items()), default=math.inf)
        if not fit or not copies:
            continue
        if strategy == "STRICT_PACK":  # every worker on one node: the largest node decides
            count = max(count, fit)
        elif strategy == "STRICT_SPREAD":  # one worker per node
            count += math.inf if copies < 0 else copies
        else:
            count += fit * (math.inf if copies < 0 else copies)
    return count


def _fmt(res: Mapping[str, float]) -> str:
    return (
        "{"
        + ", ".join(
            f"{k}: {v:g}"
            for k, v in sorted(res.items())
            if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))
        )
        + "}"
    )


def cluster_view() -> Cluster:
    """The connected cluster (after ``ray.init``)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    groups = _autoscaler_groups()
    return Cluster(
        tuple(n["Resources"] for n in alive),
        count_hosts([n.get("NodeManagerAddress") or "" for n in alive]),
        groups,
        bool(groups) or _autoscaler_running(),
    )


def count_hosts(addresses: list[str], is_local: Callable[[str], bool] | None = None) -> int:
    """Distinct machines among the nodes' addresses; every address of this machine (loopback,
    or one a socket here can bind to) counts as this one machine.

    Several nodes on one host (``cluster/local_head.sh add-node``) share its filesystems, so
    they are one machine for the node-local storage check, whichever of the host's
    addresses each one reports.
    """
    is_local = is_local or is_local_address
    local = {a for a in set(addresses) if a and is_local(a)}
    return len(set(addresses) - local) + (1 if local else 0)


def is_local_address(address: str) -> bool:
    """True when `address` is loopback or an address of one of this machine's interfaces."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))  # only an address of this machine binds
        return True
    except OSError:
        return False


def _autoscaler_running() -> bool:
    # a private Ray read (ray_compat); unknown means "no autoscaler" (strict checks)
    return autoscaler_in_status(autoscaling_status())


def autoscaler_in_status(raw: bytes | str | None) -> bool:
    """True when Ray's monitor status shows an autoscaler with configured node types (cluster
    launcher, KubeRay). A head started without an autoscaling config (local_head.sh, an embedded
    Ray) gets Ray's read-only stand-in, whose node types are ``node_<node id>``."""
    report = json.loads(raw).get("autoscaler_report") if raw else None
    if not report:
        return False
    types = {
        *(report.get("active_nodes") or {}),
        *(report.get("idle_nodes") or {}),
        *(report.get("pending_launches") or {}),
    }
    return any(not re.fullmatch(r"node_[0-9a-f]+", t) for t in types)


def _autoscaler_groups() -> tuple[tuple[dict[str, float], int], ...]:
    # a private Ray read (ray_compat: what Ray Train's worker-group check reads); absent -> alive nodes only
    return autoscaler_node_groups()


def resolve_use_gpu(stage: StageConfig, cluster: Cluster) -> bool:
    """``scaling.use_gpu`` as a bool: ``auto`` is GPU when the cluster can place every
    worker of the stage with a GPU, as its placement strategy asks (or resources_per_worker
    names one), else CPU."""
    setting = stage.scaling.use_gpu
    if setting != "auto":
        return bool(setting)
    asked = (stage.scaling.resources_per_worker or {}).get("GPU")
    if asked is not None:
        return asked > 0
    gpu_workers = _resources(stage, True)
    return min(cluster.placeable(gpu_workers), cluster.placeable(gpu_workers, stage.scaling.placement_strategy)) >= (
        stage.scaling.num_workers
    )


def _resources(stage: StageConfig, use_gpu: bool) -> dict[str, float]:
    res = dict(stage.scaling.resources_per_worker or {"CPU": 1.0})
    if use_gpu:
        res.setdefault("GPU", 1.0)
    return res


def worker_resources(stage: StageConfig, use_gpu: bool | None = None) -> dict[str, float]:
    """Resources one worker of `stage` asks Ray for (``use_gpu`` None: resolve ``auto`` on the live cluster)."""
    if use_gpu is None:
        use_gpu = stage.scaling.use_gpu if stage.scaling.use_gpu != "auto" else resolve_use_gpu(stage, cluster_view())
    return _resources(stage, bool(use_gpu))


def check_resources(cfg: PipelineConfig, cluster: Cluster | None = None) -> list[str]:
    """Fail fast when a stage asks for more than the cluster can ever place, or for a GPU-only
    feature on CPU. Returns one line per ``use_gpu: auto`` decision.

    Without this, Ray Train retries starting the worker group forever.
    """
    cluster = cluster or cluster_view()
    decisions = []
    for i, stage in enumerate(cfg.stages):
        sc, key = stage.scaling, f"stages[{i}].scaling"
        use_gpu = resolve_use_gpu(stage, cluster)
        per_worker = _resources(stage, use_gpu)
        fits = cluster.placeable(per_worker)
        strict = cluster.placeable(per_worker, sc.placement_strategy)
        if fits < sc.num_workers:
            need = (
                f"{key}: stage {stage.name!r} needs {sc.num_workers} worker(s) x {_fmt(per_worker)} (each worker's "
                f"resources on one node), but the cluster can place at most {fits:g} at once ({cluster.describe()})."
            )
            fix = f"Lower {key}.num_workers or resources_per_worker{', or set use_gpu: auto' if sc.use_gpu is True else ''}, or add nodes."
        elif strict < sc.num_workers:
            where = "each on a node of its own" if sc.placement_strategy == "STRICT_SPREAD" else "all on one node"
            need = (
                f"{key}.placement_strategy: stage {stage.name!r} asks for {sc.placement_strategy}: {sc.num_workers} "
                f"worker(s) x {_fmt(per_worker)} {where}, but the cluster can place at most {strict:g} that way "
                f"({cluster.describe()})."
            )
            fix = f"Set {key}.placement_strategy: {'SPREAD' if sc.placement_strategy == 'STRICT_SPREAD' else 'PACK'} (best effort), lower {key}.num_workers, or add nodes."
        if min(fits, strict) < sc.num_workers:
            if not (cluster.autoscaling and not cluster.groups):
                raise ResourceError(f"{need} {fix}")
            # an autoscaler with unpublished limits may still add nodes that fit
            decisions.append(
                f"WARNING: {need} An autoscaler runs, so Ray waits for it to add nodes; if none of its node groups fits, the stage waits forever."
            )
        if not use_gpu and sc.num_workers > 1 and sc.sync_batchnorm:
            raise ResourceError(
                f"{key}.sync_batchnorm: stage {stage.name!r} runs on CPU ({sc.num_workers} workers), and torch's SyncBatchNorm needs GPUs. Set {key}.sync_batchnorm: false, or run the stage on GPUs."
            )
        if not use_gpu and stage.solver.precision == "fp16":
            raise ResourceError(
                f"stages[{i}].solver.precision: stage {stage.name!r} runs on CPU (use_gpu {sc.use_gpu}), and fp16 needs a CUDA GPU. Set precision: bf16, or give the cluster GPUs."
            )
        if sc.use_gpu == "auto":
            decisions.append(
                f"stage {stage.name!r}: use_gpu auto -> {'GPU (NCCL)' if use_gpu else 'CPU (gloo)'} x {sc.num_workers} worker(s)"
            )
    return decisions


def fit_stage(
    cfg: PipelineConfig,
    index: int,
    *,
    data_ref: ray.ObjectRef | None,
    upstream_ref: ray.ObjectRef | None,
    upstream_digests: Mapping[str, str] | None = None,
    ray_dir: StorageDir,
    run_name: str,
    callbacks: list[Any] | None = None,
    features_ref: ray.ObjectRef | None = None,
    options: RunOptions | None = None,
    board: Any = None,
    stream: Any = None,
    train_loop: Callable[[dict[str, Any]], Any] = train_loop_per_worker,
    loop_extra: Mapping[str, Any] | None = None,
    tracking: TrackingContext | None = None,
) -> ray.train.Result:
    """Train one stage as a TorchTrainer job (:class:`StageTrainer`) and return its Result.

    ``upstream_digests``: the tensor digests of the state behind ``upstream_ref`` (``Handoff.digests``);
    ``callbacks`` go to ``RunConfig`` (Tune trials pass ``TuneReportCallback``); ``features_ref``
    holds the stage's cached upstream outputs (:mod:`cascade_ray.pipeline.features`);
    ``options`` are the run's (log level, profiled stages), ``board`` its progress board
    (``None``: workers print their own progress); ``stream`` the
    :class:`~cascade_ray.pipeline.streaming.StreamedData` when the rows are streamed: the fit then
    gets fresh Ray Datasets of the train and val parts, and its workers their shards.
    ``train_loop`` is what the workers run (a batched sweep's loop), ``loop_extra`` its own
    loop-config keys. ``tracking`` is the pipeline run's tracking context (:mod:`cascade_ray.tracking`):
    rank 0 then opens the stage's ``loggers:`` under it.

    Raises:
        CascadeError: a worker raised one (re-raised as is, with its message). One that a restart
            would repeat (:mod:`cascade_ray.pipeline.no_retry`) ends the fit at once, whatever
            ``max_failures`` allows.
    """
    options = options or RunOptions()
    stage = cfg.stages[index]
    use_gpu = resolve_use_gpu(stage, cluster_view())
    pipeline = cfg.model_dump(mode="json")
    pipeline["stages"][index]["scaling"]["use_gpu"] = use_gpu  # workers see the decision, not `auto`
    score = retention_metric(cfg, stage)
    if tracking is not None and cfg.loggers.tensorboard:
        from cascade_ray.tracking.tensorboard_live import clear_events, tensorboard_dir

        clear_events(tensorboard_dir(tracking.run_dir, stage.name, tracking.trial))  # a rerun's old curves
    trainer = StageTrainer(
        train_loop,
        train_loop_config={
            **(loop_extra or {}),
            "pipeline": pipeline,
            "stage_index": index,
            # refs inside lists: the worker ray.get()s them itself
            "data_ref": [data_ref] if data_ref is not None else [],
            "stream": stream.loop_config() if stream is not None else None,
            "upstream_ref": [upstream_ref] if upstream_ref is not None else [],
            # its tensor digests (the hand-off's): workers take them instead of hashing the upstream
            "upstream_digests": dict(upstream_digests) if upstream_digests is not None else None,
            "features_ref": [features_ref] if features_ref is not None else [],
            "fault_once": os.environ.get(FAULT_ONCE_ENV, ""),  # test hook, see constants.py
            "fit_started": time.time(),  # the start-up phases count from here (cascade_ray/stage/startup.py)
            "plans": known_plans(),  # this process's shape plans: the workers do not plan again
            # progress, log level, --profile trace, live trackers
            **observer_config(cfg, index, ray_dir.parent, options, board, tracking),
        },
        **_stream_args(stream),
        # backend: Ray Train picks NCCL when workers have GPUs, gloo otherwise (TorchConfig(backend=None))
        scaling_config=ray.train.ScalingConfig(
            num_workers=stage.scaling.num_workers,
            use_gpu=use_gpu,
            resources_per_worker=stage.scaling.resources_per_worker,
            placement_strategy=stage.scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=run_name,
            storage_path=full_uri(ray_dir),
            # an error a restart would only repeat ends the fit now, not after max_failures restarts
            callbacks=[*(callbacks or []), NoRetry()],
            logging_config=train_logging_config(
                options.log_level
            ),  # Ray Train's own INFO lines only with --log-level debug
            # a crashed worker restarts the group from the latest checkpoint (trainer state included)
            failure_config=ray.train.FailureConfig(max_failures=stage.max_failures),
            # the top_k best by train.checkpoint.metric; Ray keeps the newest as well while it trains
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=stage.train.checkpoint.top_k,
                checkpoint_score_attribute=score[0],
                checkpoint_score_order=score[1],
            ),
        ),
    )
    # Ray Train 2.60 installs a SIGINT handler in the driver for each fit and leaves it there: Ctrl-C aborts the
    # fit's controller and exits through SystemExit, and after the fit a Ctrl-C would call that dead controller
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        return trainer.fit()
    except SystemExit as exc:  # Ray Train's SIGINT handler while the fit runs, or ray.init's SIGTERM handler
        how = "SIGTERM" if exc.code == signal.SIGTERM else "Ctrl-C"
        raise RunInterruptedError(
            f"stage {stage.name!r}: interrupted ({how}) while it trained; nothing of it was adopted\n"
            "    fix: run the same command with --resume to continue it from its latest checkpoint"
        ) from None
    except ray.train.WorkerGroupError as exc:
        failures = exc.worker_failures.values()
        raise (
            _cascade_cause(exc)
            or stage_failure(failures, stage.name, index, str(ray_dir))
            or training_error(exc, stage.name, index)
            or exc
        ) from None
    except ray.train.ControllerError as exc:  # NoRetry ended the fit with a worker's error
        if isinstance(exc.controller_failure, CascadeError):
            raise exc.controller_failure from None
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def kept_checkpoints(result: ray.train.Result) -> list[tuple[ray.train.Checkpoint, dict[str, Any]]]:
    """Every checkpoint a fit kept, oldest first, with the metrics it was reported with: the
    ``train.checkpoint.top_k`` best, and the newest when it is not among them (``save_last``)."""
    kept = list(result.best_checkpoints or [])
    return sorted(kept, key=lambda pair: pair[1].get("epoch", 0))


def best_checkpoints(
    result: ray.train.Result, metric: str, mode: str, top_k: int
) -> list[tuple[ray.train.Checkpoint, dict[str, Any]]]:
    """The `top_k` best of `result`'s kept checkpoints by `metric` (`mode`: min/max), best first;
    ties go to the later epoch, as Ray Train keeps them."""
    scored = [pair for pair in kept_checkpoints(result) if metric in pair[1]]
    sign = -1.0 if mode == "max" else 1.0
    return sorted(scored, key=lambda pair: (sign * float(pair[1][metric]), -pair[1].get("epoch", 0)))[:top_k]


def drop_last_checkpoint(result: ray.train.Result, metric: str, mode: str, top_k: int) -> bool:
    """``train.checkpoint.save_last: false``: delete a finished fit's newest checkpoint unless it is
    one of the `top_k` best (Ray Train keeps the newest until the fit ends, to restart from).
    True when one was deleted."""
    latest = result.checkpoint
    if latest is None or any(c.path == latest.path for c, _ in best_checkpoints(result, metric, mode, top_k)):
        return False
    latest.filesystem.delete_dir(latest.path)
    return True


def _stream_args(stream: Any) -> dict[str, Any]:
    """``datasets`` and ``dataset_config`` of a streamed fit: train split equally over the workers
    (DDP steps in lock-step), val unequally (every row once)."""
    if stream is None:
        return {}
    from cascade_ray.data.stream_ingest import StreamingDataConfig

    return {"datasets": stream.datasets(), "dataset_config": StreamingDataConfig()}


def _cascade_cause(exc: ray.train.WorkerGroupError) -> Exception | None:
    """The first worker failure that is one of ours (its message is the useful one)."""
    for failure in exc.worker_failures.values():
        seen: Any = failure
        while seen is not None:
            if isinstance(seen, CascadeError):
                return seen
            seen = getattr(seen, "cause", None) or seen.__cause__
    return None
