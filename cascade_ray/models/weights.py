"""Weights as data: numpy state dicts (for the object store), safetensors files, digests.

Frozen weights cross process boundaries as ``dict[str, np.ndarray]`` because Ray
shares numpy arrays zero-copy (read-only), while torch tensors are copied per reader.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

NumpyState = dict[str, np.ndarray]


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


def load_safetensors(path: str | Path) -> NumpyState:
    """Read a safetensors file into a numpy state dict."""
    from safetensors.numpy import load_file

    return load_file(str(path))


def read_state_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a state-dict file (.safetensors, or .pt/.pth read with weights_only)."""
    p = Path(path).expanduser()
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    return {k: tuple(v.shape) for k, v in load_state_file(p).items()}


def load_state_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a user-provided state dict safely: safetensors, or torch with ``weights_only``."""
    p = Path(path).expanduser()
    if p.suffix == ".safetensors":
        return {k: torch.from_numpy(v) for k, v in load_safetensors(p).items()}
    state = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{p} does not hold a flat state dict of tensors")
    return state
