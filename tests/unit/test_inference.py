"""Inputs a trained cascade accepts, and its prediction columns (no Ray, no run needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paths import CONFIGS

from cascade_ray.api import load_config
from cascade_ray.errors import ArtifactError
from cascade_ray.models.cascade import build_cascade
from cascade_ray.models.plan import require_plans
from cascade_ray.tools.inference import Cascade, InputError, InputSpec, prediction_columns

SPEC = {
    "input_shape": [1, 8, 8],
    "target_kind": "class",
    "num_classes": 10,
    "mean": [[[4.5]]],
    "std": [[[6.0]]],
    "stats_shape": [1, 1, 1],
    "class_names": [str(i) for i in range(10)],
}


@pytest.fixture(scope="module")
def cascade(tmp_path_factory):
    cfg = load_config(CONFIGS / "debug.yaml")
    spec = InputSpec.from_manifest(SPEC, "test")
    model = build_cascade(cfg, require_plans(cfg, spec.input_shape, spec.out_width), 10, upto=2)
    return Cascade(cfg, "classifier", spec, model, tmp_path_factory.mktemp("run"))


def test_spec_from_a_manifest_and_its_absence():
    spec = InputSpec.from_manifest(SPEC, "m.json")
    assert spec.input_shape == (1, 8, 8) and spec.mean.shape == (1, 1, 1) and spec.class_names[3] == "3"
    with pytest.raises(ArtifactError, match="no data_spec"):
        InputSpec.from_manifest(None, "m.json")
    with pytest.raises(ArtifactError, match="data_spec is malformed"):
        InputSpec.from_manifest({**SPEC, "input_shape": "abc"}, "m.json")


def test_inputs_in_every_accepted_layout_give_the_same_outputs(cascade):
    x = np.random.default_rng(0).integers(0, 16, (3, 1, 8, 8)).astype(np.uint8)
    ref = cascade.outputs(x)
    assert ref.shape == (3, 10)
    torch.testing.assert_close(cascade.outputs(x.reshape(3, 64).tolist()), ref)  # flat rows, nested lists
    torch.testing.assert_close(cascade.outputs(torch.from_numpy(x).double()), ref)
    torch.testing.assert_close(cascade.outputs(x[0]), ref[:1])  # one row without the batch axis
    torch.testing.assert_close(cascade.outputs(x[0].reshape(64).tolist()), ref[:1])  # one flat row
    # the torchvision idiom: module(preprocess(x)) is the raw-input composed model
    torch.testing.assert_close(cascade.module(cascade.preprocess(x)), cascade.composed(torch.from_numpy(x).float()))


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [
        (np.zeros((2, 3)), r"shape \(2, 3\); the model takes \(N, 1, 8, 8\)"),
        (np.zeros(63), r"shape \(63,\); the model takes \(N, 1, 8, 8\) \(or flat rows of 64 values; one row alone"),
        ([[1.0, 2.0], [3.0]], "rows of different lengths"),
        (np.array(["a", "b"]), "must be numbers"),
        ([{"x": 1}], "must be numbers"),
        (np.full((1, 1, 8, 8), np.nan), "NaN or infinite"),
        (np.zeros((1, 1, 8, 8), dtype=np.complex64), "complex"),
    ],
)
def test_bad_inputs_say_what_fits(cascade, inputs, reason):
    with pytest.raises(InputError, match=reason):
        cascade.predict(inputs)


def test_prediction_columns_per_target_kind():
    out = torch.tensor([[2.0, -1.0, 0.5], [-3.0, 1.0, 0.0]])
    cls = prediction_columns(out, "class")
    assert cls["prediction"].tolist() == [0, 1] and cls["prediction"].dtype == np.int64
    np.testing.assert_allclose(cls["probabilities"].sum(1), 1.0, rtol=1e-6)
    multi = prediction_columns(out, "multilabel")
    assert multi["prediction"].tolist() == [[1, 0, 1], [0, 1, 1]]
    reg = prediction_columns(out[:, :1], "regression")
    assert reg["prediction"].tolist() == [2.0, -3.0] and "probabilities" not in reg  # (N, 1) -> (N,)
    assert prediction_columns(out, "regression")["prediction"].shape == (2, 3)


def test_a_run_config_loads_without_its_pretrained_file(debug_raw, tmp_path):
    from cascade_ray.tools.inference import usable_config

    debug_raw["stages"][0]["pretrained"] = {"path": str(tmp_path / "gone.safetensors"), "prefix": "features."}
    debug_raw["stages"][0]["train"]["epochs"] = 0  # an import-only stage, whose file is not on this machine
    cfg = usable_config(debug_raw, "config.yaml")
    assert cfg.stages[0].pretrained is None and cfg.stages[0].train.epochs == 0
    assert usable_config(cfg, "cfg").stages[0].pretrained is None  # a validated config too
    with pytest.raises(ArtifactError, match="config.yaml: not a mapping"):
        usable_config(["stages"], "config.yaml")
    with pytest.raises(ArtifactError, match="not a config this version reads"):
        usable_config({**debug_raw, "stagez": []}, "config.yaml")


def test_inputs_off_the_training_scale_are_told_not_predicted_silently(cascade):
    """The model normalizes raw inputs itself: digits divided by 16 (or 255) were all predicted as one
    class without a word. Now they are warned about; raw inputs, zeros and other specs' data are not."""
    import warnings as w

    from cascade_ray.tools.inference import InputScaleWarning

    raw = np.random.default_rng(0).integers(0, 17, (8, 1, 8, 8)).astype(np.float32)
    spec = cascade.spec  # mean 4.5, std 6.0: pixels 0..16
    assert spec.scale_warning(torch.from_numpy(raw)) is None
    assert spec.scale_warning(torch.zeros(2, 1, 8, 8)) is None  # a blank image is not a rescaled one
    assert "look rescaled (e.g. divided by 255)" in spec.scale_warning(torch.from_numpy(raw / 16))
    assert "over 100x" in spec.scale_warning(torch.from_numpy(raw * 1000))
    unit = InputSpec.from_manifest({**SPEC, "mean": [[[0.29]]], "std": [[[0.35]]]}, "m.json")  # trained on 0..1
    assert unit.scale_warning(torch.from_numpy(raw / 16)) is None
    assert "over 100x" in unit.scale_warning(torch.from_numpy(raw * 16))  # 0..255 pixels
    standard = InputSpec.from_manifest({**SPEC, "mean": [[[0.0]]], "std": [[[1.0]]]}, "m.json")
    assert standard.scale_warning(torch.rand(4, 1, 8, 8) * 2 - 1) is None
    with pytest.warns(InputScaleWarning, match="look rescaled"):
        cascade.predict(raw / 16)
    with w.catch_warnings():
        w.simplefilter("error", InputScaleWarning)
        cascade.predict(raw)  # raw inputs: no warning
