"""Tensor digests (models/weights.py) and the hashed read of a weights file (models/packed.py).

The digest format is stored in every manifest written so far (tensor_digests, frozen_digest),
so it is pinned here to its definition: sha256 of the dtype string, the shape and the C-order
bytes, whatever the array's layout and however many threads hash a state.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch

from cascade_ray.models import weights
from cascade_ray.models.packed import read_packed, read_packed_from
from cascade_ray.models.weights import load_safetensors_hashed, save_safetensors, state_digests, tensor_digest


def _defined(arr: np.ndarray) -> str:
    """The digest as manifests define it (the copying form the package used first)."""
    return hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode() + arr.tobytes(order="C")).hexdigest()


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 4), dtype=np.float32)
    return {
        "f32": base,
        "transposed": base.T,  # not C-contiguous: hashed in C order, as tobytes gives it
        "strided": base[::2, 1:],
        "f64-0d": np.array(2.5),
        "i64-0d": np.array(7, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "bool": np.array([True, False, True]),
        "f16": rng.standard_normal(5).astype(np.float16),
        "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
        "c64": (base[:2] + 1j * base[2:4]).astype(np.complex64),
    }


@pytest.mark.parametrize("key", list(_arrays()))
def test_a_digest_is_its_definition_for_every_layout(key):
    arr = _arrays()[key]
    assert tensor_digest(arr) == _defined(arr)


def test_a_torch_tensor_digests_as_its_numpy_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_digest(t) == _defined(t.numpy())
    assert tensor_digest(t.T) == _defined(t.numpy().T)  # a non-contiguous view
    p = torch.nn.Parameter(t.clone())
    assert tensor_digest(p) == _defined(t.numpy())


def test_a_large_state_is_hashed_on_threads_and_digests_the_same(monkeypatch):
    state = {f"t{i}": arr for i, (_, arr) in enumerate(sorted(_arrays().items()))}
    state["torch"] = torch.ones(3, 2)
    names: list[str] = []
    real = weights.tensor_digest

    def recording(tensor):
        names.append(threading.current_thread().name)
        return real(tensor)

    monkeypatch.setattr(weights, "tensor_digest", recording)
    monkeypatch.setattr(weights, "DIGEST_THREADS_MIN_BYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = state_digests(state)
    finally:
        torch.set_num_threads(threads)
    expected = {k: _defined(v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    assert got == expected and list(got) == sorted(state)
    assert names and all(n.startswith("cascade-digest") for n in names)
    names.clear()
    assert state_digests(state, ["t1", "t0"]) == {"t0": expected["t0"], "t1": expected["t1"]}


def test_a_small_state_is_hashed_on_the_calling_thread(monkeypatch):
    names: list[str] = []
    real = weights.tensor_digest
    monkeypatch.setattr(weights, "tensor_digest", lambda t: names.append(threading.current_thread().name) or real(t))
    state_digests(_arrays())
    assert names == [threading.current_thread().name] * len(_arrays())


def _file_sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_hashed_read_hashes_exactly_the_files_bytes_across_chunks(tmp_path):
    rng = np.random.default_rng(1)
    state = {f"w{i}": rng.standard_normal((37, 11), dtype=np.float32) for i in range(8)}
    path = tmp_path / "w.safetensors"
    save_safetensors(state, path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # ~13 chunks, each hashed on the second thread while the next is read
        got = read_packed_from(f, path.stat().st_size, path, digest, chunk_bytes=1000)
    assert got is not None and digest.hexdigest() == _file_sha256(path)
    assert all(np.array_equal(got[k], state[k]) for k in state) and got.keys() == state.keys()
    whole, sha = load_safetensors_hashed(path)  # one chunk, through the framing check
    assert sha == _file_sha256(path) and all(np.array_equal(whole[k], state[k]) for k in state)


def test_a_file_the_block_cannot_view_is_hashed_before_safetensors_reads_it(tmp_path):
    path = tmp_path / "w.safetensors"
    header = (
        b'{"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}'
    )
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes([3]) + np.array([1.5, -2.0], "<f4").tobytes())
    digest = hashlib.sha256()
    assert read_packed(path, digest) is None
    assert digest.hexdigest() == hashlib.sha256().hexdigest()  # nothing fed: the caller hashes the file itself
    got, sha = load_safetensors_hashed(path)
    assert type(got) is dict and got["w"].tolist() == [1.5, -2.0] and sha == _file_sha256(path)
