"""``cascade-ray export RUN [--format pt2|onnx|torchscript] [--quantize int8] [--stage S]``.

The exported model is the run's composed model (:func:`load_cascade`, rebuilt from the run's
files, no training data): it takes raw inputs (the normalization is inside) and returns the
head outputs of the last stage (or `--stage`). Formats:

- ``pt2`` (default): a ``torch.export`` program with a dynamic batch dimension, written with
  ``torch.export.save``; ``torch.export.load(path).module()(x)`` runs it.
- ``onnx``: the dynamo-based exporter, falling back to the TorchScript-based one; parity
  through onnxruntime when it is installed.
- ``torchscript`` (legacy, deprecated): ``torch.jit.trace``; use pt2 for new consumers.

Next to ``model.<ext>`` the folder ``{run}/export/`` (``{run}/export/<stage>/`` for an
earlier stage) holds ``<format>.json`` (what was measured) and ``input_spec.json`` (what to
feed the model), so a consumer needs neither cascade-ray nor the run. Every export is
reloaded and compared with the eager model (:mod:`cascade_ray.tools.export_parity`); a
difference above the tolerance is a :class:`CascadeError` and leaves no model file.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.artifacts import MANIFEST
from cascade_ray.pipeline.records import read_manifest
from cascade_ray.storage import StorageDir, staged_dir
from cascade_ray.tools.export_parity import ParityInputs, headline_score, int8_figures, max_abs_diff, parity_inputs
from cascade_ray.tools.inference import Cascade, load_cascade

EXPORT_DIR = "export"
FORMATS = {"pt2": "model.pt2", "onnx": "model.onnx", "torchscript": "model.ts"}
# fp32 tracers reorder a few ops at most; relative to the largest output for large logits
PARITY_TOLERANCE = 1e-4
# torch.export specializes a batch of 1 to the constant 1: trace with 2 rows
EXAMPLE_ROWS = 2
TORCHSCRIPT_NOTE = "torchscript is a legacy format (torch.jit is deprecated): export pt2 for new consumers"
INPUT_SPEC = "input_spec.json"
ONNX_INLINE_BYTES = 1 << 30


def _batch_dim() -> Any:
    return torch.export.Dim("batch", min=1)


def export_program(module: nn.Module, example: torch.Tensor) -> torch.export.ExportedProgram:
    """``torch.export`` of `module` on `example` with a dynamic batch dimension.

    Raises:
        CascadeError: the module does not trace; names the first stage part that fails alone.
    """
    try:
        # grad mode: keeps nn.TransformerEncoderLayer off its inference fast path
        with torch.enable_grad():
            return torch.export.export(module, (example,), dynamic_shapes=({0: _batch_dim()},))
    except Exception as exc:  # noqa: BLE001 - dynamo raises many types for code it cannot trace
        where = _failing_part(module, example) or f"the composed model ({type(module).__name__})"
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise CascadeError(
            f"torch.export cannot trace {where}: {type(exc).__name__}: {first}; "
            "export with --format onnx or --format torchscript (tracers that follow one path: "
            "the parity check tells whether it holds)"
        ) from None


def _failing_part(module: nn.Module, example: torch.Tensor) -> str | None:
    """The first adapter/module/head of the cascade that does not export on its own, if any."""
    composed = getattr(module, "module", None)
    cascade = getattr(composed, "cascade", None)
    if cascade is None:
        return None
    with torch.no_grad():
        x = (example - module.mean) / module.std
    first = cascade.order.index(cascade.input_stage) if cascade.input_stage else 0
    names = cascade.order[first:]
    for name in names:
        parts = [("adapter", cascade.adapters[name])] if name in cascade.adapters else []
        parts += [("module", cascade.blocks[name])] + ([("head", cascade.heads[name])] if name == names[-1] else [])
        for kind, part in parts:
            try:
                with torch.enable_grad():
                    torch.export.export(part, (x,), dynamic_shapes=({0: _batch_dim()},))
            except Exception:  # noqa: BLE001 - any failure names the part
                return f"stage {name!r} ({kind} {type(part).__name__})"
            with torch.no_grad():
                x = part(x)
    return None


def _write(fmt: str, model: nn.Module, example: torch.Tensor, path: Path, report: dict[str, Any]) -> Callable | None:
    """Write `model` as `fmt` to `path`; return the reloaded model as a callable (None: cannot run here)."""
    if fmt == "pt2":
        torch.export.save(export_program(model, example), str(path))
        return torch.export.load(str(path)).module()
    if fmt == "torchscript":
        # grad mode: see export_program; the tracer's warnings about shape checks turned
        # constants are what the parity check on other batch sizes measures
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.jit.trace(model, example, check_trace=False).save(str(path))
        report["deprecated"] = TORCHSCRIPT_NOTE
        return torch.jit.load(str(path))
    with torch.enable_grad():
        report["exporter"] = _export_onnx(model, example, path)
    try:
        import onnxruntime as ort
    except ImportError:
        report["onnxruntime"] = "not installed (pip install onnxruntime to check parity)"
        return None
    report["onnxruntime"] = ort.__version__
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def _export_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> str:
    """torch.export-based ONNX export, falling back to the TorchScript-based exporter."""
    names = {"input_names": ["inputs"], "output_names": ["outputs"]}
    # one self-contained file unless the weights near protobuf's 2 GiB limit (then model.onnx.data)
    external = sum(p.numel() * p.element_size() for p in model.parameters()) > ONNX_INLINE_BYTES
    try:
        torch.onnx.export(
            model,
            (example,),
            str(path),
            **names,
            dynamic_shapes=({0: _batch_dim()},),
            dynamo=True,
            external_data=external,
            verbose=False,  # its progress lines would go to stdout, where the CLI prints the report
        )
        return "dynamo"
    except Exception:  # noqa: BLE001 - some user modules do not trace with torch.export
        torch.onnx.export(model, (example,), str(path), **names, dynamic_axes={"inputs": {0: "batch"}}, dynamo=False)
        return "torchscript"


def input_spec(cascade: Cascade) -> dict[str, Any]:
    """What a consumer feeds the exported model and reads from it (``input_spec.json``)."""
    spec = cascade.spec
    # validated and checked against its own digest (a JSON list or an edited field is an ArtifactError)
    manifest = read_manifest(cascade.run / "stages" / cascade.stage / MANIFEST)
    raw_dtype = (manifest.data_spec or {}).get("input_dtype")
    return {
        "stage": cascade.stage,
        "input_shape": ["batch", *spec.input_shape],
        "dtype": "float32",
        "training_input_dtype": np.dtype(raw_dtype).name if raw_dtype else None,
        "target_kind": spec.target_kind,
        "output_shape": ["batch", spec.out_width],
        "outputs": {
            "class": "logits (softmax for probabilities)",
            "multilabel": "logits (sigmoid per label)",
            "regression": "values",
        }[spec.target_kind],
        "class_names": list(spec.class_names) if spec.class_names else None,
        "normalization": {
            "mean": spec.mean.tolist(),
            "std": spec.std.tolist(),
            "where": "inside the model: feed raw inputs on the training data's scale",
        },
    }


@torch.no_grad()
def export_run(
    location: str | StorageDir,
    fmt: str = "pt2",
    quantize: str | None = None,
    stage: str | None = None,
    *,
    trust: list[str] | tuple[str, ...] = (),
    trust_run: bool = True,
) -> dict[str, Any]:
    """Export the composed model of a finished run (or up to `stage`) and check its parity.

    Args:
        location: ``{storage_path}/{name}`` (local or ``s3://`` / ``gs://``) or ``{run}/stages/<stage>``.
        fmt: ``pt2``, ``onnx`` or ``torchscript`` (legacy).
        quantize: ``int8``: also report dynamic int8 quantization's effect (eager model).
        stage: the stage whose head the model returns (default: the run's last).
        trust, trust_run: as :func:`load_cascade` (``--trust``, ``--untrusted-run``).

    Returns:
        The report written to ``<format>.json``: paths, parity and (test split) scores.

    Raises:
        CascadeError: unknown format, a module torch.export cannot trace, or a parity failure.
    """
    if fmt not in FORMATS:
        raise CascadeError(f"unknown export format {fmt!r} (valid: {', '.join(FORMATS)})")
    cascade = load_cascade(location, stage, trust=trust, trust_run=trust_run)
    folder = cascade.run / EXPORT_DIR
    if cascade.stage != cascade.cfg.stages[-1].name:  # an unfinished run's done stage exports too
        folder = folder / cascade.stage
    inputs = parity_inputs(cascade)
    with staged_dir(folder) as out:
        report = _export(cascade, inputs, out, fmt, quantize, folder)
    if report.get("parity") == "failed":
        raise CascadeError(
            f"{report['path']}: the {fmt} model differs from the eager model by {report['max_abs_diff']:.3g} "
            f"(tolerance {report['parity_tolerance']:.3g}); no model was kept (report: {folder / (fmt + '.json')}); "
            "try another --format"
        )
    return report


def _export(
    cascade: Cascade, inputs: ParityInputs, out: Path, fmt: str, quantize: str | None, folder: StorageDir
) -> dict[str, Any]:
    """Write the model, ``input_spec.json`` and ``<fmt>.json`` to `out` (staged for `folder`); return the report."""
    model = cascade.composed
    example = torch.cat(inputs.batches)[:EXAMPLE_ROWS]
    report: dict[str, Any] = {"format": fmt, "stage": cascade.stage} | inputs.describe()
    eager = None
    if inputs.data is not None:
        eager = headline_score(model, inputs.data)
        report[f"eager_test_{HEADLINE_METRIC[inputs.data.target_kind]}"] = eager
    path = out / FORMATS[fmt]
    loaded = _write(fmt, model, example, path, report)
    if loaded is not None:
        diff, scale = max_abs_diff(loaded, model, inputs.batches)
        tolerance = PARITY_TOLERANCE * max(1.0, scale)
        report |= {
            "max_abs_diff": diff,
            "parity_tolerance": tolerance,
            "parity": "ok" if diff <= tolerance else "failed",
        }
        if report["parity"] == "failed":
            path.unlink()
    if quantize == "int8":
        report |= int8_figures(model, inputs, eager)
    (out / INPUT_SPEC).write_text(json.dumps(input_spec(cascade), indent=2))
    report |= {"path": str(folder / FORMATS[fmt]), "input_spec": str(folder / INPUT_SPEC)}
    (out / f"{fmt}.json").write_text(json.dumps(report, indent=2))
    return report
