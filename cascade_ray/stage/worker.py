"""Ray Train glue: ``train_loop_per_worker`` for a stage, and its checkpoint format.

The loop config is a plain dict (it crosses a process boundary), so the worker
re-validates it into a :class:`PipelineConfig` before anything else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from cascade_ray.checks import validate_config
from cascade_ray.config.schema import StageConfig
from cascade_ray.data import DataSplits
from cascade_ray.errors import CascadeError, FrozenDriftError, ResourceError
from cascade_ray.models.plan import remember_plans
from cascade_ray.models.weights import load_safetensors, save_safetensors, state_digests
from cascade_ray.stage.hooks import LoopHooks, chain_hooks
from cascade_ray.stage.loop import run_stage
from cascade_ray.stage.observe import observer_hooks
from cascade_ray.stage.raised import mark_raised_at
from cascade_ray.stage.resume import TRAINER_STATE
from cascade_ray.stage.startup import StartupClock

CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINT_STATE = "train_state.json"
CHECKPOINT_NODES = "nodes.json"  # the worker group's node ids, one per rank
CHECKPOINT_FROZEN = "frozen.json"  # train.checkpoint.frozen: reference: the frozen entries left out, by digest


class RayReporter:
    """Reporter over Ray Train: every rank reports (it is a barrier); rank 0 checkpoints, with
    the node ids of every rank (gathered once, when the reporter is made: a collective)."""

    def __init__(self, device: torch.device):
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = device
        self.nodes = self._gather_node_ids()

    def _gather_node_ids(self) -> list[str]:
        mine = ray.get_runtime_context().get_node_id()
        if self.world == 1 or not dist.is_initialized():
            return [mine]
        # fixed-size bytes on the backend's device (gloo and NCCL both take uint8 tensors)
        raw = torch.tensor(list(bytes.fromhex(mine)), dtype=torch.uint8, device=self.device)
        gathered = [torch.empty_like(raw) for _ in range(self.world)]
        dist.all_gather(gathered, raw)
        return [bytes(t.cpu().tolist()).hex() for t in gathered]

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1 or not dist.is_initialized():
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def report(
        self,
        metrics: dict[str, float],
        state: Mapping[str, torch.Tensor] | None,
        trainer: dict[str, Any] | None = None,
        frozen: Mapping[str, str] | None = None,
    ) -> None:
        """Report `metrics`; with a `state`, also a checkpoint of it (rank 0). `frozen` (key -> digest):
        frozen upstream tensors the checkpoint names by digest instead of holding (see :func:`write_checkpoint`)."""
        if state is None:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(tmp, state, metrics, nodes=self.nodes, trainer=trainer, frozen=frozen)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def write_checkpoint(
    folder: str | Path,
    state: Mapping[str, torch.Tensor],
    metrics: dict[str, float],
    *,
    nodes: list[str],
    trainer: dict[str, Any] | None = None,
    frozen: Mapping[str, str] | None = None,
) -> None:
    """Fill a checkpoint directory: weights, metrics, the ranks' nodes, the resume state.

    With `frozen` (``train.checkpoint.frozen: reference``: the frozen upstream's digests, as the
    tensors are now), those keys are left out of the weights and ``frozen.json`` lists them with
    their digests: a stage on a large frozen upstream writes only what it trains each epoch.
    :func:`read_checkpoint` puts them back from the upstream, digests checked.
    """
    folder = Path(folder)
    kept = state if not frozen else {k: v for k, v in state.items() if k not in frozen}
    save_safetensors(kept, folder / CHECKPOINT_WEIGHTS)
    (folder / CHECKPOINT_STATE).write_text(json.dumps(metrics))
    (folder / CHECKPOINT_NODES).write_text(json.dumps(nodes))
    if frozen:
        (folder / CHECKPOINT_FROZEN).write_text(
            json.dumps({"format": 1, "digests": dict(sorted(frozen.items()))}, indent=0)
        )
    if trainer is not None:
        torch.save(trainer, folder / TRAINER_STATE)


def read_resume_state(
    upstream: Mapping[str, np.ndarray] | None, upstream_digests: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """The latest registered checkpoint of this run after a worker-group restart, else None.

    Its weights are whole again (frozen upstream entries a ``reference`` checkpoint names are taken
    from `upstream`, digests checked against `upstream_digests` where given: :func:`read_checkpoint`).
    Trainer state is read with ``weights_only=True``: tensors and plain containers only.
    """
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        trainer = Path(folder) / TRAINER_STATE
        if not trainer.is_file():
            return None
        weights = read_checkpoint(folder, upstream, upstream_digests)
        return {"model": weights.state, "trainer": torch.load(trainer, map_location="cpu", weights_only=True)}


class FaultInjection:
    """Test hook (``constants.FAULT_ONCE_ENV`` = ``<stage>:<step>:<marker file>``): kills this
    worker (rank 0) right after optimizer step <step> of <stage>, once: the marker file
    records it, so the restarted worker group runs through."""

    def __init__(self, spec: str, stage: str, rank: int):
        name, _, rest = spec.partition(":")
        step, _, marker = rest.partition(":")
        self.armed = bool(spec) and name == stage and rank == 0 and not Path(marker).exists()
        self.step, self.marker = (int(step), Path(marker)) if self.armed else (0, Path())

    def __call__(self, state: Any) -> None:
        self.at_step(state.step)

    def at_step(self, step: int) -> None:
        """Kill this worker if `step` is the armed one (the batched loop calls this directly)."""
        if self.armed and step == self.step:
            self.marker.write_text(f"killed at step {self.step}\n")
            os._exit(17)  # a crash, not an exception: Ray sees the worker die


@dataclasses.dataclass(frozen=True)
class CheckpointWeights:
    """A checkpoint's weights, whole. `frozen_digests`: the digests of the entries taken from the
    upstream (a ``reference`` checkpoint), each checked against it; None when the file held them all."""

    state: Mapping[str, np.ndarray]
    frozen_digests: dict[str, str] | None


def read_checkpoint(
    path: str | Path,
    upstream: Mapping[str, np.ndarray] | None = None,
    upstream_digests: Mapping[str, str] | None = None,
) -> CheckpointWeights:
    """Weights (numpy state dict) of a stage checkpoint directory, whole.

    A ``reference`` checkpoint (``frozen.json``) holds only what its stage trains; the frozen
    entries it names come from `upstream` (the upstream's hand-off), once their digests match
    those the worker recorded. `upstream_digests`: the upstream's tensor digests as its verified
    artifact manifest records them (the driver's hand-off), used instead of hashing it again.

    Raises:
        FrozenDriftError: naming the entries, when `upstream` lacks one or holds other bytes than the
            checkpoint's stage trained on.
        CascadeError: when the checkpoint names frozen entries and no `upstream` is given.
    """
    path = Path(path)
    state = load_safetensors(path / CHECKPOINT_WEIGHTS)
    listed = path / CHECKPOINT_FROZEN
    if not listed.is_file():  # the file's one block as it was read (a ray.put moves one buffer)
        return CheckpointWeights(state, None)
    recorded = _frozen_listing(listed)
    if upstream is None:
        raise CascadeError(
            f"checkpoint {path} names {len(recorded)} frozen upstream tensor(s) by digest "
            "(train.checkpoint.frozen: reference), but no upstream state was given to take them from"
        )
    absent = sorted(k for k in recorded if k not in upstream)
    known = upstream_digests or {}
    present = [k for k in recorded if k in upstream]
    actual = state_digests(upstream, [k for k in present if k not in known]) | {
        k: known[k] for k in present if k in known
    }
    changed = absent + sorted(k for k, d in actual.items() if recorded[k] != d)
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise FrozenDriftError(
            f"checkpoint {path} was trained on frozen upstream tensors that the upstream artifact no longer "
            f"holds as they were ({len(changed)}: {shown}); its weights cannot be made whole from this upstream. "
            "Train the stage again from its upstream: rerun without --resume, or delete the stage's Ray run folder"
        )
    # a plain dict of the file's views and the upstream's (packing them into one block again would
    # copy the upstream: more than the one-block hand-off saves, docs/benchmarks.md P3)
    whole = dict(state) | {key: upstream[key] for key in recorded}
    return CheckpointWeights(whole, dict(sorted(recorded.items())))


def _frozen_listing(path: Path) -> dict[str, str]:
    """The key -> digest map of a checkpoint's ``frozen.json``, checked for its shape."""
    try:
        listing = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        listing = exc
    digests = listing.get("digests") if isinstance(listing, dict) and listing.get("format") == 1 else None
    if not isinstance(digests, dict) or not all(isinstance(d, str) for d in digests.values()):
        raise CascadeError(
            f'{path}: not a frozen-entry listing of format 1 ({{"format": 1, "digests": {{key: sha256}}}}); the '
            "checkpoint was damaged or written by another tool. Delete the stage's Ray run folder to train it again"
        )
    return digests


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Entry point Ray Train runs on every worker of a stage."""
    cfg = validate_config(loop_config["pipeline"], source="train_loop_config", preflight=False)
    index = int(loop_config["stage_index"])
    remember_plans(loop_config.get("plans"))  # the driver's shape plans (planning again costs ~1 s)
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    # Ray pins OMP threads to the CPUs assigned; torch must follow or it oversubscribes.
    torch.set_num_threads(max(1, int(cpus)))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus))))
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    clock = StartupClock(loop_config.get("fit_started"))  # where the seconds before the first step go
    device = ray.train.torch.get_device()
    sources = None
    if loop_config.get("stream"):  # rows streamed through Ray Data: this worker's shards
        from cascade_ray.data.stream_ingest import worker_sources  # imports ray.data: only when streaming

        data, sources = worker_sources(loop_config["stream"], cfg, device)
    else:
        (data_ref,) = loop_config["data_ref"]
        data = DataSplits.from_arrays(ray.get(data_ref))
    upstream = ray.get(loop_config["upstream_ref"][0]) if loop_config["upstream_ref"] else None
    known = loop_config.get("upstream_digests")  # the hand-off's digests: its bytes are not hashed again
    features = (
        ray.get(loop_config["features_ref"][0]) if loop_config.get("features_ref") else None
    )  # cached upstream outputs
    clock.mark("inputs")
    reporter = RayReporter(device)
    # fsdp shards inside setup_stage (the optimizer must see the sharded parameters): no wrapper here
    ddp = reporter.world > 1 and cfg.stages[index].scaling.strategy == "ddp"
    wrap = _ddp_wrapper(cfg.stages[index], device) if ddp else None
    hooks = LoopHooks(
        after_optimizer_step=FaultInjection(loop_config.get("fault_once", ""), cfg.stages[index].name, reporter.rank)
    )
    marks = LoopHooks(on_setup=clock.on_setup, after_optimizer_step=clock.after_optimizer_step)
    observe, finish_observing = observer_hooks(
        loop_config, cfg, index, reporter.rank, reporter.world, device, nodes=reporter.nodes
    )  # progress board, --profile, live trackers
    failed = True
    try:
        outcome = run_stage(
            cfg,
            index,
            data,
            upstream,
            reporter,
            device,
            wrap=wrap,
            hooks=chain_hooks(marks, hooks, observe),
            resume=read_resume_state(upstream, known),
            features=features,
            sources=sources,
            input_stage=loop_config["stream"].get("input_stage") if loop_config.get("stream") else None,
            upstream_digests=known,
        )
        failed = False
    except Exception as exc:
        if not isinstance(exc, CascadeError):  # the training code's own error: say where it came from
            mark_raised_at(exc)
        raise
    finally:
        finish_observing(failed)
    return dataclasses.asdict(outcome) | {"startup": clock.record()} if reporter.rank == 0 else None


def _ddp_wrapper(stage: StageConfig, device: torch.device):
    """DDP through Ray Train; with ``scaling.sync_batchnorm`` the trainable BatchNorm layers
    become SyncBatchNorm first (DDP must wrap the converted model)."""

    def wrap(model: nn.Module) -> nn.Module:
        if stage.scaling.sync_batchnorm:
            if device.type != "cuda":
                raise ResourceError(
                    f"stage {stage.name!r}: scaling.sync_batchnorm needs CUDA workers (torch's SyncBatchNorm), but this worker runs on {device.type}. Set sync_batchnorm: false or use_gpu: true."
                )
            convert_trainable_batchnorm(model)
        return ray.train.torch.prepare_model(model, move_to_device=False)

    return wrap


def convert_trainable_batchnorm(model: nn.Module) -> list[str]:
    """Swap every BatchNorm that trains for a SyncBatchNorm sharing its parameters and buffers.

    Frozen BatchNorms are left alone: they are pinned to eval mode (``model.train()``
    re-applies it) and SyncBatchNorm in eval mode does not sync anyway. Parameter
    objects are kept, so the optimizer and the frozen digests are unaffected.

    Returns:
        The qualified names of the converted layers.
    """
    model.train()  # a CascadeModel leaves its frozen modules in eval: `.training` marks the trainable ones
    converted = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.modules.batchnorm._BatchNorm)
                and not isinstance(child, nn.SyncBatchNorm)
                and child.training
            ):
                setattr(parent, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
                converted.append(f"{parent_name}.{name}".lstrip("."))
    return converted
