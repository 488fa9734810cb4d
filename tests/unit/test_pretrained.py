"""stages[i].pretrained: key mapping, the checks before Ray, the fingerprint, import-only stages (no Ray)."""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from user_models import DigitNet, digit_features

from cascade_ray.checks import validate_config
from cascade_ray.config.schema import PretrainedConfig
from cascade_ray.errors import ConfigError
from cascade_ray.models.pretrained import load_pretrained, map_keys
from cascade_ray.pipeline.imported import import_stage
from cascade_ray.pipeline.stages import stage_fingerprint
from cascade_ray.solver import step_count_issues
from cascade_ray.tune.space import TuneSpace, space_issues

FEATURES = {"type": "user_models:digit_features", "width": 4}


def _net_file(tmp_path, name="net.safetensors", **kw) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    state = {k: v.contiguous() for k, v in DigitNet(width=4, **kw).state_dict().items()}
    path = tmp_path / name
    save_file(state, str(path))
    return str(path), state


def _raw(debug_raw, pretrained, epochs=0):
    """The debug config with stage 0 a digit_features backbone importing `pretrained`."""
    debug_raw["trusted_modules"] = ["user_models"]
    debug_raw["stages"][0].update(model=dict(FEATURES), pretrained=pretrained)
    debug_raw["stages"][0]["train"]["epochs"] = epochs
    del debug_raw["stages"][1:]
    debug_raw["stages"].append(
        {"name": "head", "model": {"type": "mlp", "in_features": 8, "hidden": [8]}, "train": {"epochs": 1}}
    )
    return debug_raw


