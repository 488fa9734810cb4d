"""The train loop of tests/integration/test_streaming.py (workers import it by name from tests/support)."""

from __future__ import annotations

import numpy as np
import torch


def stream_loop(config: dict) -> dict:
    """Two train epochs and one val pass over the streamed shards; returns the row ids seen."""
    import ray.train

    from cascade_ray.data.stream_ingest import StreamSource

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    common = {
        "input_column": "image",
        "input_shape": config["shape"],
        "target_column": "label",
        "target_kind": "class",
        "num_classes": 3,
        "mean": np.zeros((1, 1, 1), np.float32),
        "std": np.ones((1, 1, 1), np.float32),
    }
    train = StreamSource(
        ray.train.get_dataset_shard("train"), rows=config["train_rows"], shuffle_buffer_rows=64, **common
    )
    val = StreamSource(ray.train.get_dataset_shard("val"), rows=config["val_rows"], split="val", **common)
    epochs = []
    for epoch in range(2):
        ids = []
        for x, y in train.train_epoch(16, rank=rank, world=world, seed=config["seed"], epoch=epoch):
            assert x.dtype.is_floating_point and y.dtype == torch.int64
            ids += x[:, 0, 0, 0].round().long().tolist()
        epochs.append(ids)
    val_ids = [i for x, _ in val.eval_epoch(16, rank=rank, world=world) for i in x[:, 0, 0, 0].round().long().tolist()]
    batches = train.num_train_batches(16, world)
    return {"epochs": epochs, "val": val_ids, "batches": batches}  # Result.return_value: rank 0's
