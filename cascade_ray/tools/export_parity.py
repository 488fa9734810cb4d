"""What ``export`` checks an exported model on: parity inputs, the headline test score, int8.

The model and its normalization come from the run's files (:func:`load_cascade`); the run's
data is read only to measure, never to rebuild anything. When it loads here, parity runs
on the first rows of its test split and the eager (and int8) headline metrics are reported;
when it does not (the data is on another machine, or too large to load), parity runs on a
fixed-seed synthetic batch drawn at the run's own input scale, and no score is reported.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.config.schema import LossConfig
from cascade_ray.data.source import load_data
from cascade_ray.errors import CascadeError
from cascade_ray.models.losses import build_loss
from cascade_ray.models.metrics import EvalMetrics
from cascade_ray.tools.inference import Cascade

PARITY_SAMPLES = 1000
SYNTHETIC_ROWS = 64
SYNTHETIC_SEED = 0
# a batch of 1 and an odd size first: a batch dimension a tracer baked in shows up there
PARITY_BATCH_SIZES = (1, 7)
SCORE_BATCH_ROWS = 500

Model = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ParityInputs:
    """Raw-input batches an export is compared on, and the run's data when it loaded here."""

    source: str  # "test split" | "synthetic"
    batches: list[torch.Tensor]
    data: Any = None  # DataSplits, for the test-split scores
    note: str | None = None  # why the inputs are synthetic

    def describe(self) -> dict[str, Any]:
        """The report's fields about these inputs."""
        sizes = [len(b) for b in self.batches]
        out: dict[str, Any] = {"parity_inputs": self.source, "parity_batch_sizes": sizes}
        return out | ({"parity_inputs_note": self.note} if self.note else {})


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    cuts = [0]
    for size in (*PARITY_BATCH_SIZES, *[SCORE_BATCH_ROWS] * (len(x) // SCORE_BATCH_ROWS + 1)):
        if cuts[-1] >= len(x):
            break
        cuts.append(min(cuts[-1] + size, len(x)))
    return [x[a:b] for a, b in zip(cuts, cuts[1:])]


def _run_data(cascade: Cascade) -> tuple[Any, str | None]:
    """The run's data splits when they load here and still fit its input spec, else (None, why)."""
    cfg, spec = cascade.cfg, cascade.spec
    if cfg.data.streaming is True:
        return None, "data.streaming is true: the data is not loaded into memory to check an export"
    try:
        data = load_data(cfg.data, cfg.seed)
    except (CascadeError, OSError) as exc:  # DataError: not on this machine, moved, unreadable
        return None, f"the run's data does not load here ({str(exc).splitlines()[0][:200]})"
    seen = (tuple(data.input_shape), data.target_kind, int(data.out_width))
    if seen != (spec.input_shape, spec.target_kind, spec.out_width):
        return None, f"the run's data no longer fits its input spec (loaded {seen}, {spec.describe()})"
    return data, None


def parity_inputs(cascade: Cascade) -> ParityInputs:
    """The test split's first :data:`PARITY_SAMPLES` rows, or a fixed-seed synthetic batch."""
    data, why = _run_data(cascade)
    if data is not None:
        x = torch.from_numpy(np.array(data.x_test[:PARITY_SAMPLES], dtype=np.float32))  # a copy: may be read-only
        return ParityInputs("test split", _split(x), data)
    spec = cascade.spec
    noise = torch.randn((SYNTHETIC_ROWS, *spec.input_shape), generator=torch.Generator().manual_seed(SYNTHETIC_SEED))
    # at the scale of the training inputs, so normalized values look like real ones
    x = noise * torch.from_numpy(spec.std) + torch.from_numpy(spec.mean)
    return ParityInputs("synthetic", _split(x.float()), None, why)


@torch.no_grad()
def max_abs_diff(exported: Model, eager: nn.Module, batches: list[torch.Tensor]) -> tuple[float, float]:
    """The largest absolute output difference over `batches`, and the largest eager output (its scale)."""
    diff = scale = 0.0
    for x in batches:
        want = eager(x)
        got = torch.as_tensor(exported(x))
        if got.shape != want.shape:
            raise CascadeError(
                f"the exported model returned shape {tuple(got.shape)} for a batch of {len(x)}; "
                f"the eager model returns {tuple(want.shape)}"
            )
        diff = max(diff, float((got - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    return diff, scale


@torch.no_grad()
def headline_score(fn: Model, data: Any) -> float:
    """The headline test metric of `fn` on the test split: accuracy (class), mAP (multilabel), R² (regression)."""
    kind = data.target_kind
    metrics = EvalMetrics(kind, data.out_width, build_loss(LossConfig(), kind, training=False))
    x = np.asarray(data.x_test, dtype=np.float32)
    y = np.asarray(data.y_test)
    for i in range(0, len(y), SCORE_BATCH_ROWS):
        batch = torch.from_numpy(x[i : i + SCORE_BATCH_ROWS])
        metrics.update(torch.as_tensor(fn(batch)), torch.from_numpy(y[i : i + SCORE_BATCH_ROWS]))
    return metrics.compute(lambda v: v)[HEADLINE_METRIC[kind]]


def quantizable_linears(model: nn.Module) -> tuple[set[str], int]:
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


def int8_figures(model: nn.Module, inputs: ParityInputs, eager_score: float | None) -> dict[str, Any]:
    """Dynamic int8 quantization of the eager model's Linear layers: its output drift and score change.

    Measured on the eager model only: the exported file stays fp32 (torch.export cannot
    serialize the packed int8 Linear weights: ``LinearPackedParamsBase`` has no
    ``__obj_flatten__`` in torch 2.13).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice; the API still works here
        names, skipped = quantizable_linears(model)
        quantized = torch.ao.quantization.quantize_dynamic(model, names, dtype=torch.qint8)
    out: dict[str, Any] = {
        "int8_linear_layers": {"quantized": len(names), "kept_fp32_in_transformer_layers": skipped},
        "int8_max_abs_diff": max_abs_diff(quantized, model, inputs.batches)[0],
        "int8_note": "measured on the eager model; the exported file is fp32",
    }
    if inputs.data is not None and eager_score is not None:
        metric = HEADLINE_METRIC[inputs.data.target_kind]
        out[f"int8_test_{metric}"] = headline_score(quantized, inputs.data)
        out[f"int8_{metric}_change"] = out[f"int8_test_{metric}"] - eager_score
    return out
