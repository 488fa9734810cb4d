"""Stage losses by name (``stages[i].loss.type``), matched to the data's target kind.

``auto`` (the default) is the kind's own loss. A builtin name fits one target kind: ``cross_entropy`` class indices, ``bce`` multilabel
0/1 flags (one sigmoid per class), ``mse`` / ``huber`` regression values. A
``package.module:Callable`` returns a loss module called as ``loss(outputs, targets)``
that returns the batch-mean loss; :func:`loss_issue` runs it once on the meta device, as
the shape preflight does for models, so a broken loss fails before Ray starts.

Targets are shaped by kind: class ``(B,)`` int64, multilabel ``(B, K)`` float32,
regression ``(B, dim)`` float32; outputs are always ``(B, out_width)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from cascade_ray.config.schema import LossConfig
from cascade_ray.config.trust import import_refusal, trust_fix
from cascade_ray.models.meta import meta_device
from cascade_ray.models.registry import ModelSpecError, _import_callable
from cascade_ray.text import did_you_mean

# builtin loss -> the target kind it fits
BUILTIN_LOSSES = {"cross_entropy": "class", "bce": "multilabel", "mse": "regression", "huber": "regression"}
DEFAULT_LOSS = {"class": "cross_entropy", "multilabel": "bce", "regression": "mse"}


def loss_type(cfg: LossConfig, kind: str) -> str:
    """``loss.type`` with ``auto`` resolved for the target kind."""
    return DEFAULT_LOSS[kind] if cfg.type == "auto" else cfg.type


def build_loss(cfg: LossConfig, kind: str, *, training: bool = True, trusted: Sequence[str] = ()) -> nn.Module:
    """The loss module of a stage on targets of `kind`; `training` False leaves out label smoothing (evaluation).

    ``trusted`` is the config's ``trusted_modules``: packages a ``package.module:Callable`` may come from.

    Raises:
        ModelSpecError: a ``package.module:Callable`` is refused by the trust rule (nothing
            imported), cannot be imported or returns no module.
    """
    cfg = cfg.model_copy(update={"type": loss_type(cfg, kind)})
    if cfg.type == "cross_entropy":
        return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing if training else 0.0)
    if cfg.type == "bce":
        return nn.BCEWithLogitsLoss()
    if cfg.type == "mse":
        return nn.MSELoss()
    if cfg.type == "huber":
        return nn.HuberLoss(delta=cfg.huber_delta)
    factory = _import_callable(cfg.type, trusted)
    try:
        loss = factory()
    except Exception as exc:  # user code fails in its own words
        raise ModelSpecError(f"loss type {cfg.type!r}: calling it failed: {type(exc).__name__}: {exc}") from exc
    if not callable(loss):
        raise ModelSpecError(f"loss type {cfg.type!r} returned a {type(loss).__name__}, not a callable loss module")
    return loss


def _fitting(kind: str) -> str:
    return " or ".join(name for name, fits in BUILTIN_LOSSES.items() if fits == kind)


def example_targets(kind: str, batch: int, width: int, device: str | torch.device = "meta") -> torch.Tensor:
    """A target batch of `kind` for outputs of `width` (what the data loader produces)."""
    if kind == "class":
        return torch.zeros(batch, dtype=torch.long, device=device)
    return torch.zeros(batch, width, dtype=torch.float32, device=device)


def loss_spec_issue(cfg: LossConfig, kind: str, trusted: Sequence[str] = ()) -> tuple[str, str, str | None] | None:
    """The problem with loss `cfg` on targets of `kind` seen from the config alone, or None.

    ``(key, message, fix)``, keys relative to the stage (``loss.type``,
    ``loss.label_smoothing``); the message names ``data.target.kind`` when the two do not
    fit. Nothing is imported or run: an untrusted ``loss.type`` is refused from its string.
    """
    cfg = cfg.model_copy(update={"type": loss_type(cfg, kind)})
    fits = BUILTIN_LOSSES.get(cfg.type)
    if fits is not None and fits != kind:
        return (
            "loss.type",
            f"{cfg.type!r} is a loss for {fits} targets, but data.target.kind is {kind!r}",
            f"use loss.type: {_fitting(kind)} (or auto) for {kind} targets, or fix data.target.kind",
        )
    if cfg.label_smoothing and cfg.type != "cross_entropy":
        return "loss.label_smoothing", f"only applies to cross_entropy (loss.type is {cfg.type!r})", "remove it"
    if fits is not None:
        return None
    if ":" not in cfg.type:
        valid = ", ".join(BUILTIN_LOSSES)
        hint = did_you_mean(cfg.type, list(BUILTIN_LOSSES))
        return "loss.type", f"unknown loss {cfg.type!r}{hint} (valid: {valid}, or package.module:Callable)", None
    refusal = import_refusal(cfg.type, trusted)
    if refusal is not None:  # decided before anything is imported
        return "loss.type", refusal, trust_fix(cfg.type)
    return None


def loss_issue(
    cfg: LossConfig, kind: str, out_width: int, trusted: Sequence[str] = ()
) -> tuple[str, str, str | None] | None:
    """:func:`loss_spec_issue`, then a ``package.module:Callable`` loss run once on meta outputs of `out_width`."""
    problem = loss_spec_issue(cfg, kind, trusted)
    cfg = cfg.model_copy(update={"type": loss_type(cfg, kind)})
    if problem is not None or cfg.type in BUILTIN_LOSSES:
        return problem
    try:
        loss = build_loss(cfg, kind, trusted=trusted)
        with meta_device():
            out = loss(torch.empty(2, out_width), example_targets(kind, 2, out_width))
    except Exception as exc:  # noqa: BLE001 - user losses fail in their own words
        return "loss.type", f"{cfg.type!r} fails on (B, {out_width}) outputs and {kind} targets: {exc}", None
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return "loss.type", f"{cfg.type!r} returns {got}, not a scalar tensor", "reduce the loss to its batch mean"
    return None
