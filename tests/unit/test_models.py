"""Unit tests for cascade_ray.models: shapes, meta-device preflight, layer coverage, registry errors."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from cascade_ray.models import (
    BUILTIN_MODELS,
    ModelSpecError,
    build_module,
    check_kwargs,
    mlp,
    module_in_width,
    module_layers,
    resnet,
    resolve_factory,
    tensor_width,
    transformer,
)

CONFIGS = [
    ("resnet", {}),
    ("resnet", {"widths": [8, 16, 32], "blocks": [2, 1, 1]}),
    ("resnet", {"widths": (8, 16), "blocks": (1, 2), "block": "bottleneck", "stem_channels": 4}),
    ("resnet", {"in_channels": 3, "widths": [8], "blocks": [1], "stem": "imagenet"}),
    ("transformer", {"in_channels": 1}),
    ("transformer", {"in_channels": 1, "d_model": 32, "depth": 3, "heads": 2, "mlp_ratio": 1.5, "dropout": 0.1}),
    ("mlp", {"in_features": 1}),
    ("mlp", {"in_features": 1, "hidden": [32, 16, 10], "activation": "relu", "dropout": 0.2}),
    ("mlp", {"in_features": 784, "hidden": [10], "pool": "flatten"}),
]


def _input_for(name: str, kwargs: dict, side: int) -> torch.Tensor:
    channels = kwargs.get("in_channels", 1)
    if name == "transformer":
        side = min(side, 8)  # 28*28 tokens exceeds the default max_tokens=256
    if kwargs.get("pool") == "flatten":
        return torch.randn(2, 1, 28, 28)
    return torch.randn(2, channels, side, side)


@pytest.mark.parametrize("side", [28, 8])
def test_resnet_shapes(side: int) -> None:
    small = resnet(widths=[32, 64], blocks=[1, 1])
    assert small(torch.randn(2, 1, side, side)).shape == (2, 64, side // 2, side // 2)
    three = resnet(widths=[8, 16, 32], blocks=[1, 1, 1])
    assert three(torch.randn(2, 1, side, side)).shape == (2, 32, (side + 3) // 4, (side + 3) // 4)
    assert small.in_width == 1 and small.out_channels == 64


def test_resnet_bottleneck_and_imagenet_stem() -> None:
    net = resnet(widths=[8, 16], blocks=[1, 1], block="bottleneck")
    assert net.out_channels == 16 * 4
    assert net(torch.randn(2, 1, 28, 28)).shape == (2, 64, 14, 14)
    big = resnet(in_channels=3, widths=[8], blocks=[1], stem="imagenet")
    assert big(torch.randn(2, 3, 64, 64)).shape == (2, 8, 16, 16)


@pytest.mark.parametrize("side", [28, 8])
def test_transformer_and_mlp_shapes(side: int) -> None:
    tok = transformer(in_channels=1, d_model=32, max_tokens=784)
    assert tok(torch.randn(2, 1, side, side)).shape == (2, side * side, 32)
    assert tok(torch.randn(2, 5, 1)).shape == (2, 5, 32)
    head = mlp(in_features=1, hidden=[16, 10])
    assert head(torch.randn(2, 1, side, side)).shape == (2, 10)
    flat = mlp(in_features=side * side, hidden=[10], pool="flatten")
    assert flat(torch.randn(2, 1, side, side)).shape == (2, 10)
    per_token = mlp(in_features=4, hidden=[3], pool="none")
    assert per_token(torch.randn(2, 7, 4)).shape == (2, 7, 3)


@pytest.mark.parametrize("side", [28, 8])
def test_chain_resnet_transformer_mlp(side: int) -> None:
    backbone = resnet(widths=[16, 32], blocks=[1, 1])
    x = torch.randn(2, 1, side, side)
    feats = backbone(x)
    enc = transformer(in_channels=tensor_width(feats.shape), d_model=32)
    tokens = enc(feats)
    assert tokens.shape == (2, (side // 2) ** 2, 32)
    head = mlp(in_features=tensor_width(tokens.shape), hidden=[10])
    assert head(tokens).shape == (2, 10)
    for stage, shape in [(enc, feats.shape), (head, tokens.shape)]:
        assert module_in_width(stage) == tensor_width(shape)


@pytest.mark.parametrize("name,kwargs", CONFIGS)
def test_cascade_layers_cover_every_parameter_once(name: str, kwargs: dict) -> None:
    module = build_module(name, kwargs)
    seen: dict[int, int] = {}
    for layer in module_layers(module):
        for p in layer.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    assert seen, "module has no parameters"
    assert {id(p) for p in module.parameters()} == set(seen)
    assert all(count == 1 for count in seen.values())


@pytest.mark.parametrize("name,kwargs", CONFIGS)
@pytest.mark.parametrize("train", [True, False])
def test_meta_device_build_and_forward(name: str, kwargs: dict, train: bool) -> None:
    real = build_module(name, kwargs).train(train)
    x = _input_for(name, kwargs, 28)
    with torch.no_grad():
        expected = real(x).shape
    with torch.device("meta"):
        module = build_module(name, kwargs)
        meta_x = torch.empty(x.shape)
    module.train(train)
    assert all(p.is_meta for p in module.parameters())
    out = module(meta_x)
    if not train:
        with torch.no_grad():  # eval + no_grad is where the attention fast path could kick in
            out = module(meta_x)
    assert out.is_meta and out.shape == expected


@pytest.mark.parametrize("name,kwargs", CONFIGS)
def test_deterministic_under_manual_seed(name: str, kwargs: dict) -> None:
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        module = build_module(name, kwargs).eval()
        outs.append((module.state_dict(), module(_input_for(name, kwargs, 8))))
    (sd_a, out_a), (sd_b, out_b) = outs
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert torch.equal(out_a, out_b)


@pytest.mark.parametrize(
    "factory,kwargs,match",
    [
        (resnet, {"widths": [8, 16], "blocks": [1, 1, 1]}, "widths and blocks must have the same length, got 2 and 3"),
        (resnet, {"block": "basik"}, "did you mean 'basic'"),
        (resnet, {"stem": "imagnet"}, "did you mean 'imagenet'"),
        (resnet, {"widths": [8, 0], "blocks": [1, 1]}, r"widths\[1\] must be a positive integer"),
        (transformer, {"in_channels": 4, "d_model": 30, "heads": 4}, "d_model .30. must be divisible by heads .4."),
        (mlp, {"in_features": 4, "activation": "rleu"}, "did you mean 'relu'"),
        (mlp, {"in_features": 4, "pool": "mena"}, "did you mean 'mean'"),
        (mlp, {"in_features": 4, "hidden": []}, "hidden must be a non-empty list"),
    ],
)
def test_factory_validation(factory, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


def test_forward_shape_errors() -> None:
    with pytest.raises(ValueError, match="raise max_tokens to at least 784"):
        transformer(in_channels=1)(torch.randn(1, 1, 28, 28))
    with pytest.raises(ValueError, match="in_channels=3"):
        transformer(in_channels=3)(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="set in_features to 784"):
        mlp(in_features=1, pool="flatten")(torch.randn(1, 1, 28, 28))
    with pytest.raises(ValueError, match="set in_channels"):
        resnet(in_channels=3)(torch.randn(1, 1, 8, 8))


def test_resolve_factory_builtin_and_import_path() -> None:
    assert resolve_factory("resnet") is resnet
    assert set(BUILTIN_MODELS) == {"resnet", "transformer", "mlp"}
    linear = build_module("torch.nn:Linear", {"in_features": 3, "out_features": 2}, ["torch"])
    assert isinstance(linear, nn.Linear)
    assert module_layers(linear) == [linear]
    assert module_in_width(linear) is None
    seq = build_module("torch.nn:Sequential", {}, ["torch.nn"])
    assert module_layers(seq) == [seq]


@pytest.mark.parametrize(
    "type_name,match",
    [
        (
            "resnt",
            r"unknown model type 'resnt'; did you mean 'resnet'\? \(builtins: mlp, resnet, transformer; "
            r"or 'package.module:Callable'\)",
        ),
        ("models/my_net.py", "unknown model type 'models/my_net.py' .builtins"),
        ("mypkg.stages.patchify", r"did you mean 'mypkg.stages:patchify'\? \(a colon before the factory's name\)"),
        ("no_such_pkg_xyz.mod:Net", "cannot import module 'no_such_pkg_xyz.mod': ModuleNotFoundError"),
        ("torch.nn:Linearr", r"'torch.nn' has no attribute 'Linearr'; did you mean 'Linear'\?"),
        ("torch:pi", "'pi' is a float, not a callable"),
        ("math:pi", "the Python standard library is never importable from a config"),
        ("mypkg:Net", "module 'mypkg' is not trusted"),
        ("torch.nn:", "must look like 'package.module:Callable'"),
    ],
)
def test_resolve_factory_errors(type_name: str, match: str) -> None:
    with pytest.raises(ModelSpecError, match=match) as info:
        resolve_factory(type_name, ["torch", "no_such_pkg_xyz"])
    assert isinstance(info.value, ValueError)
    again = pickle.loads(pickle.dumps(info.value))  # raised in Ray workers, re-raised in the driver
    assert type(again) is ModelSpecError and str(again) == str(info.value)


def test_check_kwargs() -> None:
    assert check_kwargs(resnet, {"widths": [8], "blocks": [1]}) == []
    (msg,) = check_kwargs(resnet, {"widht": [8]})
    assert msg.startswith("unknown argument 'widht' for model 'resnet'; did you mean 'widths'? (accepted: in_channels")
    assert check_kwargs(transformer, {}) == ["missing required argument 'in_channels' for model 'transformer'"]
    assert check_kwargs(lambda **kw: nn.Identity(), {"anything": 1}) == []
    with pytest.raises(ModelSpecError, match="did you mean 'hidden'"):
        build_module("mlp", {"in_features": 4, "hiden": [3]})
    with pytest.raises(ModelSpecError, match="widths and blocks must have the same length"):
        build_module("resnet", {"widths": [8], "blocks": [1, 1]})
    with pytest.raises(ModelSpecError, match="returned int, not an nn.Module"):
        build_module("torch.nn.init:calculate_gain", {"nonlinearity": "linear"}, ["torch"])
    with pytest.raises(ModelSpecError, match="model 'torch.nn:Dropout': ValueError: dropout probability"):
        build_module("torch.nn:Dropout", {"p": 2.0}, ["torch"])


def test_tensor_width() -> None:
    assert tensor_width((2, 3, 8, 8)) == 3
    assert tensor_width(torch.Size([2, 5, 7])) == 7
    assert tensor_width([2, 9]) == 9
    with pytest.raises(ValueError, match="2-D, 3-D or 4-D"):
        tensor_width((2,))


def test_a_package_in_the_current_folder_that_the_command_cannot_import_gets_pythonpath_as_the_fix(
    debug_raw, tmp_path, monkeypatch
):
    """A console script's sys.path holds its bin folder, not the current one: the guide's `mypkg/` beside the
    config failed with "No module named 'mypkg'" and a fix about spelling and working_dir."""
    import sys

    from cascade_ray.checks import validate_config
    from cascade_ray.errors import ConfigError

    (tmp_path / "cwdpkg_xyz").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    debug_raw["trusted_modules"] = ["cwdpkg_xyz"]
    debug_raw["stages"][0]["model"] = {"type": "cwdpkg_xyz.stages:net"}
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw)
    (issue,) = [i for i in info.value.issues if i.path == "stages[0].model.type"]
    assert "No module named 'cwdpkg_xyz'" in issue.message
    assert issue.fix.startswith("cwdpkg_xyz/ is in the current folder") and "PYTHONPATH=." in issue.fix
