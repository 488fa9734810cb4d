"""Frozen upstream weights are views of the hand-off's arrays (no copy), and behave as copies did."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.models.freeze import frozen_digest
from cascade_ray.models.weights import load_numpy_state, share_numpy_state, to_numpy_state
from cascade_ray.stage.setup import build_stage_model


@pytest.fixture(scope="module")
def upstream(digits):
    """Stage 0 of debug.yaml with non-trivial BatchNorm statistics, read-only as ``ray.get`` returns it."""
    cfg = load_config(CONFIGS / "debug.yaml")
    model, _ = build_stage_model(cfg, 0, digits, None)
    model.train()
    with torch.no_grad():
        model(torch.randn(16, 1, 8, 8), heads=["features"])
    state = to_numpy_state(model.state_dict())
    for array in state.values():
        array.setflags(write=False)
    return state


def _open_last_layer():
    return load_config(CONFIGS / "debug.yaml", ["stages[1].trainable_layers={features: 1}"])


def test_frozen_upstream_tensors_are_views_and_opened_layers_are_copies(digits, upstream):
    model, plan = build_stage_model(_open_last_layer(), 1, digits, upstream)
    state = model.state_dict()
    opened = {k for k in upstream if k in state and k not in plan.frozen_keys}
    assert plan.frozen_keys and opened, "the config must freeze some upstream tensors and open others"
    for key in plan.frozen_keys:
        assert np.shares_memory(state[key].numpy(), upstream[key]), key
    for key in opened:  # trained by this stage: its own copy, which the optimizer may write
        assert not np.shares_memory(state[key].numpy(), upstream[key]), key
    params = dict(model.named_parameters())
    shared_params = [k for k in plan.frozen_keys if k in params]
    assert shared_params and all(
        isinstance(params[k], torch.nn.Parameter) and not params[k].requires_grad for k in shared_params
    )
    with pytest.raises(ValueError, match="read-only"):  # the hand-off's arrays refuse numpy writes
        upstream[plan.frozen_keys[0]][...] = 0


def test_training_on_shared_views_is_bit_identical_to_the_copy_path(digits, upstream):
    cfg = _open_last_layer()
    shared, plan = build_stage_model(cfg, 1, digits, upstream)
    copied, _ = build_stage_model(cfg, 1, digits, None)  # the same seeded build, upstream copied in
    load_numpy_state(copied, {k: v for k, v in upstream.items() if k in copied.state_dict()}, strict=False)
    assert not any(np.shares_memory(copied.state_dict()[k].numpy(), upstream[k]) for k in plan.frozen_keys)
    before = frozen_digest(shared, plan)
    torch.manual_seed(1)
    batches = [(torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))) for _ in range(3)]
    for model in (shared, copied):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        model.train()
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, heads=["encoder"])["encoder"], y).backward()
            opt.step()
    a, b = to_numpy_state(shared.state_dict()), to_numpy_state(copied.state_dict())
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert frozen_digest(shared, plan) == before
    assert any(not np.array_equal(a[k], upstream[k]) for k in a if k in upstream), "the opened layer trained"


def test_loading_a_checkpoint_compares_shared_keys_instead_of_writing_them(digits, upstream):
    model, plan = build_stage_model(_open_last_layer(), 1, digits, upstream)
    checkpoint = {k: np.array(v) for k, v in to_numpy_state(model.state_dict()).items()}  # writable copies
    load_numpy_state(model, checkpoint)  # a resume: the same frozen bytes
    key = plan.frozen_keys[0]
    assert np.shares_memory(model.state_dict()[key].numpy(), upstream[key])
    checkpoint[key] = checkpoint[key] + 1
    with pytest.raises(RuntimeError, match=key.replace(".", r"\.")):
        load_numpy_state(model, checkpoint)


def test_ddp_leaves_frozen_state_out_of_its_broadcasts(digits, upstream, tmp_path):
    import torch.distributed as dist

    model, plan = build_stage_model(_open_last_layer(), 1, digits, upstream)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    finally:
        dist.destroy_process_group()
    assert set(ddp.parameters_to_ignore) == set(plan.frozen_keys)
    frozen = {id(t) for k, t in model.state_dict(keep_vars=True).items() if k in plan.frozen_keys}
    assert not any(id(b) in frozen for b in ddp.modules_buffers), "a frozen buffer would be broadcast each forward"
    assert any(True for _ in ddp.modules_buffers), "the opened layer's BatchNorm buffers are still synced"


def test_fsdp_shards_the_trainable_parts_and_leaves_the_frozen_upstream_shared(digits, upstream, tmp_path):
    """``scaling.strategy: fsdp``: the frozen upstream is no FSDP parameter (not a DTensor, still a
    view of the hand-off: one copy per node), while the stage's own parameters and the opened
    upstream layer are sharded."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from cascade_ray.stage.sharding import is_sharded, shard_trainable

    model, plan = build_stage_model(_open_last_layer(), 1, digits, upstream)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        units = shard_trainable(model, plan, torch.device("cpu"), 1)
        params = dict(model.named_parameters())
        frozen = [k for k in plan.frozen_keys if k in params]
        trainable = [k for k, p in params.items() if p.requires_grad]
        assert units >= 1 and is_sharded(model) and frozen and trainable
        for key in frozen:
            assert not isinstance(params[key], DTensor), key
            assert np.shares_memory(params[key].detach().numpy(), upstream[key]), key
        assert all(isinstance(params[k], DTensor) for k in trainable), trainable
        assert any(k.split(".")[1] == "features" for k in trainable), "the opened upstream layer trains sharded"
    finally:
        dist.destroy_process_group()


class _Renamed(torch.nn.Module):
    """A module whose state dict names its weight ``w`` (hooks both ways): not an attribute path."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

        def out(module, state, prefix, local_metadata):
            state[prefix + "w"] = state.pop(prefix + "inner.weight")

        def back(module, state, prefix, *args):
            if prefix + "w" in state:
                state[prefix + "inner.weight"] = state.pop(prefix + "w")

        self.register_state_dict_post_hook(out)
        self.register_load_state_dict_pre_hook(back)


def test_share_sets_parameters_and_buffers_by_attribute_and_hands_other_keys_to_load_state_dict():
    model = torch.nn.Sequential(_Renamed(), torch.nn.BatchNorm1d(2))
    model.requires_grad_(False)
    model[1].weight.requires_grad_(True)  # kept as it was, as load_state_dict(assign=True) keeps it
    state = {k: np.full(v.shape, 2, v.detach().numpy().dtype) for k, v in model.state_dict().items()}
    for array in state.values():
        array.setflags(write=False)
    assert "0.w" in state and "0.inner.weight" not in state
    shared = share_numpy_state(model, state, list(state))
    assert shared == sorted(state)
    after = model.state_dict(keep_vars=True)
    for key, array in state.items():
        assert np.shares_memory(after[key].detach().numpy(), array), key
    assert isinstance(model[0].inner.weight, torch.nn.Parameter) and not model[0].inner.weight.requires_grad
    assert isinstance(model[1].weight, torch.nn.Parameter) and model[1].weight.requires_grad
    assert not isinstance(model[1].running_mean, torch.nn.Parameter) and "running_mean" in model[1]._buffers
    assert model[0].count.dtype == torch.int64 and int(model[0].count) == 2
