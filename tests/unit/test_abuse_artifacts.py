"""The tampered-files matrix (issue 18, part 6): artifacts, manifests, feature caches (in memory and
streamed) and pretrained files altered after they were written. Each case must end in an error
naming the file (exit 2), never in a silently accepted read.

``TAMPER_CASES`` is the matrix (one entry per case, counted in docs/reliability.md). A case
writes a good file, alters it, and returns the read to run and the path the error must name.
Feature-cache cases run twice: ``cache_features: on`` (an :class:`ArtifactError`) and ``auto``
(recomputed: the read returns None with a warning naming the file). ``cascade-ray cp`` through a
dangling symlink is refused in tests/unit/test_tools.py (test_cp_refuses_a_dangling_symlink_...).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import save_file
from support.run_records import manifest_fields

from cascade_ray.config.schema import PretrainedConfig
from cascade_ray.errors import ArtifactError, CascadeError, ConfigError
from cascade_ray.models.pretrained import load_pretrained, pretrained_sha256
from cascade_ray.models.weights import state_digests
from cascade_ray.pipeline.artifacts import MANIFEST, WEIGHTS, file_sha256, read_artifact, write_artifact
from cascade_ray.pipeline.features import _read_parquet, _write_parquet, rows_key
from cascade_ray.pipeline.records import Manifest, manifest_text, read_manifest, seal_manifest
from cascade_ray.pipeline.stream_cache import META_FILE, _stored_rows, write_meta

KEY, SIZES = "k" * 64, {"train": 5, "val": 3}
LABELS = {"y_train": np.arange(5) % 2, "y_val": np.arange(3) % 2}


def _state() -> dict[str, np.ndarray]:
    return {"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "fc.bias": np.ones(2, np.float32)}


# --- artifacts and manifests -------------------------------------------------------------------


def _artifact(tmp: Path) -> Path:
    path = tmp / "stages" / "a"
    write_artifact(path, _state(), manifest_fields("a"))
    return path


def _edit_manifest(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    """Edit manifest.json's fields in place (its manifest_sha256 left as written)."""

    def tamper(path: Path) -> Path:
        raw = json.loads((path / MANIFEST).read_text())
        edited = edit(raw)
        text = edited if isinstance(edited, str) else json.dumps(raw if edited is None else edited)
        (path / MANIFEST).write_text(text)
        return path / MANIFEST

    return tamper


def _rewrite_weights(state: dict[str, np.ndarray] | None = None, raw: bytes | None = None) -> Callable[[Path], Path]:
    """A consistent forgery: new weights, with their sha256 and digests in a re-sealed manifest,
    so only the checks on the weights themselves (finite values, safetensors framing) stand."""

    def tamper(path: Path) -> Path:
        if raw is not None:
            (path / WEIGHTS).write_bytes(raw)
        else:
            save_file(state, str(path / WEIGHTS))
        fields = json.loads((path / MANIFEST).read_text())
        fields["weights_sha256"] = file_sha256(path / WEIGHTS)
        if state is not None:
            fields["tensor_digests"] = state_digests(state)
        (path / MANIFEST).write_text(manifest_text(seal_manifest(Manifest.model_validate(fields))))
        return path / WEIGHTS

    return tamper


def _flip_weights_bit(path: Path) -> Path:
    data = bytearray((path / WEIGHTS).read_bytes())
    data[-3] ^= 0x01
    (path / WEIGHTS).write_bytes(bytes(data))
    return path


def _truncate_weights(path: Path) -> Path:
    data = (path / WEIGHTS).read_bytes()
    (path / WEIGHTS).write_bytes(data[: len(data) // 2])
    return path


def _replace(name: str, how: Callable[[Path], None]) -> Callable[[Path], Path]:
    def tamper(path: Path) -> Path:
        (path / name).unlink()
        how(path / name)
        return path

    return tamper


def _nan_state() -> dict[str, np.ndarray]:
    state = _state()
    state["fc.bias"][1] = np.nan
    return state


def _oversized_header() -> bytes:
    return (2**40).to_bytes(8, "little") + b"{}"


def _reseal_digests(path: Path) -> Path:
    """Edit a tensor digest and re-seal the manifest: the weights no longer match it."""
    fields = json.loads((path / MANIFEST).read_text())
    fields["tensor_digests"]["fc.bias"] = "0" * 64
    (path / MANIFEST).write_text(manifest_text(seal_manifest(Manifest.model_validate(fields))))
    return path


# --- feature caches ------------------------------------------------------------------------------


def _features() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x_train": rng.standard_normal((5, 2, 3)).astype(np.float32), "x_val": rng.random((3, 2, 3), np.float32)}


def _cache_file(tmp: Path) -> Path:
    path = tmp / "cache" / "head" / "k.parquet"
    _write_parquet(path, KEY, _features(), rows_key(LABELS))
    return path


def _rewrite_rows(change: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], Path]:
    """Rewrite the cache's feature values (what a bit flip in a page or an edit does), keeping its metadata."""

    def tamper(path: Path) -> Path:
        table = pq.read_table(path)
        x = table.column("x").combine_chunks()
        values = change(x.flatten().to_numpy().reshape(len(x), -1).copy())
        column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), x.type.list_size)
        table = pa.table({"split": table.column("split"), "x": column}).replace_schema_metadata(table.schema.metadata)
        pq.write_table(table, path)
        return path

    return tamper


