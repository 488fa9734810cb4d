"""Weights as data: numpy state dicts (for the object store), safetensors files, digests.

Frozen weights cross process boundaries as ``dict[str, np.ndarray]`` because Ray
shares numpy arrays zero-copy (read-only), while torch tensors are copied per reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

NumpyState = dict[str, np.ndarray]

# safetensors' own reader refuses headers above 100 MB, after allocating for them; a header this
# size describes millions of tensors, far beyond any cascade stage.
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000


def to_numpy_state(state: Mapping[str, torch.Tensor]) -> NumpyState:
    """A detached CPU numpy copy of a state dict (bf16 is widened to fp32)."""
    out: NumpyState = {}
    for key, tensor in state.items():
        t = tensor.detach().cpu()
        out[key] = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    return out


def load_numpy_state(module: nn.Module, state: Mapping[str, np.ndarray], *, strict: bool = True) -> None:
    """Copy a (possibly read-only, shared) numpy state dict into a module's tensors."""
    with warnings.catch_warnings():
        # torch warns that the object-store arrays are read-only; load_state_dict copies
        # them into the module's own tensors, so nothing ever writes to shared memory.
        warnings.simplefilter("ignore", UserWarning)
        tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
    module.load_state_dict(tensors, strict=strict)


def tensor_digest(tensor: torch.Tensor | np.ndarray) -> str:
    """sha256 of a tensor's dtype, shape and bytes (bit-exact identity)."""
    arr = tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes(order="C"))
    return h.hexdigest()


def state_digests(state: Mapping[str, torch.Tensor | np.ndarray], keys: Iterable[str] | None = None) -> dict[str, str]:
    """Per-entry digests of a state dict (optionally only `keys`), sorted by key."""
    wanted = sorted(state) if keys is None else sorted(keys)
    return {k: tensor_digest(state[k]) for k in wanted}


def save_safetensors(
    state: Mapping[str, np.ndarray | torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """Write a state dict as safetensors (no pickle)."""
    from safetensors.numpy import save_file

    # np.ascontiguousarray would turn 0-d tensors (BatchNorm's num_batches_tracked) into 1-d
    arrays = {
        k: np.asarray(v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v, order="C")
        for k, v in state.items()
    }
    save_file(arrays, str(path), metadata=metadata)


def safetensors_header_problem(path: str | Path) -> str | None:
    """What is wrong with a safetensors file's framing, or None; reads 8 bytes, then the header.

    The first 8 bytes are the header's length (little-endian): it is checked against
    :data:`SAFETENSORS_HEADER_MAX_BYTES` and the file's size before the header is read, and the
    header must be a JSON object. The caller has checked that `path` is a regular file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, too short for a safetensors file"
        length = int.from_bytes(head, "little")
        if length > SAFETENSORS_HEADER_MAX_BYTES or length > size - 8:
            return (
                f"its header claims {length} bytes (file: {size} bytes, limit {SAFETENSORS_HEADER_MAX_BYTES}); "
                "the file is damaged or not a safetensors file"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:  # UnicodeDecodeError is one
            return f"its header is not JSON ({str(exc)[:80]})"
    return None if isinstance(header, dict) else f"its header is a JSON {type(header).__name__}, not an object"


def load_safetensors(path: str | Path) -> NumpyState:
    """Read a safetensors file into a numpy state dict.

    Raises:
        ValueError: naming the file, when its framing is damaged (:func:`safetensors_header_problem`)
            or safetensors cannot parse it.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    problem = safetensors_header_problem(path)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
