"""Hand-written baseline for P2: plain ``TorchTrainer`` jobs chained through checkpoint directories.

What a Ray user would write without cascade-ray: one ``TorchTrainer`` per stage, each worker
running a plain PyTorch loop, reporting metrics and a checkpoint (safetensors of the whole
model) once per epoch and keeping the best by validation accuracy; the next stage's workers
each read the previous stage's best checkpoint from its directory. It borrows cascade-ray's
model and data modules (``build_stage_model``: the composed model with the upstream loaded
and frozen; ``load_data``; ``DataSplits``) so both sides train exactly the same networks on
the same data, and nothing else: no config re-validation in workers, no sanity validation,
no health monitor, no artifacts/manifests/digests, no frozen-drift checks, no summary files.

Supports what ``pipelines/configs/debug.yaml`` uses (constant lr, no augmentation, no
accumulation, fp32, single-head stages) and refuses anything else. Used by
``benchmarks/bench_pipeline.py``; not a library module.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ray.train.torch import TorchTrainer
from safetensors.numpy import load_file, save_file
from torch.utils.data import DistributedSampler

from cascade_ray.data import DataSplits
from cascade_ray.data.source import load_data
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.plan import require_plans
from cascade_ray.models.weights import load_numpy_state
from cascade_ray.stage.setup import build_stage_model, stage_seed

WEIGHTS = "model.safetensors"


def _check_supported(cfg) -> None:
    for i, s in enumerate(cfg.stages):
        unsupported = {
            "lr_scheduler": s.solver.lr_scheduler.type != "constant",
            "augment": s.train.augment.enabled,
            "accumulation_steps": s.solver.accumulation_steps != 1,
            "precision": s.solver.precision != "fp32",
            "type": s.type != "module",
            "grad_clip": s.solver.grad_clip.enabled,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"plain_chain baseline: stages[{i}] uses {bad}, which this baseline does not implement")


def train_stage(config: dict[str, Any]) -> None:
    """Ray Train worker: build the model (upstream read from a checkpoint directory), train, report."""
    cfg, index = config["cfg"], config["index"]
    stage = cfg.stages[index]
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    data = DataSplits.from_arrays(ray.get(config["data"][0]))
    upstream = load_file(str(Path(config["upstream_dir"]) / WEIGHTS)) if config["upstream_dir"] else None
    model, _ = build_stage_model(cfg, index, data, upstream)
    net = ray.train.torch.prepare_model(model)  # DDP when world > 1
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = getattr(torch.optim, stage.solver.type)(
        params, lr=stage.solver.lr, weight_decay=stage.solver.weight_decay
    )
    mean, std = torch.as_tensor(data.mean), torch.as_tensor(data.std)  # per channel, broadcastable to a batch
    x_train, y_train = torch.from_numpy(np.array(data.x_train)), torch.from_numpy(np.array(data.y_train))
    x_val, y_val = torch.from_numpy(np.array(data.x_val)), torch.from_numpy(np.array(data.y_val))
    head = stage.name
    sampler = DistributedSampler(
        range(len(y_train)), num_replicas=world, rank=rank, shuffle=True, seed=stage_seed(cfg, index)
    )
    for epoch in range(stage.train.epochs):
        model.train()
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.long)
        loss_sum, seen = 0.0, 0
        for idx in order.split(stage.train.batch_size):
            x, y = (x_train[idx].float() - mean) / std, y_train[idx]
            loss = F.cross_entropy(net(x, heads=[head])[head], y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        model.eval()
        with torch.no_grad():  # each rank its share of the validation split, summed across ranks
            xv, yv = (x_val[rank::world].float() - mean) / std, y_val[rank::world]
            logits = model(xv, heads=[head])[head]
            sums = torch.tensor(
                [
                    float(len(yv)),
                    (logits.argmax(1) == yv).sum().item(),
                    F.cross_entropy(logits, yv, reduction="sum").item(),
                    loss_sum,
                    seen,
                ],
                dtype=torch.float64,
            )
        if world > 1:
            dist.all_reduce(sums)
        n_val, correct, val_loss, tl, ts = sums.tolist()
        metrics = {
            "epoch": epoch + 1,
            "train_loss": tl / ts,
            "val_accuracy": correct / n_val,
            "val_loss": val_loss / n_val,
        }
        if rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                save_file(
                    {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}, str(Path(tmp) / WEIGHTS)
                )
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report(metrics)


def run_plain_chain(cfg, storage: Path, *, log=print) -> dict[str, Any]:
    """Train every stage of `cfg` in order in the connected Ray session; returns per-stage times and the test accuracy.

    `storage` must be an absolute local directory (Ray Train's storage_path for every stage).
    """
    _check_supported(cfg)
    data = load_data(cfg.data, cfg.seed)
    data_ref = ray.put(data.to_arrays())
    upstream_dir, stages = None, []
    for index, stage in enumerate(cfg.stages):
        t0, started = time.perf_counter(), time.time()
        trainer = TorchTrainer(
            train_stage,
            train_loop_config={"cfg": cfg, "index": index, "data": [data_ref], "upstream_dir": upstream_dir},
            scaling_config=ray.train.ScalingConfig(
                num_workers=stage.scaling.num_workers,
                use_gpu=False,
                resources_per_worker=stage.scaling.resources_per_worker,
            ),
            run_config=ray.train.RunConfig(
                name=f"{index:02d}-{stage.name}",
                storage_path=str(storage),
                checkpoint_config=ray.train.CheckpointConfig(
                    num_to_keep=1, checkpoint_score_attribute="val_accuracy", checkpoint_score_order="max"
                ),
            ),
        )
        result = trainer.fit()
        fit_end = time.time()
        best, metrics = max(result.best_checkpoints, key=lambda pair: pair[1]["val_accuracy"])
        upstream_dir = best.path  # the next stage's workers read the weights from here
        stages.append(
            {
                "name": stage.name,
                "wall_s": time.perf_counter() - t0,
                "val_accuracy": metrics["val_accuracy"],
                "fit_start": started,
                "fit_end": fit_end,
            }
        )
        log(f"  plain {stage.name}: {stages[-1]['wall_s']:.1f} s")
    # the composed model on the test split, like the pipeline's final evaluation
    model = build_cascade(
        cfg, require_plans(cfg, data.input_shape, data.num_classes), data.num_classes, upto=len(cfg.stages) - 1
    )
    load_numpy_state(model, load_file(str(Path(upstream_dir) / WEIGHTS)))
    model.eval()
    head = cfg.stages[-1].name
    with torch.no_grad():
        x = (torch.from_numpy(np.array(data.x_test)).float() - torch.as_tensor(data.mean)) / torch.as_tensor(data.std)
        accuracy = float((model(x, heads=[head])[head].argmax(1).numpy() == data.y_test).mean())
    return {"stages": stages, "test_accuracy": accuracy}
