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


def _read_only(module: torch.nn.Module, fill: float = 2) -> dict[str, np.ndarray]:
    state = {k: np.full(v.shape, fill, v.detach().numpy().dtype) for k, v in module.state_dict().items()}
    for array in state.values():
        array.setflags(write=False)
    return state


def test_share_leaves_out_keys_whose_dtype_or_shape_differs_for_the_caller_to_copy():
    model = torch.nn.Sequential(_Renamed(), torch.nn.BatchNorm1d(2))
    state = _read_only(model)
    state["1.weight"] = np.zeros(3, np.float32)  # shape differs
    state["1.running_mean"] = np.zeros(2, np.float64)  # dtype differs (a copy would cast)
    state["0.w"] = np.zeros((2, 3), np.float16)  # not an attribute path, dtype differs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shared = share_numpy_state(model, state, list(state))
    assert set(shared) == set(state) - {"1.weight", "1.running_mean", "0.w"}
    after = model.state_dict()
    for key in ("1.weight", "1.running_mean", "0.w"):
        assert torch.equal(after[key], before[key]), key
        assert not np.shares_memory(after[key].numpy(), state[key]), key


class _Watched(torch.nn.Linear):
    """A module with its own ``__setattr__``: share must go through it."""

    def __init__(self):
        super().__init__(3, 2)
        self.seen: list[str] = []

    def __setattr__(self, name, value):
        seen = self.__dict__.get("seen")
        if seen is not None:
            seen.append(name)
        super().__setattr__(name, value)


def test_share_goes_through_a_modules_own_setattr_and_the_global_registration_hooks():
    model = torch.nn.Sequential(_Watched(), torch.nn.BatchNorm1d(2))
    state = _read_only(model)
    registered: list[tuple[str, str]] = []
    handles = [
        torch.nn.modules.module.register_module_parameter_registration_hook(
            lambda module, name, param: registered.append(("param", name))
        ),
        torch.nn.modules.module.register_module_buffer_registration_hook(
            lambda module, name, buffer: registered.append(("buffer", name))
        ),
    ]
    try:
        shared = share_numpy_state(model, state, list(state))
    finally:
        for handle in handles:
            handle.remove()
    assert shared == sorted(state)
    assert sorted(model[0].seen) == ["bias", "weight"]
    assert sorted(registered) == sorted(
        [("param", "weight"), ("param", "bias")] * 2
        + [("buffer", "running_mean"), ("buffer", "running_var"), ("buffer", "num_batches_tracked")]
    )
    for key, tensor in model.state_dict().items():
        assert np.shares_memory(tensor.numpy(), state[key]), key
    # without hooks, a plain module's entries are replaced in place: still views, still Parameters
    plain = torch.nn.BatchNorm1d(2)
    state = _read_only(plain, fill=3)
    assert share_numpy_state(plain, state, list(state)) == sorted(state)
    assert isinstance(plain.weight, torch.nn.Parameter) and plain.weight.requires_grad
    assert "running_var" in plain._buffers and float(plain.running_var[0]) == 3
    for key, tensor in plain.state_dict().items():
        assert np.shares_memory(tensor.numpy(), state[key]), key


def _device_copies(monkeypatch):
    """Stand in for a GPU on the CPU: every model setup_stage builds holds copies of all its tensors, as
    ``model.to("cuda")`` leaves it (its frozen upstream still marked as the hand-off's bytes)."""
    import cascade_ray.stage.setup as setup

    real = setup.build_stage_model

    def copied(*args, **kwargs):
        model, plan = real(*args, **kwargs)
        model._apply(lambda t: t.clone())
        return model, plan

    monkeypatch.setattr(setup, "build_stage_model", copied)


def test_a_model_set_up_with_anothers_frozen_tensors_holds_them_not_copies(digits, upstream, monkeypatch):
    """setup_stage(frozen=): the frozen upstream entries are the given model's memory (no copy of their
    own, whatever the device made of the hand-off), as their own Parameters; what the stage trains is its own."""
    from cascade_ray.models.weights import frozen_views
    from cascade_ray.stage.setup import setup_stage

    _device_copies(monkeypatch)
    cfg = load_config(CONFIGS / "debug.yaml")
    first = setup_stage(cfg, 1, digits, upstream, torch.device("cpu"))
    views = frozen_views(first.model)
    assert set(first.plan.frozen_keys) <= set(views)
    alone = setup_stage(cfg, 1, digits, upstream, torch.device("cpu"))
    second = setup_stage(cfg, 1, digits, upstream, torch.device("cpu"), frozen=views)
    mine, theirs, apart = (s.model.state_dict(keep_vars=True) for s in (second, first, alone))
    for key in first.plan.frozen_keys:
        assert mine[key].data_ptr() == theirs[key].data_ptr() != apart[key].data_ptr(), key
        assert mine[key] is not theirs[key] and not mine[key].requires_grad, key
        assert torch.equal(mine[key], apart[key]), key
    trained = [k for k in mine if k.startswith("blocks.encoder.")]
    assert trained and all(mine[k].data_ptr() != theirs[k].data_ptr() for k in trained)
    assert frozen_digest(second.model, second.plan) == frozen_digest(alone.model, alone.plan)


def test_a_batched_sweeps_replicas_hold_one_copy_of_the_frozen_upstream(digits, monkeypatch):
    """On a GPU each replica's model.to(device) copied the frozen upstream: K device copies. Now every
    replica holds the first one's (the stand-in copies every model's tensors as the device would)."""
    from fakes import ListReporter

    from cascade_ray.pipeline.features import upstream_outputs
    from cascade_ray.stage.batched import train_replicas
    from cascade_ray.tune.sweep import trial_config

    cfg = load_config(CONFIGS / "debug.yaml")
    model, _ = build_stage_model(cfg, 1, digits, None)
    hand_off = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = upstream_outputs(cfg, 2, digits, hand_off)
    features = {"x_train": out["train"], "x_val": out["val"]}
    cfgs = [trial_config(cfg, "classifier", {"solver.lr": lr}) for lr in (0.01, 0.02, 0.05)]
    _device_copies(monkeypatch)
    replicas = train_replicas(
        cfgs, 2, digits, hand_off, features, ListReporter(), torch.device("cpu"), metric="val_accuracy", mode="max"
    )
    assert all(r.error is None for r in replicas)
    frozen = replicas[0].setup.plan.frozen_keys
    held = [r.setup.model.state_dict() for r in replicas]
    assert frozen and all(len({h[k].data_ptr() for h in held}) == 1 for k in frozen)
