"""Strict config: key paths, did-you-mean, every problem in one error, YAML 1.2 numbers."""

from __future__ import annotations

import copy

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config, validate_config
from cascade_ray.cli import main as cli_main
from cascade_ray.config.yaml_io import parse_yaml
from cascade_ray.errors import ConfigError


def issues_of(raw) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return {issue.path: issue.render() for issue in info.value.issues}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.stages and len({s.name for s in cfg.stages}) == len(cfg.stages)


def test_exponent_without_dot_is_a_float():
    assert parse_yaml("lr: 1e-3") == {"lr": 0.001}
    assert parse_yaml("lr: 3E-4\nn: 5") == {"lr": 0.0003, "n": 5}


def test_every_key_problem_in_one_error_and_the_shapes_once_the_rest_is_right(debug_raw):
    raw = copy.deepcopy(debug_raw)
    raw["stages"][0]["solver"]["type"] = "Adamw"
    raw["stages"][0]["solver"]["betas"] = "0.9, 0.999"
    raw["stages"][1]["trian"] = {"epochs": 1}
    raw["stages"][1]["model"]["in_channels"] = 32  # features outputs 16 channels
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    found = {issue.path: issue.render() for issue in info.value.issues}
    # the schema pass refused two keys: the cross-field rules still run, the shape preflight
    # (torch's meta device, ~1.5 s more) waits until those keys are fixed, and the error says so
    assert set(found) == {"stages[0].solver.type", "stages[0].solver.betas", "stages[1].trian"}
    assert "did you mean 'AdamW'?" in found["stages[0].solver.type"]
    assert "got str '0.9, 0.999'" in found["stages[0].solver.betas"]
    assert "betas: [0.9, 0.999]" in found["stages[0].solver.betas"]
    assert "did you mean 'train'?" in found["stages[1].trian"]
    assert "shapes of the chain are checked once the problems above are fixed" in str(info.value)

    raw["stages"][0]["solver"]["betas"] = [0.9, 0.999]
    del raw["stages"][1]["trian"]
    with pytest.raises(ConfigError) as info:  # the cross-field mistake alone: the shapes still wait
        validate_config(raw)
    assert [i.path for i in info.value.issues] == ["stages[0].solver.type"] and info.value.note
    raw["stages"][0]["solver"]["type"] = "AdamW"
    found = issues_of(raw)  # every other key right: the shape preflight speaks
    assert set(found) == {"stages[1].model.in_channels"}
    mismatch = found["stages[1].model.in_channels"]
    assert "'encoder'" in mismatch and "'features'" in mismatch and "(B, 16, 4, 4)" in mismatch
    assert "in_channels: 16" in mismatch and "adapter" in mismatch


@pytest.mark.parametrize(
    ("mutate", "path", "text"),
    [
        (lambda r: r["stages"][0]["solver"].update(type="adam"), "stages[0].solver.type", "did you mean 'Adam'"),
        (
            lambda r: r["stages"][0]["solver"].update(type="SGD", betas=[0.9, 0.99]),
            "stages[0].solver.betas",
            "SGD takes no 'betas'",
        ),
        (
            lambda r: r["stages"][0]["solver"].update(momentum=0.9),
            "stages[0].solver.momentum",
            "AdamW takes no 'momentum'",
        ),
        (lambda r: r["stages"][0]["solver"].update(lr="1e-3"), "stages[0].solver.lr", "unquoted"),
        (lambda r: r["stages"][0]["train"].update(epochs=True), "stages[0].train.epochs", "valid integer"),
        (lambda r: r["stages"][0]["model"].update(type="resnt"), "stages[0].model.type", "did you mean 'resnet'"),
        (lambda r: r["stages"][0]["model"].update(widht=[8]), "stages[0].model", "did you mean 'widths'"),
        (  # Ray Train's name for it
            lambda r: r["stages"][0]["train"].update(checkpoint={"num_to_keep": 2}),
            "stages[0].train.checkpoint.num_to_keep",
            "did you mean 'top_k'? (cascade-ray's name for it)",
        ),
        (lambda r: r["stages"][2].update(name="encoder"), "stages[2].name", "duplicate stage name 'encoder'"),
        (lambda r: r["data"].update(source="mnist"), "data.source", "valid: digits, fashion_mnist, parquet"),
        (lambda r: r["data"].update(val_fraction=1.5), "data.val_fraction", "less than 1"),
        (
            lambda r: r["stages"][1].update(trainable_layers={"featurs": 1}),
            "stages[1].trainable_layers.featurs",
            "did you mean 'features'",
        ),
        (
            lambda r: r["stages"][0].update(pretrained="/nonexistent/w.safetensors"),
            "stages[0].pretrained",
            "does not exist",
        ),
        (
            lambda r: (
                r["stages"][0]["scaling"].update(num_workers=0)
                if "scaling" in r["stages"][0]
                else r["stages"][0].update(scaling={"num_workers": 0})
            ),
            "stages[0].scaling.num_workers",
            "greater than or equal to 1",
        ),
    ],
)
def test_single_problem_names_key_and_fix(debug_raw, mutate, path, text):
    mutate(debug_raw)
    found = issues_of(debug_raw)
    assert path in found, found
    assert text in found[path]


def test_joint_stage_rules(debug_raw):
    debug_raw["stages"].insert(0, {"name": "j0", "type": "joint"})
    debug_raw["stages"][1]["loss"] = {"weighting": "uncertainty"}
    found = issues_of(debug_raw)
    assert "stages[0].type" in found and "stages[1].loss.weighting" in found


def test_overrides_are_validated_like_file_values(tmp_path):
    cfg = load_config(CONFIGS / "debug.yaml", ["stages.encoder.solver.lr=1e-4", "stages[0].train.epochs=3"])
    assert cfg.stages[1].solver.lr == pytest.approx(1e-4)
    assert cfg.stages[0].train.epochs == 3
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "debug.yaml", ["stages[0].solver.typ=SGD", "stages.nope.train.epochs=1", "garbage"])
    paths = {i.path for i in info.value.issues}
    assert paths == {"stages[0].solver.typ", "stages.nope.train.epochs", "garbage"}


def test_cli_validate_exit_codes(tmp_path, capsys):
    assert cli_main(["validate", str(CONFIGS / "debug.yaml")]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "debug.yaml").read_text().replace("type: AdamW", "type: Adamw"))
    assert cli_main(["validate", str(bad)]) == 2
    assert "did you mean 'AdamW'" in capsys.readouterr().err


def test_config_error_pickles():
    import pickle

    err = ConfigError([], "x.yaml")
    with pytest.raises(ConfigError):
        validate_config({"name": "x", "stages": []})
    assert pickle.loads(pickle.dumps(err)).source == "x.yaml"
