"""A safetensors file read as one block of views (models/packed.py) through load_safetensors."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file as save_torch_file

from cascade_ray.models import packed as packed_module
from cascade_ray.models.packed import PackedState, read_packed
from cascade_ray.models.weights import load_safetensors, save_safetensors


def _mixed_state() -> dict[str, np.ndarray]:
    """Every dtype width, a 0-d counter, a zero-size tensor and odd byte counts between them."""
    rng = np.random.default_rng(0)
    return {
        "conv.weight": rng.standard_normal((4, 3, 3, 3), dtype=np.float32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "bn.running_var": rng.random(5).astype(np.float64),
        "half": rng.standard_normal(3).astype(np.float16),
        "mask": np.array([True, False, True]),
        "codes": np.arange(5, dtype=np.uint8),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "ids": np.arange(3, dtype=np.int32),
    }


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a
    )


def _raw_file(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_a_file_cascade_ray_writes_is_read_as_one_block_equal_to_safetensors_own_reader(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(_mixed_state(), path)
    state = load_safetensors(path)
    assert isinstance(state, PackedState) and state.intact()
    assert _same(state, load_file(str(path))) and _same(state, _mixed_state())
    assert list(state) == list(load_file(str(path)))  # safetensors' own order (the file's)
    assert state.block.nbytes == os.path.getsize(path) - 8 - int.from_bytes(path.read_bytes()[:8], "little")
    for key, array in state.items():
        assert array.flags.writeable, key  # as writable as safetensors' own arrays
        assert array.size == 0 or np.shares_memory(array, state.block), key
    # torch takes the views as they are (aligned, native byte order)
    assert torch.equal(torch.from_numpy(state["conv.weight"]), torch.from_numpy(_mixed_state()["conv.weight"]))


def test_the_block_pickles_as_one_out_of_band_buffer_and_comes_back_as_views_of_it(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(_mixed_state(), path)
    state = load_safetensors(path)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)  # how Ray serializes numpy
    assert len(buffers) == 1 and len(data) < 2000
    read_only = [memoryview(b).toreadonly() for b in buffers]  # the object store hands readers read-only memory
    back = pickle.loads(data, buffers=read_only)
    assert type(back) is PackedState and back.intact() and _same(back, state)
    assert not any(a.flags.writeable for a in back.values())
    assert all(np.shares_memory(a, back.block) for a in back.values() if a.size)
    # a plain dict of the same arrays: one buffer per array, as before the block
    plain: list[pickle.PickleBuffer] = []
    pickle.dumps(dict(state), protocol=5, buffer_callback=plain.append)
    assert len(plain) == len(state)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.__setitem__("extra", np.ones(2, np.float32)),
        lambda s: s.pop("ids"),
        lambda s: s.__setitem__("conv.weight", s["conv.weight"] * 2),
        lambda s: s.update({"ids": s["ids"].copy()}),
    ],
    ids=["added", "removed", "replaced", "replaced-by-copy"],
)
def test_an_edited_state_pickles_as_a_plain_dict_of_what_it_holds_now(tmp_path, edit):
    path = tmp_path / "w.safetensors"
    save_safetensors(_mixed_state(), path)
    state = load_safetensors(path)
    edit(state)
    assert not state.intact()
    for back in (pickle.loads(pickle.dumps(state, protocol=5)), copy.deepcopy(state)):
        assert type(back) is dict and _same(back, state)


def test_copies_of_an_intact_state_are_packed_too(tmp_path):
    path = tmp_path / "w.safetensors"
    save_safetensors(_mixed_state(), path)
    state = load_safetensors(path)
    deep = copy.deepcopy(state)
    assert type(deep) is PackedState and _same(deep, state) and not np.shares_memory(deep.block, state.block)
    shallow = copy.copy(state)  # a dict's shallow copy shares its values: here, the block
    assert type(shallow) is PackedState and np.shares_memory(shallow.block, state.block)


def _bf16_file(path) -> None:
    save_torch_file({"w": torch.ones(4, dtype=torch.bfloat16)}, str(path))


def _misaligned_file(path) -> None:  # a float32 at byte 1: no aligned view
    _raw_file(
        path,
        {
            "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "w": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
        },
        bytes(1) + np.array([1.5, -2.0], dtype="<f4").tobytes(),
    )


def _gap_file(path) -> None:  # 4 bytes no tensor describes
    _raw_file(path, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))


def _overlap_file(path) -> None:
    _raw_file(
        path,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        bytes(8),
    )


def _wrong_size_file(path) -> None:  # the shape says 3 floats, the offsets 2
    _raw_file(path, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))


def _extra_field_file(path) -> None:
    _raw_file(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, bytes(8))


def _truncated_file(path) -> None:
    save_safetensors(_mixed_state(), path)
    path.write_bytes(path.read_bytes()[:-4])


@pytest.mark.parametrize(
    ("make", "refused"),
    [
        (_misaligned_file, None),
        (_gap_file, "invalid offset for tensor `w`"),
        (_overlap_file, "invalid offset for tensor `b`"),
        (_wrong_size_file, "invalid shape, data type, or offset"),
        (_extra_field_file, None),
        (_truncated_file, "file not fully covered"),
    ],
    ids=["misaligned", "gap", "overlap", "wrong-size", "extra-field", "truncated"],
)
def test_a_file_the_block_cannot_view_is_left_to_safetensors_own_reader(tmp_path, make, refused):
    """None from the block reader; then safetensors' reader loads it (a plain dict) or refuses it,
    and load_safetensors says so naming the file, as before the block."""
    path = tmp_path / "w.safetensors"
    make(path)
    assert read_packed(path) is None
    if refused is None:
        got = load_safetensors(path)
        assert type(got) is dict and _same(got, load_file(str(path)))
    else:
        with pytest.raises(ValueError, match=re.escape(refused)) as info:
            load_safetensors(path)
        assert str(info.value).startswith(f"{path}: ")


def _misaligned_bf16_file(path) -> None:  # refused for its dtype before its layout sends it elsewhere
    _raw_file(
        path,
        {
            "b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            "w": {"dtype": "BF16", "shape": [2], "data_offsets": [1, 5]},
        },
        bytes(5),
    )


@pytest.mark.parametrize("make", [_bf16_file, _misaligned_bf16_file], ids=["bf16", "misaligned-bf16"])
@pytest.mark.parametrize("with_ml_dtypes", [False, True], ids=["numpy-as-imported-so-far", "ml_dtypes-imported"])
def test_a_bf16_file_is_refused_naming_the_key_whatever_numpy_was_taught(tmp_path, make, with_ml_dtypes):
    """With ml_dtypes imported, numpy knows 'bfloat16' and safetensors' reader would return arrays
    torch cannot take; without it, a TypeError. Either way load_safetensors refuses the file the same way."""
    if with_ml_dtypes:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, as some packages do on import)
    path = tmp_path / "w.safetensors"
    make(path)
    for read in (read_packed, load_safetensors):
        with pytest.raises(
            ValueError, match=r"tensor 'w' is BF16, a dtype numpy cannot hold .*store bf16 weights as float32"
        ) as info:
            read(path)
        assert str(info.value).startswith(f"{path}: ")


def test_a_misaligned_file_still_loads_through_the_fallback(tmp_path):
    path = tmp_path / "w.safetensors"
    _misaligned_file(path)
    got = load_safetensors(path)
    assert type(got) is dict and got["w"].tolist() == [1.5, -2.0]


def test_a_file_that_shrinks_while_read_is_an_error_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_safetensors(_mixed_state(), path)
    full = os.path.getsize(path)
    path.write_bytes(path.read_bytes()[:-3])
    real_fstat = os.fstat

    class Stat:  # the size the file had when its layout was checked
        def __init__(self, fd: int) -> None:
            self.st_size = full if real_fstat(fd).st_size == full - 3 else real_fstat(fd).st_size

    monkeypatch.setattr(packed_module.os, "fstat", Stat)
    with pytest.raises(ValueError, match=r"ended after \d+ of its \d+ data bytes") as info:
        read_packed(path)
    assert str(path) in str(info.value)
