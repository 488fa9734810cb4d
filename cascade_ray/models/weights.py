"""Weights as data: numpy state dicts (for the object store), safetensors files, digests.

Frozen weights cross process boundaries as ``dict[str, np.ndarray]`` because Ray
shares numpy arrays zero-copy (read-only), while torch tensors are copied per reader.
:func:`share_numpy_state` makes a module's frozen tensors views of those arrays, so N
workers on one node hold one copy of a frozen upstream (the object store's).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

from cascade_ray.models.packed import SAFETENSORS_HEADER_MAX_BYTES, read_packed
from cascade_ray.storage import file_sha256

NumpyState = dict[str, np.ndarray]

# the keys a module holds as views of shared arrays (set by share_numpy_state, read by
# load_numpy_state); a plain attribute, not a buffer, so it never enters the state dict
SHARED_KEYS_ATTR = "_cascade_shared_keys"
# torch's warning for torch.from_numpy on a non-writable array (the object store's are)
_READ_ONLY_WARNING = "The given NumPy array is not writable"
# torch.nn.modules.module's dicts of global hooks that Module.__setattr__ runs when it
# registers a parameter or buffer (share_numpy_state bypasses it only while both are empty)
_REGISTRATION_HOOKS = ("_global_parameter_registration_hooks", "_global_buffer_registration_hooks")

# state_digests hashes on threads from this many bytes (below, a thread pool's start costs more
# than it saves), on at most this many threads
DIGEST_THREADS_MIN_BYTES = 16 << 20
DIGEST_THREADS_MAX = 8


def to_numpy_state(state: Mapping[str, torch.Tensor]) -> NumpyState:
    """A detached CPU numpy copy of a state dict (bf16 is widened to fp32)."""
    out: NumpyState = {}
    for key, tensor in state.items():
        t = tensor.detach().cpu()
        out[key] = (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()
    return out


def load_numpy_state(module: nn.Module, state: Mapping[str, np.ndarray], *, strict: bool = True) -> None:
    """Copy a (possibly read-only, shared) numpy state dict into a module's tensors.

    Keys the module holds as shared views (:func:`share_numpy_state`) are compared, never
    written: writing them would write the object store's copy that every worker on the node
    reads (a resumed stage's checkpoint holds the same frozen bytes).

    Raises:
        RuntimeError: naming the key, when `state` differs from a shared (frozen) tensor.
    """
    shared = getattr(module, SHARED_KEYS_ATTR, frozenset()) & set(state)
    if shared:
        current = module.state_dict()
        differ = sorted(
            k for k in shared if not np.array_equal(current[k].detach().cpu().numpy(), np.asarray(state[k]))
        )
        if differ:
            raise RuntimeError(
                f"{len(differ)} frozen tensor(s) shared from the upstream hand-off differ from the state loaded "
                f"over them: {differ[:5]}; a checkpoint of this stage must hold its upstream's frozen weights unchanged"
            )
    with warnings.catch_warnings():
        # torch warns that the object-store arrays are read-only; load_state_dict copies
        # them into the module's own tensors, so nothing ever writes to shared memory.
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items() if k not in shared}
    result = module.load_state_dict(tensors, strict=False)
    missing = sorted(set(result.missing_keys) - shared)
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(
            f"state does not fit the module: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def share_numpy_state(module: nn.Module, state: Mapping[str, np.ndarray], keys: Iterable[str]) -> list[str]:
    """Make `keys` of `module` views of `state`'s arrays, without a copy.

    For frozen weights only: the module's parameter (``requires_grad`` kept) or buffer
    becomes ``torch.from_numpy`` of the array, so on CPU its storage *is* the array; for a
    ``ray.get`` result that is the object store's shared memory, one copy per node whatever
    the number of workers. (``module.to("cuda")`` later makes one device copy per worker.)
    An entry whose dtype or shape differs from the module's is left out, for the caller to
    copy (a copy casts; a view cannot).

    Nothing may write a shared tensor: Ray maps the object store read-write in every
    process, so a write would change every reader's weights. Frozen tensors are never
    written (no gradient, not in the optimizer, eval mode, left out of DDP's broadcasts:
    ``models.freeze.apply_freeze``), the frozen digest proves it every epoch, and
    :func:`load_numpy_state` compares shared keys instead of writing them.

    Returns:
        The keys now shared, sorted.
    """
    owners = dict(module.named_modules(remove_duplicate=False))
    plain = _plain_assignment_allowed()
    shared: list[str] = []
    rest: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only. Safe here: see the docstring,
        # nothing writes these tensors and the frozen digest would show it if anything did.
        warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
        for key in keys:
            view = torch.from_numpy(np.asarray(state[key]))
            path, _, leaf = key.rpartition(".")
            owner = owners.get(path)
            done = _set_view(owner, leaf, view, plain) if owner is not None else None
            if done is None:
                rest[key] = view
            elif done:
                shared.append(key)
    if rest:  # keys that are not a plain attribute path (a module's own state-dict hooks map them)
        current = module.state_dict(keep_vars=True)
        rest = {k: v for k, v in rest.items() if v.dtype == current[k].dtype and v.shape == current[k].shape}
        # assign=True: the module takes these tensors (wrapped in Parameters where it had
        # Parameters, requires_grad kept) instead of copying into its own
        module.load_state_dict(rest, strict=False, assign=True)
        shared.extend(rest)
    setattr(module, SHARED_KEYS_ATTR, getattr(module, SHARED_KEYS_ATTR, frozenset()) | set(shared))
    return sorted(shared)


def share_tensors(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Make each entry of `tensors` `module`'s parameter or buffer of that name: the same memory,
    no copy (a parameter stays a ``Parameter`` with its ``requires_grad``).

    For frozen entries that another model built from the same hand-off already holds where this
    one trains (:func:`frozen_views`): a batched sweep's replicas on a GPU then hold one device
    copy of their frozen upstream, not one each. The same rules as :func:`share_numpy_state`:
    nothing may write these tensors. An entry whose dtype or shape differs, or that is not a plain
    parameter or buffer path of `module`, is left as it is.

    Returns:
        The keys now shared, sorted.
    """
    owners = dict(module.named_modules(remove_duplicate=False))
    plain = _plain_assignment_allowed()
    done = []
    for key, tensor in tensors.items():
        path, _, leaf = key.rpartition(".")
        owner = owners.get(path)
        if owner is not None and _set_view(owner, leaf, tensor.detach(), plain):
            done.append(key)
    return sorted(done)


def frozen_views(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s entries that hold the hand-off's bytes unchanged (:data:`SHARED_KEYS_ATTR`: views of its
    arrays, or the device copies ``module.to`` made of them), for :func:`share_tensors` into another
    model built from the same hand-off."""
    shared = getattr(module, SHARED_KEYS_ATTR, frozenset())
    return {k: v for k, v in module.state_dict().items() if k in shared}


def _plain_assignment_allowed() -> bool:
    """Whether no global parameter or buffer registration hook is installed
    (``torch.nn.modules.module.register_module_*_registration_hook``): then replacing a
    registered tensor in its module's dict is all ``Module.__setattr__`` would do. Unknown
    (a torch that keeps the hooks elsewhere) counts as installed."""
    from torch.nn.modules import module as torch_module

    hooks = [getattr(torch_module, name, None) for name in _REGISTRATION_HOOKS]
    return all(isinstance(h, dict) and not h for h in hooks)


def _set_view(owner: nn.Module, leaf: str, view: torch.Tensor, plain: bool) -> bool | None:
    """Make `view` `owner`'s parameter or buffer `leaf`, as ``load_state_dict(assign=True)``
    would (a parameter stays a ``Parameter`` with its ``requires_grad``). True when set, False
    when the dtype or shape differs (left out, for the caller to copy), None when `leaf` is
    neither a parameter nor a buffer of `owner` (for ``load_state_dict``).

    Replaces the entry in the module's ``_parameters`` / ``_buffers`` dict directly when that
    is all ``Module.__setattr__`` would do (the name is already registered there, the class
    keeps torch's ``__setattr__`` and no global registration hook is installed). With no
    ``state_dict()`` call besides, sharing the 320 tensors of a wide ResNet-50 takes ~1.1 ms
    instead of ~2.1 ms, a fixed cost every consumer of a hand-off pays (``docs/benchmarks.md``,
    P3)."""
    param = owner._parameters.get(leaf)
    if isinstance(param, nn.Parameter):
        if view.dtype != param.dtype or view.shape != param.shape:
            return False
        value: torch.Tensor = nn.Parameter(view, requires_grad=param.requires_grad)
        table = owner._parameters
    else:
        buffer = owner._buffers.get(leaf)
        if not isinstance(buffer, torch.Tensor):
            return None
        if view.dtype != buffer.dtype or view.shape != buffer.shape:
            return False
        value, table = view, owner._buffers
    if plain and type(owner).__setattr__ is nn.Module.__setattr__:
        table[leaf] = value
    else:
        setattr(owner, leaf, value)
    return True


def tensor_digest(tensor: torch.Tensor | np.ndarray) -> str:
    """sha256 of a tensor's dtype, shape and bytes (bit-exact identity).

    The bytes are hashed where they lie (a C-contiguous array is not copied; hashlib reads
    its buffer and releases the GIL while it hashes, so :func:`state_digests` can spread a
    state over threads)."""
    arr = tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr))  # the bytes of tobytes(order="C"); a 0-d array becomes 1-d, same bytes
    return h.hexdigest()


def state_digests(state: Mapping[str, torch.Tensor | np.ndarray], keys: Iterable[str] | None = None) -> dict[str, str]:
    """Per-entry digests of a state dict (optionally only `keys`), sorted by key.

    A state of at least :data:`DIGEST_THREADS_MIN_BYTES` is hashed on up to
    ``torch.get_num_threads()`` threads (at most :data:`DIGEST_THREADS_MAX`): the threads torch
    may use for compute in this process, idle while a stage is read, written or checked
    between epochs. A 409 MB state hashes in ~0.1 s on two cores instead of ~0.27 s
    (``docs/benchmarks.md``, artifact verification).
    """
    wanted = sorted(state) if keys is None else sorted(keys)
    threads = min(torch.get_num_threads(), DIGEST_THREADS_MAX, len(wanted))
    if threads > 1 and sum(_nbytes(state[k]) for k in wanted) >= DIGEST_THREADS_MIN_BYTES:
        with ThreadPoolExecutor(threads, thread_name_prefix="cascade-digest") as pool:
            return dict(zip(wanted, pool.map(lambda k: tensor_digest(state[k]), wanted)))
    return {k: tensor_digest(state[k]) for k in wanted}


def _nbytes(tensor: torch.Tensor | np.ndarray) -> int:
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else np.asarray(tensor).nbytes


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

    A file whose tensors numpy can view in place (every file cascade-ray writes) is read as
    one block, its arrays views of it (:class:`~cascade_ray.models.packed.PackedState`), so a
    ``ray.put`` of the result moves one buffer; any other goes through safetensors' reader.

    Raises:
        ValueError: naming the file, when its framing is damaged (:func:`safetensors_header_problem`),
            safetensors cannot parse it, or it holds a dtype plain numpy lacks (bf16, float8:
            :func:`~cascade_ray.models.packed.read_packed`).
    """
    _refuse_damaged_framing(path)
    packed = read_packed(path)
    return packed if packed is not None else _load_file(path)


def load_safetensors_hashed(path: str | Path) -> tuple[NumpyState, str]:
    """:func:`load_safetensors`, and the sha256 of the file's bytes.

    A file read as one block is hashed as it is read, on a second thread: the hash is of
    exactly the bytes the state was cut from, and the file is read once (a 409 MB file in
    ~0.2 s instead of ~0.43 s hashed and read apart: ``docs/benchmarks.md``, artifact
    verification). Any other file is hashed first, then read by safetensors.

    Raises:
        ValueError: as :func:`load_safetensors`.
    """
    _refuse_damaged_framing(path)
    digest = hashlib.sha256()
    packed = read_packed(path, digest)
    if packed is not None:
        return packed, digest.hexdigest()
    sha = file_sha256(path)  # not the same read as safetensors' below: the tensor digests check that
    return _load_file(path), sha


def _refuse_damaged_framing(path: str | Path) -> None:
    problem = safetensors_header_problem(path)
    if problem is not None:
        raise ValueError(f"{path}: {problem}")


def _load_file(path: str | Path) -> NumpyState:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