def _flip_bit(values: np.ndarray) -> np.ndarray:
    values.view(np.uint32)[2, 4] ^= 1 << 3
    return values


def _nan_fill(values: np.ndarray) -> np.ndarray:
    values[:] = np.nan
    return values


def _edit_meta(key: str, value: str | None) -> Callable[[Path], Path]:
    def tamper(path: Path) -> Path:
        table = pq.read_table(path)
        meta = {k.decode(): v for k, v in table.schema.metadata.items()}
        if value is None:
            del meta[key]
        else:
            meta[key] = value.encode()
        pq.write_table(table.replace_schema_metadata(meta), path)
        return path

    return tamper


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


def _fifo_file(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _read_cache(strict: bool, rows: str | None = None) -> Callable[[Path, list[str]], Any]:
    return lambda path, log: _read_parquet(
        path, KEY, SIZES, log.append, "head", rows=rows or rows_key(LABELS), strict=strict
    )


# --- streamed feature caches ---------------------------------------------------------------------


def _stream_cache(tmp: Path) -> Path:
    folder = tmp / "cache" / "head" / KEY[:16]
    for split, n in SIZES.items():
        (folder / split).mkdir(parents=True)
        for part in range(2):
            x = pa.FixedSizeListArray.from_arrays(pa.array(np.full(n * 6, part, np.float32)), 6)
            pq.write_table(pa.table({"x": x, "label": pa.array(np.arange(n))}), folder / split / f"{part}.parquet")
    write_meta(folder, KEY, (2, 3), {s: 2 * n for s, n in SIZES.items()})
    return folder


def _reverse_shard(folder: Path) -> Path:
    shard = folder / "train" / "0.parquet"
    table = pq.read_table(shard)
    pq.write_table(table.take(pa.array(range(table.num_rows - 1, -1, -1))), shard)
    return shard


def _edit_stream_meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], Path]:
    def tamper(folder: Path) -> Path:
        meta = json.loads((folder / META_FILE).read_text())
        edited = edit(meta)
        (folder / META_FILE).write_text(json.dumps(meta if edited is None else edited))
        return folder

    return tamper


def _drop_shard(folder: Path) -> Path:
    (folder / "val" / "1.parquet").unlink()
    return folder


def _read_stream(strict: bool) -> Callable[[Path, list[str]], Any]:
    return lambda folder, log: _stored_rows(folder, KEY, (2, 3), log.append, "head", strict=strict)


# --- pretrained files ----------------------------------------------------------------------------


def _pretrained(tmp: Path, state: dict[str, np.ndarray] | None = None, raw: bytes | None = None) -> Path:
    path = tmp / "net.safetensors"
    if raw is not None:
        path.write_bytes(raw)
    else:
        save_file(_state() if state is None else state, str(path))
    return path


def _load_into_linear(path: Path) -> None:
    load_pretrained(torch.nn.Linear(3, 2), PretrainedConfig(path=str(path), prefix="fc."), "stages[0].pretrained")


# --- the matrix ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TamperCase:
    """One alteration: `setup(tmp)` writes the good file(s) and returns their path, `tamper(path)`
    alters them and returns the path the error must name, `read(path, log)` reads them back."""

    name: str
    setup: Callable[[Path], Path]
    tamper: Callable[[Path], Path]
    read: Callable[[Path, list[str]], Any]
    error: type[CascadeError]
    needle: str
    auto: Callable[[Path, list[str]], Any] | None = None  # the cache's `auto` read: recompute, warn
    clean: bool = True  # `setup` writes a good file (False: it writes the bad one itself)


