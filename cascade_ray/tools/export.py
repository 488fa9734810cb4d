"""``cascade-ray export RUN_DIR``: the composed model as TorchScript or ONNX, checked for parity.

The exported model takes raw images (the run's normalization is built in) and returns
class logits of the last stage's head. Parity against the eager model is measured on
test batches (max abs diff of the logits) and, for ONNX, through onnxruntime when it is
installed. ``--quantize int8`` applies dynamic int8 quantization to the Linear layers and
reports the test-accuracy change.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from cascade_ray.checks import load_config
from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.config.schema import LossConfig
from cascade_ray.data.source import load_data
from cascade_ray.errors import CascadeError
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.losses import build_loss
from cascade_ray.models.metrics import EvalMetrics
from cascade_ray.models.plan import require_plans
from cascade_ray.models.weights import load_numpy_state
from cascade_ray.pipeline.artifacts import read_artifact
from cascade_ray.pipeline.outputs import CONFIG_FILE
from cascade_ray.pipeline.records import read_summary
from cascade_ray.storage import StorageDir, as_storage, local_copy, staged_dir

EXPORT_DIR = "export"
PARITY_SAMPLES = 1000


class ComposedClassifier(nn.Module):
    """Raw images -> normalized -> every stage in order -> last head's logits."""

    def __init__(self, cascade: nn.Module, mean: float, std: float):
        super().__init__()
        self.cascade = cascade
        self.head = cascade.order[-1]
        # per channel (C, 1, 1), per feature (D,) or one value: broadcast to an input row
        self.register_buffer("mean", torch.as_tensor(np.asarray(mean, dtype=np.float32)))
        self.register_buffer("std", torch.as_tensor(np.asarray(std, dtype=np.float32)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.cascade((images - self.mean) / self.std, heads=[self.head])[self.head]


def load_composed(run: str | StorageDir) -> tuple[ComposedClassifier, Any]:
    """The composed model of a finished run (verified artifact) and the run's data splits.

    `run` is ``{storage_path}/{name}``, a local folder or a URI; the last stage's artifact is
    read from ``{run}/stages/<stage>``, wherever the run was written from."""
    run = as_storage(run, "run_dir")
    if not (run / CONFIG_FILE).is_file() or not (run / "summary.json").is_file():
        raise CascadeError(
            f"{run} is not a finished run (no {CONFIG_FILE} / summary.json): pass {{storage_path}}/{{name}}"
        )
    with local_copy(run / CONFIG_FILE) as config_file:
        cfg = load_config(config_file)
    summary = read_summary(run / "summary.json")
    _, state = read_artifact(run / "stages" / summary.stages[-1].name)
    data = load_data(cfg.data, cfg.seed)
    plans = require_plans(cfg, data.input_shape, data.out_width)
    cascade = build_cascade(cfg, plans, data.out_width, upto=len(cfg.stages) - 1)
    load_numpy_state(cascade, state)
    return ComposedClassifier(cascade, data.mean, data.std).eval(), data


def _batches(data: Any, limit: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = np.asarray(data.x_test[:limit], dtype=np.float32)
    y = np.asarray(data.y_test[:limit])
    return [(torch.from_numpy(x[i : i + 500]), torch.from_numpy(y[i : i + 500])) for i in range(0, len(y), 500)]


def _quantizable_linears(model: nn.Module) -> tuple[set[str], int]:
    """Names of Linear layers dynamic int8 can replace, and how many it must leave alone.

    nn.TransformerEncoderLayer reads ``linear.weight`` as a tensor in its forward; a
    dynamically quantized Linear turns it into a method, so those stay fp32.
    """
    inside = {
        f"{name}.{sub}"
        for name, m in model.named_modules()
        if isinstance(m, nn.TransformerEncoderLayer)
        for sub, _ in m.named_modules()
        if sub
    }
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return linears - inside, len(linears & inside)


@torch.no_grad()
def _score(fn: Any, data: Any) -> float:
    """The headline test metric of `fn` on the test split: accuracy (class), mAP (multilabel), R² (regression)."""
    kind = data.target_kind
    metrics = EvalMetrics(kind, data.out_width, build_loss(LossConfig(), kind, training=False))
    for x, y in _batches(data):
        metrics.update(torch.as_tensor(fn(x)), y)
    return metrics.compute(lambda v: v)[HEADLINE_METRIC[kind]]


@torch.no_grad()
def export_run(run: str | StorageDir, fmt: str, quantize: str | None = None) -> dict[str, Any]:
    """Export the run's composed model to ``{run}/export/``; return paths and the measured
    parity/accuracy figures. On object storage the files are written locally, then uploaded."""
    run = as_storage(run, "run_dir")
    model, data = load_composed(run)
    with staged_dir(run / EXPORT_DIR) as out:
        report = _export(model, data, out, fmt, quantize)
    report["path"] = str(run / EXPORT_DIR / Path(report["path"]).name)
    return report


def _export(model: ComposedClassifier, data: Any, out: Path, fmt: str, quantize: str | None) -> dict[str, Any]:
    parity = _batches(data, PARITY_SAMPLES)
    example = parity[0][0][:2]
    metric = HEADLINE_METRIC[data.target_kind]
    report: dict[str, Any] = {"format": fmt, f"eager_test_{metric}": _score(model, data)}
    if fmt == "torchscript":
        path = out / "model.ts"
        # grad mode: keeps nn.TransformerEncoderLayer off its inference fast path, which
        # does not trace
        with torch.enable_grad():
            traced = torch.jit.trace(model, example, check_trace=False)
        traced.save(str(path))
        loaded = torch.jit.load(str(path))
        report["max_abs_diff"] = max(float((loaded(x) - model(x)).abs().max()) for x, _ in parity)
    elif fmt == "onnx":
        path = out / "model.onnx"
        with torch.enable_grad():
            report["exporter"] = _export_onnx(model, example, path)
        report |= _onnxruntime_parity(path, model, parity)
    else:
        raise CascadeError(f"unknown export format {fmt!r} (valid: torchscript, onnx)")
    report["path"] = str(path)
    if quantize == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notice; the API still works here
            names, skipped = _quantizable_linears(model)
            quantized = torch.ao.quantization.quantize_dynamic(model, names, dtype=torch.qint8)
        report["int8_linear_layers"] = {"quantized": len(names), "kept_fp32_in_transformer_layers": skipped}
        report[f"int8_test_{metric}"] = _score(quantized, data)
        report[f"int8_{metric}_change"] = report[f"int8_test_{metric}"] - report[f"eager_test_{metric}"]
    (out / f"{fmt}.json").write_text(json.dumps(report, indent=2))
    return report


def _export_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> str:
    """torch.export-based ONNX export, falling back to the TorchScript-based exporter."""
    names = {"input_names": ["images"], "output_names": ["logits"]}
    try:
        torch.onnx.export(
            model, (example,), str(path), **names, dynamic_shapes=({0: torch.export.Dim("batch")},), dynamo=True
        )
        return "dynamo"
    except Exception:  # noqa: BLE001 - some user modules do not trace with torch.export
        torch.onnx.export(model, (example,), str(path), **names, dynamic_axes={"images": {0: "batch"}}, dynamo=False)
        return "torchscript"


def _onnxruntime_parity(
    path: Path, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, Any]:
    try:
        import onnxruntime as ort
    except ImportError:
        return {"onnxruntime": "not installed (pip install onnxruntime to check parity)"}
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    diff = max(float(np.abs(session.run(None, {name: x.numpy()})[0] - model(x).numpy()).max()) for x, _ in batches)
    return {"onnxruntime": ort.__version__, "max_abs_diff": diff}
