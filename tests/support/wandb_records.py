"""Read the records of a W&B offline run file (``run-<id>.wandb``), for the tests.

wandb 0.31 writes offline runs only as this file (its config and summary are not separate JSON
files), and its reader lives in the Go core, so this is a small reader of the documented
framing: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB-log chunks in
32 KiB blocks (crc32 4 bytes, length 2 bytes little-endian, type 1 byte: full, first,
middle, last), each record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    if raw[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + HEADER])
        data = raw[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = data if kind in (FULL, FIRST) else pending + data
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_run(folder: Path) -> dict[str, Any]:
    """The run's group, job type and name, its config, summary and history rows, from its records."""
    run: dict[str, Any] = {"config": {}, "summary": {}, "history": []}
    for record in records(next(folder.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run |= {"group": record.run.run_group, "job_type": record.run.job_type, "name": record.run.display_name}
            run["config"] |= {_key(u): json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "config":
            run["config"] |= {_key(u): json.loads(u.value_json) for u in record.config.update}
        elif kind == "summary":
            run["summary"] |= {_key(u): json.loads(u.value_json) for u in record.summary.update}
        elif kind == "history":
            run["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
    return run


def _key(item: Any) -> str:
    """An item's key: ``key``, or its ``nested_key`` parts (wandb-core puts keys holding "/" there)."""
    return item.key or "/".join(item.nested_key)