def _artifact_case(name: str, tamper: Callable[[Path], Path], needle: str) -> TamperCase:
    return TamperCase(name, _artifact, tamper, lambda p, _: read_artifact(p), ArtifactError, needle)


def _cache_case(name: str, tamper: Callable[[Path], Path], needle: str, rows: str | None = None) -> TamperCase:
    """`rows`: the row-order key of the data the cache is read for (default: the one it was written for)."""
    read, auto = _read_cache(True, rows), _read_cache(False, rows)
    return TamperCase(name, _cache_file, tamper, read, ArtifactError, needle, auto=auto, clean=rows is None)


def _stream_case(name: str, tamper: Callable[[Path], Path], needle: str) -> TamperCase:
    return TamperCase(name, _stream_cache, tamper, _read_stream(True), ArtifactError, needle, auto=_read_stream(False))


def _pretrained_case(name: str, make: Callable[[Path], Path], needle: str) -> TamperCase:
    return TamperCase(name, make, lambda p: p, lambda p, _: _load_into_linear(p), ConfigError, needle, clean=False)


TAMPER_CASES = [
    # manifests: every field is covered by manifest_sha256
    _artifact_case(
        "manifest-fingerprint-edited", _edit_manifest(lambda m: m.update(fingerprint="0" * 64)), "manifest_sha256"
    ),
    _artifact_case(
        "manifest-metrics-edited", _edit_manifest(lambda m: m["metrics"].update(val_loss=0.0)), "manifest_sha256"
    ),
    _artifact_case(
        "manifest-digest-removed",
        _edit_manifest(lambda m: m.pop("manifest_sha256") and None),
        "'manifest_sha256' missing",
    ),
    _artifact_case("manifest-is-a-json-list", _edit_manifest(lambda m: [m]), "expected a JSON object, found list"),
    _artifact_case("manifest-truncated", _edit_manifest(lambda m: json.dumps(m)[:40]), "not JSON (EOF while parsing"),
    _artifact_case("manifest-is-a-fifo", _replace(MANIFEST, os.mkfifo), "manifest.json is a FIFO"),
    # weights: sha256 in the manifest, digests per tensor, finite values, safetensors framing
    _artifact_case("weights-bit-flip", _flip_weights_bit, "does not match its sha256"),
    _artifact_case("weights-truncated", _truncate_weights, "does not match its sha256"),
    _artifact_case("weights-missing", lambda p: ((p / WEIGHTS).unlink(), p)[1], "weights.safetensors does not exist"),
    _artifact_case(
        "weights-dangling-symlink", _replace(WEIGHTS, lambda f: f.symlink_to(f.with_name("gone"))), "dangling symlink"
    ),
    _artifact_case("weights-are-a-fifo", _replace(WEIGHTS, os.mkfifo), "weights.safetensors is a FIFO"),
    _artifact_case("weights-nan-resealed", _rewrite_weights(_nan_state()), "NaN/Inf in fc.bias"),
    _artifact_case(
        "weights-oversized-header-resealed",
        _rewrite_weights(raw=_oversized_header()),
        "header claims 1099511627776 bytes",
    ),
    _artifact_case("tensor-digest-edited-resealed", _reseal_digests, "tensor digests differ"),
    # the in-memory feature cache: sha256 of the feature bytes and the row-order key
    _cache_case("cache-one-bit-flip", _rewrite_rows(_flip_bit), "do not match their sha256"),
    _cache_case("cache-nan-filled", _rewrite_rows(_nan_fill), "do not match their sha256"),
    _cache_case("cache-rows-reversed", _rewrite_rows(lambda v: v[::-1].copy()), "do not match their sha256"),
    _cache_case("cache-shape-metadata-changed", _edit_meta("cascade_ray.shape", "[3, 2]"), "do not match their sha256"),
    _cache_case("cache-shape-metadata-abc", _edit_meta("cascade_ray.shape", "abc"), "Expecting value"),
    _cache_case("cache-truncated", _truncate, "is damaged"),
    _cache_case("cache-digest-missing", _edit_meta("cascade_ray.sha256", None), "lacks cascade_ray.sha256"),
    _cache_case("cache-data-rows-reordered", lambda p: p, "row-order key does not match", rows="other order"),
    _cache_case("cache-is-a-fifo", _fifo_file, "is a FIFO"),
    # the streamed feature cache: shard digests in a self-sealed _cache.json
    _stream_case("stream-shard-rows-reversed", _reverse_shard, "does not match its sha256 in _cache.json"),
    _stream_case("stream-shard-removed", _drop_shard, "val shards differ"),
    _stream_case(
        "stream-meta-rows-edited",
        _edit_stream_meta(lambda m: m["rows"].update(train=1)),
        "_cache.json does not match its sha256",
    ),
    _stream_case(
        "stream-meta-digest-removed", _edit_stream_meta(lambda m: m.pop("sha256")), "not a JSON object with a sha256"
    ),
    _stream_case("stream-meta-is-a-json-list", _edit_stream_meta(lambda m: [m]), "not a JSON object with a sha256"),
    # pretrained files (fixed earlier in issue 18; kept here as cases)
    _pretrained_case("pretrained-nan", lambda t: _pretrained(t, _nan_state()), "NaN or Inf"),
    _pretrained_case(
        "pretrained-wrong-dtype",
        lambda t: _pretrained(t, {k: v.astype(np.int8) for k, v in _state().items()}),
        "torch.int8",
    ),
    _pretrained_case("pretrained-oversized-header", lambda t: _pretrained(t, raw=_oversized_header()), "header claims"),
    _pretrained_case("pretrained-not-safetensors", lambda t: _pretrained(t, raw=b"abc"), "too short"),
]