def _issues(raw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    return [i.render() for i in info.value.issues]


def test_prefix_filters_and_strips_then_the_longest_rename_wins():
    cfg = PretrainedConfig(path="/x.pt", prefix="model.", rename={"": "net.", "fc.": "head."})
    mapping, collisions = map_keys(["model.fc.weight", "model.conv.weight", "other.bias"], cfg)
    assert mapping == {"head.weight": "model.fc.weight", "net.conv.weight": "model.conv.weight"}
    assert collisions == []
    _, collisions = map_keys(["a.w", "b.w"], PretrainedConfig(path="/x.pt", rename={"a.": "", "b.": ""}))
    assert collisions == ["'a.w' and 'b.w' both map to 'w'"]


def test_a_plain_path_is_a_pretrained_section(debug_raw, tmp_path):
    path, _ = _net_file(tmp_path)
    cfg = validate_config(_raw(debug_raw, {"path": path, "prefix": "features."}))
    assert cfg.stages[0].pretrained == PretrainedConfig(path=path, prefix="features.")
    assert PretrainedConfig.model_validate({"path": path}) == PretrainedConfig(path=path)


def test_a_whole_network_without_prefix_names_the_prefix_to_set(debug_raw, tmp_path):
    path, _ = _net_file(tmp_path)
    (text,) = _issues(_raw(debug_raw, path))
    assert text.startswith("stages[0].pretrained: state dict in")
    assert "does not match the module: no key in common" in text
    assert "fix: set prefix: 'features.' (9 of the module's 9 keys then match, now 0)" in text


def test_strict_false_ignores_missing_and_unexpected_keys_but_not_shapes(debug_raw, tmp_path):
    torch.manual_seed(1)
    part = {k: v for k, v in DigitNet(width=4).state_dict().items() if not k.startswith("features.3.")}
    path = tmp_path / "part.safetensors"
    save_file(part, str(path))
    (text,) = _issues(_raw(debug_raw, {"path": str(path), "prefix": "features."}))
    assert "missing 2 ('3.bias', '3.weight')" in text and "unexpected" not in text
    assert "stages[0].pretrained.strict: false to keep the fresh initialization of the missing keys" in text
    validate_config(_raw(debug_raw, {"path": str(path), "prefix": "features.", "strict": False}))
    module = digit_features(1, 4)
    before = module[3].weight.clone()
    notes = load_pretrained(module, PretrainedConfig(path=str(path), prefix="features.", strict=False), "k")
    assert torch.equal(module[0].weight, part["features.0.weight"]) and torch.equal(module[3].weight, before)
    assert "2 module key(s) keep their fresh initialization" in notes[0]
    wide, _ = _net_file(tmp_path, "wide.safetensors")
    raw = _raw(debug_raw, {"path": wide, "prefix": "features.", "strict": False})
    raw["stages"][0]["model"]["width"] = 5
    raw["stages"][1]["model"]["in_features"] = 10
    (text,) = _issues(raw)
    assert "wrong shape" in text and "'0.weight': file (4, 1, 3, 3), module (5, 1, 3, 3)" in text


def test_a_rename_that_maps_the_modules_own_keys_away_is_named_as_the_fix(debug_raw, tmp_path):
    """rename {'0.': 'conv0.'} made the file's '0.*' keys unexpected 'conv0.*' and left the module's '0.*'
    missing; the fix offered strict: false twice, which imports the rest and leaves that conv untrained."""
    path, _ = _net_file(tmp_path)
    (text,) = _issues(_raw(debug_raw, {"path": path, "prefix": "features.", "rename": {"0.": "conv0."}}))
    assert "missing 2 ('0.bias', '0.weight'), unexpected 2 ('conv0.bias', 'conv0.weight')" in text
    assert "fix: stages[0].pretrained.rename maps '0.' -> 'conv0.', but the module's keys are the ones before" in text
    assert text.count("strict: false") == 1, text


def test_a_prefix_no_key_has_is_an_error(debug_raw, tmp_path):
    path, _ = _net_file(tmp_path)
    (text,) = _issues(_raw(debug_raw, {"path": path, "prefix": "backbone."}))
    assert text.startswith("stages[0].pretrained.prefix: no key of") and "set prefix: 'features.'" in text


def test_half_precision_is_cast_with_a_note_and_integers_are_refused(tmp_path):
    torch.manual_seed(1)
    state = {k: v.half() if v.is_floating_point() else v for k, v in digit_features(1, 4).state_dict().items()}
    save_file(state, str(tmp_path / "half.safetensors"))
    module = digit_features(1, 4)
    notes = load_pretrained(module, PretrainedConfig(path=str(tmp_path / "half.safetensors")), "stages[0].pretrained")
    assert module[0].weight.dtype == torch.float32 and torch.equal(module[0].weight, state["0.weight"].float())
    assert notes == ["stages[0].pretrained: tensors cast to the module's dtype (torch.float16 -> torch.float32)"]
    state["0.weight"] = torch.ones(4, 1, 3, 3, dtype=torch.int8)
    save_file(state, str(tmp_path / "int.safetensors"))
    with pytest.raises(
        ConfigError, match=r"tensor '0.weight' .* is torch.int8, but the module's '0.weight' is torch.float32"
    ):
        load_pretrained(digit_features(1, 4), PretrainedConfig(path=str(tmp_path / "int.safetensors")), "k")


def test_nan_is_an_error_naming_the_key_at_validate_and_at_load(debug_raw, tmp_path):
    path, state = _net_file(tmp_path)
    state["features.3.bias"][1] = math.nan
    state["features.0.weight"][0, 0, 0, 0] = math.inf
    save_file(state, path)
    (text,) = _issues(_raw(debug_raw, {"path": path, "prefix": "features."}))
    assert "2 tensor(s) of" in text and "'0.weight', '3.bias'" in text and "NaN or Inf" in text
    with pytest.raises(ConfigError, match="NaN or Inf: '0.weight', '3.bias'"):
        load_pretrained(digit_features(1, 4), PretrainedConfig(path=path, prefix="features."), "k")


def test_a_fifo_or_a_directory_is_refused_without_opening_it(debug_raw, tmp_path):
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    found: list[list[str]] = []
    # opening a FIFO blocks until a writer appears: the check must only stat it
    worker = threading.Thread(target=lambda: found.append(_issues(_raw(debug_raw, str(fifo)))), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert found and found[0] == [
        f"stages[0].pretrained: {str(fifo)!r} is a FIFO\n    fix: point it at a state-dict file"
    ]
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        load_pretrained(digit_features(1, 4), PretrainedConfig(path=str(folder)), "k")


def test_changed_file_bytes_change_the_fingerprint(debug_raw, tmp_path):
    path, state = _net_file(tmp_path)
    cfg = validate_config(_raw(debug_raw, {"path": path, "prefix": "features."}))
    before = stage_fingerprint(cfg, 0, "", "d" * 64)
    assert stage_fingerprint(cfg, 0, "", "d" * 64) == before
    state["features.0.bias"][0] += 1.0
    save_file(state, path)
    assert stage_fingerprint(cfg, 0, "", "d" * 64) != before


def test_zero_epochs_needs_pretrained_weights_and_opens_nothing(debug_raw, tmp_path):
    debug_raw["stages"][0]["train"]["epochs"] = 0
    assert _issues(debug_raw) == [
        "stages[0].train.epochs: 0 epochs makes an import-only stage, but the stage has no pretrained weights to "
        "import\n    fix: set stages[0].pretrained to the state-dict file, or train at least one epoch (train.epochs: 1)"
    ]
    path, _ = _net_file(tmp_path)
    raw = _raw(debug_raw, {"path": path, "prefix": "features."})
    raw["stages"].insert(1, {**raw["stages"][0], "name": "second", "trainable_layers": {"features": -1}})
    assert any(t.startswith("stages[1].trainable_layers: an import-only stage") for t in _issues(raw))


def test_import_only_stages_take_no_steps_and_cannot_be_swept(debug_raw, tmp_path):
    path, _ = _net_file(tmp_path)
    raw = _raw(debug_raw, {"path": path, "prefix": "features."})
    raw["stages"][0]["solver"]["lr_scheduler"] = {"type": "cosine", "warmup_steps": 5}
    cfg = validate_config(raw)
    assert [i for i in sum(step_count_issues(cfg, 1000), []) if i.path.startswith("stages[0]")] == []
    swept = TuneSpace.model_validate({"stage": "features", "space": {"solver.lr": {"choice": [0.1]}}})
    assert "is import-only (train.epochs: 0)" in space_issues(swept, cfg)[0].message
    epochs = TuneSpace.model_validate({"stage": "head", "space": {"train.epochs": {"choice": [0, 2]}}})
    assert [i.path for i in space_issues(epochs, cfg)][0] == "space.train.epochs"


def test_an_import_only_stage_is_the_file_bit_for_bit_with_real_val_metrics(debug_raw, tmp_path, digits):
    path, state = _net_file(tmp_path)
    cfg = validate_config(_raw(debug_raw, {"path": path, "prefix": "features."}))
    lines: list[str] = []
    done = import_stage(cfg, 0, digits, None, log=lines.append)
    for key, tensor in state.items():
        if key.startswith("features."):
            np.testing.assert_array_equal(done.state["blocks.features." + key.removeprefix("features.")], tensor)
    assert set(done.metrics) == {"val_loss", "val_accuracy", "val_top5_accuracy", "epoch"} and math.isfinite(
        done.metrics["val_loss"]
    )
    assert "heads.features keep their fresh initialization" in lines[0]
    head = 8 * 10 + 10  # the stage's own (fresh) head is frozen too
    assert done.frozen_params == sum(p.numel() for p in digit_features(1, 4).parameters()) + head


def test_the_guide_transfer_example_validates(tmp_path):
    """docs/guide.md's transfer section: its export script's file fits its config."""
    from paths import ROOT

    from cascade_ray.checks import load_config

    text = (ROOT / "docs" / "guide.md").read_text().split("## Transfer: importing a pretrained backbone")[1]
    script, config = text.split("```python\n")[1].split("```")[0], text.split("```yaml\n")[1].split("```")[0]
    weights = str(tmp_path / "digitnet.safetensors")
    exec(compile(script.replace("/abs/digitnet.safetensors", weights), "guide-export", "exec"), {})
    path = tmp_path / "transfer.yaml"
    path.write_text(
        config.replace("/abs/digitnet.safetensors", weights).replace("mypkg", "user_models").replace(".nets:", ":")
    )
    cfg = load_config(path)
    assert cfg.stages[0].train.epochs == 0 and cfg.stages[0].pretrained.prefix == "features."
