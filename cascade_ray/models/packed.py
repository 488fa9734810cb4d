"""A state dict read from a safetensors file as one block: numpy views cut by the file's header.

The driver hands each finished stage on with one ``ray.put`` of the state it read from the
best checkpoint (``pipeline/stages.py``). Ray pickles a dict of N arrays as N out-of-band
buffers and rebuilds N arrays from them in every ``ray.get``; a :class:`PackedState` pickles
as its one block and the list of where each tensor lies in it, so the hand-off moves one
buffer, and each reader cuts its views from the shared block (a few microseconds a tensor).
The block is the safetensors file's data section as it is on disk, read straight into it
(``readinto``): no packing copy, and faster than ``safetensors.numpy.load_file``, which copies
tensor by tensor out of a memory map (``docs/benchmarks.md``, P3).

A file this module cannot cut into aligned numpy views (a tensor at an offset its dtype cannot
view aligned, any framing it does not expect, or a big-endian host) is left to the caller to
read the ordinary way: :func:`read_packed` returns None. A tensor of a dtype plain numpy lacks
(bf16, float8) is an error either way: with ``ml_dtypes`` imported (some packages do),
safetensors' own reader would return bf16 arrays that ``torch.from_numpy`` refuses later, and
without it a ``TypeError``; which one would depend on what the process imported first.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

# safetensors dtype -> numpy (little-endian, as the format stores every tensor)
SAFETENSORS_NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
    "C64": "<c8",
}
# one readinto per chunk: a short read (a file shrinking under us) is seen early, and with a
# digest, each chunk is hashed on a second thread while the next one is read
READ_CHUNK_BYTES = 16 << 20
# safetensors' own reader refuses headers above 100 MB, after allocating for them; a header this
# size describes millions of tensors, far beyond any cascade stage.
SAFETENSORS_HEADER_MAX_BYTES = 100_000_000

Entry = tuple[str, str, tuple[int, ...], int]  # key, numpy dtype, shape, byte offset in the block


class Digest(Protocol):
    """A running hash (``hashlib.sha256()``)."""

    def update(self, data: bytes | memoryview, /) -> None: ...


class PackedState(dict):
    """A dict of numpy arrays that are views of one ``uint8`` block; pickles as (block, index).

    It is an ordinary ``dict`` to every reader. While its entries are still the views it was
    built with (nothing added, removed or replaced), pickling it (``ray.put``, ``copy``)
    carries the block as one buffer and the index; once edited it pickles as a plain dict of
    its current arrays. Any view keeps the whole block alive.
    """

    __slots__ = ("_block", "_index", "_views")

    def __init__(self, block: np.ndarray, index: tuple[Entry, ...]) -> None:
        views = tuple(np.ndarray(shape, dtype=dtype, buffer=block, offset=offset) for _, dtype, shape, offset in index)
        super().__init__(zip((entry[0] for entry in index), views))
        self._block, self._index, self._views = block, index, views

    @property
    def block(self) -> np.ndarray:
        """The one buffer every entry views (read-only after a ``ray.get``)."""
        return self._block

    def intact(self) -> bool:
        """Whether the entries are exactly the views the block was cut into."""
        get = dict.get
        return len(self) == len(self._index) and all(
            get(self, entry[0]) is view for entry, view in zip(self._index, self._views)
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.intact():
            return PackedState, (self._block, self._index)
        return dict, (dict(self),)


def read_packed(path: str | Path, digest: Digest | None = None) -> PackedState | None:
    """The safetensors file at `path` as a :class:`PackedState`, or None to read it otherwise.

    The header must describe tensors that tile the data section exactly (contiguous from 0,
    each the size its dtype and shape give, ending at the file's end), each at an offset
    aligned for its dtype; anything else returns None, so the caller's reader (safetensors'
    own) decides, with its own errors. The caller has checked the framing
    (``weights.safetensors_header_problem``).

    `digest`, when given, is fed every byte of the file, in order, as it is read (the data
    section's chunks on a second thread, each while the next is read): the hash of exactly
    the bytes the state was cut from, with no second read of the file. It is fed only when
    a state is returned.

    Raises:
        ValueError: naming the file, when a tensor's dtype is one plain numpy lacks (bf16, float8),
            or when it ends before its header says (it shrank while read).
    """
    with open(path, "rb", buffering=0) as f:
        return read_packed_from(f, os.fstat(f.fileno()).st_size, path, digest)


def read_packed_from(
    f: BinaryIO, size: int, name: object, digest: Digest | None = None, *, chunk_bytes: int = READ_CHUNK_BYTES
) -> PackedState | None:
    """:func:`read_packed` of a safetensors file open in `f` at its start, `size` bytes long: a
    remote object (a ``pyarrow`` input file) is read straight into the block this way, with
    no local copy. A header length beyond the file or above
    :data:`SAFETENSORS_HEADER_MAX_BYTES` returns None before anything is allocated for it.
    `name` is what errors call the file. Each ``readinto`` asks for `chunk_bytes` (on an object
    store, one ranged GET each: a remote reader asks for larger chunks, fewer requests).
    """
    if sys.byteorder != "little":  # the views would be byte-swapped dtypes torch cannot take
        return None
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 <= length <= min(size - 8, SAFETENSORS_HEADER_MAX_BYTES):
        return None
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    size -= 8 + length
    index = _layout(header, size, name)
    if index is None:
        return None
    block = np.empty(size, dtype=np.uint8)
    view = memoryview(block)
    if digest is None:
        _read_into(f, view, name, chunk_bytes, lambda chunk: None)
    else:
        digest.update(prefix)
        digest.update(raw)
        with ThreadPoolExecutor(1, thread_name_prefix="cascade-read-hash") as hasher:  # runs chunks in order
            hashed = []
            _read_into(f, view, name, chunk_bytes, lambda chunk: hashed.append(hasher.submit(digest.update, chunk)))
            for done in hashed:
                done.result()
    return PackedState(block, index)


def _read_into(f: BinaryIO, view: memoryview, path: object, chunk: int, each: Callable[[memoryview], object]) -> None:
    """Fill `view` from `f` in chunks, passing each filled chunk to `each`."""
    done, size = 0, len(view)
    while done < size:
        got = f.readinto(view[done : done + chunk])
        if not got:
            raise ValueError(f"{path}: ended after {done} of its {size} data bytes (changed while read?)")
        each(view[done : done + got])
        done += got


def _layout(header: Any, size: int, path: object) -> tuple[Entry, ...] | None:
    """The entries of a parsed safetensors header in file order, or None when they do not tile
    `size` bytes exactly at offsets aligned for their dtypes.

    Raises:
        ValueError: naming `path` and the key, for a dtype plain numpy lacks.
    """
    if not isinstance(header, dict):
        return None
    lacking = [
        (key, info["dtype"])
        for key, info in header.items()
        if key != "__metadata__"
        and isinstance(info, dict)
        and isinstance(info.get("dtype"), str)
        and info["dtype"] not in SAFETENSORS_NUMPY_DTYPES
    ]
    if lacking:  # checked first: a file refused for its layout must not reach a reader that takes them
        key, dtype = lacking[0]
        raise ValueError(
            f"{path}: tensor {key!r} is {dtype}, a dtype numpy cannot hold (it holds "
            f"{', '.join(SAFETENSORS_NUMPY_DTYPES)}); cascade-ray's own checkpoints and artifacts store bf16 "
            "weights as float32, so this file was not written by cascade-ray"
        )
    spans: list[tuple[int, int, Entry]] = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            return None
        dtype = SAFETENSORS_NUMPY_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        shape, offsets = info["shape"], info["data_offsets"]
        if dtype is None or not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            return None
        begin, end = offsets
        itemsize = np.dtype(dtype).itemsize
        if begin % itemsize or end - begin != math.prod(shape) * itemsize:
            return None
        spans.append((begin, end, (key, dtype, tuple(shape), begin)))
    spans.sort(key=lambda s: s[:2])
    at = 0
    for begin, end, _ in spans:  # contiguous: no overlap, no gap (a zero-size tensor may share an offset)
        if begin != at:
            return None
        at = end
    return tuple(entry for _, _, entry in spans) if at == size else None


def _ints(values: Any) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)