def test_the_tamper_matrix_is_complete():
    assert len(TAMPER_CASES) >= 15, f"issue 18 asks for at least 15 tampered-file cases, found {len(TAMPER_CASES)}"
    assert len({c.name for c in TAMPER_CASES}) == len(TAMPER_CASES)


def _in_thread(read: Callable[[], Any]) -> BaseException | None:
    """Run `read` with a deadline: a read that opens a FIFO would block forever."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            read()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert outcome, "the read blocked (opened a FIFO?)"
    return outcome[0]


@pytest.mark.parametrize("case", TAMPER_CASES, ids=lambda c: c.name)
def test_a_tampered_file_is_an_error_naming_it(case, tmp_path):
    path = case.setup(tmp_path)
    if case.clean:
        case.read(path, [])  # the untouched file reads back
    named = case.tamper(path)
    started = time.perf_counter()
    error = _in_thread(lambda: case.read(path, []))
    assert isinstance(error, case.error), repr(error)
    assert time.perf_counter() - started < 2.0
    message = str(error)
    assert error.exit_code == 2
    assert str(named) in message or str(named.parent) in message, message
    assert case.needle in message, message


@pytest.mark.parametrize("case", [c for c in TAMPER_CASES if c.auto], ids=lambda c: c.name)
def test_a_damaged_cache_under_auto_is_recomputed_with_a_warning_naming_it(case, tmp_path):
    path = case.setup(tmp_path)
    case.tamper(path)
    log: list[str] = []
    assert _in_thread(lambda: log.append(case.auto(path, log))) is None
    assert log[-1] is None  # None: the caller computes the features again
    (warning,) = log[:-1]
    assert warning.strip().startswith("WARNING: head: stored feature cache") and str(path) in warning
    assert case.needle in warning or "is damaged" in warning, warning


def test_a_changed_pretrained_file_changes_its_digest_in_the_fingerprint(tmp_path):
    path = _pretrained(tmp_path)
    before = pretrained_sha256(path)
    state = _state()
    state["fc.bias"][0] += 1.0
    save_file(state, str(path))
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the digest is remembered per (size, mtime)
    assert pretrained_sha256(path) != before


def test_a_fifo_as_pretrained_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "net.safetensors"
    os.mkfifo(fifo)
    error = _in_thread(lambda: _load_into_linear(fifo))
    assert isinstance(error, ConfigError) and "is a FIFO" in str(error) and str(fifo) in str(error)


def test_read_manifest_refuses_an_edited_field_and_accepts_the_written_one(tmp_path):
    path = _artifact(tmp_path)
    assert read_manifest(path / MANIFEST).fingerprint == "f" * 64
    raw = json.loads((path / MANIFEST).read_text())
    raw["index"] = 1
    (path / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="do not match its manifest_sha256"):
        read_manifest(path / MANIFEST)


def test_a_fifo_as_summary_or_manifest_is_refused_without_opening_it(tmp_path):
    from cascade_ray.pipeline.records import read_summary

    fifo = tmp_path / "summary.json"
    os.mkfifo(fifo)
    for read in (read_summary, read_manifest):
        error = _in_thread(lambda read=read: read(fifo))
        assert isinstance(error, ArtifactError) and f"{fifo}: unreadable (is a FIFO" in str(error), error
