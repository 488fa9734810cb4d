"""Which parts of the cascade a stage trains, and proof that the rest did not move.

"Frozen" here means four things at once: ``requires_grad=False``, eval mode (so
BatchNorm running statistics and dropout are fixed), not in the optimizer, and left out of
DDP's parameter and buffer broadcasts (frozen upstream tensors are read-only views of the
object store's shared arrays: ``models.weights.share_numpy_state``). A
sha256 digest of every frozen parameter *and buffer* after every epoch is compared with the one
before training (for the entries that view the upstream hand-off, the hand-off's own verified
digests: :func:`frozen_digest`); any difference is a :class:`FrozenDriftError`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cascade_ray.config.schema import PipelineConfig
from cascade_ray.errors import FrozenDriftError
from cascade_ray.models.cascade import CascadeModel
from cascade_ray.models.registry import module_layers
from cascade_ray.models.weights import SHARED_KEYS_ATTR, state_digests

# digests by the memory a tensor views, each with that tensor (frozen_digest's `memo`)
DigestMemo = MutableMapping[tuple, tuple[torch.Tensor, str]]


@dataclass(frozen=True)
class TrainablePlan:
    """What a stage trains: modules by qualified name, and the frozen state-dict keys."""

    trainable_modules: tuple[str, ...]
    frozen_modules: tuple[str, ...]
    frozen_keys: tuple[str, ...]


def _owned(model: CascadeModel, stage: str) -> list[tuple[str, nn.Module]]:
    """A stage's own parts: adapter, module layers in order, head."""
    parts: list[tuple[str, nn.Module]] = []
    if stage in model.adapters:
        parts.append((f"adapters.{stage}", model.adapters[stage]))
    block = model.blocks[stage]
    names = {id(m): n for n, m in block.named_modules()}
    for layer in module_layers(block):
        suffix = names.get(id(layer), "")
        parts.append((f"blocks.{stage}.{suffix}".rstrip("."), layer))
    parts.append((f"heads.{stage}", model.heads[stage]))
    return parts


def plan_trainable(model: CascadeModel, cfg: PipelineConfig, index: int) -> TrainablePlan:
    """Decide what stage `index` trains.

    A module stage trains its own adapter, module and head; a joint stage trains the
    parts named in ``trainable_layers``. In both, ``trainable_layers[s] = N`` unfreezes
    the last N layers of upstream stage `s` (-1: all) and, in a joint stage, `s`'s head,
    whose loss term it trains on.
    """
    stage = cfg.stages[index]
    trainable: list[str] = []
    frozen: list[str] = []
    for name in model.order:
        parts = _owned(model, name)
        if name == stage.name:
            trainable += [n for n, _ in parts]
            continue
        n_layers = stage.trainable_layers.get(name, 0)
        layers = [p for p in parts if p[0].startswith("blocks.")]
        count = len(layers) if n_layers == -1 else min(n_layers, len(layers))
        opened = {n for n, _ in layers[len(layers) - count :]} if count else set()
        if count and stage.type == "joint":
            opened.add(f"heads.{name}")
        if not opened:
            # wholly frozen: pin the stage module itself too, so a container whose own
            # forward reads self.training (e.g. stochastic depth) also stays in eval mode
            parts = [p for p in parts if not p[0].startswith("blocks.")] + [(f"blocks.{name}", model.blocks[name])]
        trainable += [n for n, _ in parts if n in opened]
        frozen += [n for n, _ in parts if n not in opened]
    keys = [k for k in model.state_dict() if any(k.startswith(f + ".") for f in frozen)]
    return TrainablePlan(tuple(trainable), tuple(frozen), tuple(keys))


def apply_freeze(model: CascadeModel, plan: TrainablePlan) -> None:
    """Set requires_grad and pin frozen modules to eval mode, per `plan`."""
    modules = dict(model.named_modules())
    for name in plan.frozen_modules:
        modules[name].requires_grad_(False)
    for name in plan.trainable_modules:
        modules[name].requires_grad_(True)
    model.set_frozen_modules([modules[n] for n in plan.frozen_modules])
    # DDP broadcasts every parameter and buffer from rank 0 when it wraps the model, and the
    # buffers again before every training forward: in place, so into frozen tensors shared
    # with the object store (share_numpy_state). Every rank's frozen state is the same hand-off
    # (or the same seeded init), so leaving it out changes nothing but the writes.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(plan.frozen_keys))


def frozen_digest(
    model: nn.Module,
    plan: TrainablePlan,
    known: Mapping[str, str] | None = None,
    memo: DigestMemo | None = None,
) -> dict[str, str]:
    """Digests of every frozen parameter and buffer, sorted by key.

    `known`: the upstream's tensor digests as the driver's hand-off carries them (its verified
    artifact manifest's). An entry the model shares with the hand-off (a view of its array:
    ``models.weights.share_numpy_state``) has exactly those bytes, so its digest is taken from
    `known` instead of hashing it again; entries the model holds a copy of are hashed.

    `memo`: digests of the tensors hashed by earlier calls in the same pass, by the memory they
    view. Models that view the same arrays (a batched sweep's replicas all hold the first one's
    frozen tensors: on the CPU one hand-off, on a GPU one device copy) then hash them once per
    pass. The memo holds each tensor it names, so no other tensor can take its memory during the
    pass. Valid only while nothing writes in between: one check's pass.
    """
    state = model.state_dict()
    shared = getattr(model, SHARED_KEYS_ATTR, frozenset())
    out = {k: known[k] for k in plan.frozen_keys if k in shared and k in known} if known else {}
    ids = {k: _identity(state[k]) for k in plan.frozen_keys if k not in out} if memo is not None else {}
    if memo is not None:
        out |= {k: memo[i][1] for k, i in ids.items() if i in memo}
    hashed = state_digests(state, [k for k in plan.frozen_keys if k not in out])
    if memo is not None:
        memo.update({ids[k]: (state[k], d) for k, d in hashed.items()})
    return dict(sorted((out | hashed).items()))


def _identity(tensor: torch.Tensor) -> tuple:
    """The bytes a tensor views, as long as nothing writes them: where, as what, and how laid out."""
    return (str(tensor.device), tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


def check_frozen(before: dict[str, str], after: dict[str, str], stage: str) -> None:
    """Raise when any frozen tensor changed between two digests."""
    changed = sorted(k for k in before if after.get(k) != before[k])
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise FrozenDriftError(
            f"stage {stage!r}: {len(changed)} frozen tensor(s) changed since the stage was handed them: {shown}. "
            "Frozen parameters and buffers must be bit-identical; a module's forward that updates "
            "state in eval mode, or a custom module that ignores eval(), does this. To train "
            f"them on purpose, list their stage in stages[...].trainable_layers."
        )
