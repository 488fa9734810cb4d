"""``cascade-ray export`` of a finished run: pt2 (default), onnx and legacy torchscript, each reloaded
and compared with the composed model ``load_cascade`` rebuilds; an earlier stage; a run whose
data is not on this machine; a run on S3. No Ray: the run is the session's `trained_run`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from cascade_ray.cli import main as cli_main
from cascade_ray.tools.export import export_run
from cascade_ray.tools.inference import load_cascade

pytestmark = pytest.mark.slow


def _raw_inputs(rows: int, seed: int = 1) -> torch.Tensor:
    """Digits-like raw inputs (0..16), not normalized: what the exported model takes."""
    return torch.rand((rows, 1, 8, 8), generator=torch.Generator().manual_seed(seed)) * 16


@pytest.fixture(scope="module")
def run_copy(trained_run, tmp_path_factory):
    """A private copy of the trained run: exports write into the run folder."""
    return shutil.copytree(trained_run, tmp_path_factory.mktemp("export") / "debug")


def test_pt2_is_the_default_and_its_program_equals_the_composed_model(run_copy, capsys):
    assert cli_main(["export", str(run_copy)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "pt2" and report["path"] == str(run_copy / "export" / "model.pt2")
    summary = json.loads((run_copy / "summary.json").read_text())
    assert report["parity_inputs"] == "test split" and report["parity"] == "ok"
    assert report["parity_batch_sizes"][:2] == [1, 7]
    assert report["eager_test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert json.loads((run_copy / "export" / "pt2.json").read_text()) == report
    program = torch.export.load(str(run_copy / "export" / "model.pt2")).module()
    composed = load_cascade(run_copy).composed
    with torch.no_grad():
        for rows in (1, 7):
            x = _raw_inputs(rows)
            torch.testing.assert_close(program(x), composed(x), rtol=0, atol=1e-5)


def test_input_spec_says_what_to_feed_without_cascade_ray(run_copy):
    export_run(run_copy)
    spec = json.loads((run_copy / "export" / "input_spec.json").read_text())
    cascade = load_cascade(run_copy)
    assert spec["input_shape"] == ["batch", 1, 8, 8] and spec["dtype"] == "float32"
    assert spec["training_input_dtype"] == "uint8"
    assert spec["target_kind"] == "class" and spec["output_shape"] == ["batch", 10]
    assert spec["class_names"] == [str(i) for i in range(10)]
    assert "inside the model" in spec["normalization"]["where"]
    assert np.allclose(spec["normalization"]["mean"], cascade.spec.mean)


def test_onnx_matches_the_composed_model_through_onnxruntime(run_copy):
    import onnxruntime as ort

    report = export_run(run_copy, "onnx")
    assert report["exporter"] == "dynamo" and report["parity"] == "ok", report
    assert report["max_abs_diff"] < report["parity_tolerance"]
    session = ort.InferenceSession(report["path"], providers=["CPUExecutionProvider"])
    composed = load_cascade(run_copy).composed
    for rows in (1, 7):
        x = _raw_inputs(rows, seed=rows)
        (got,) = session.run(None, {"inputs": x.numpy()})
        np.testing.assert_allclose(got, composed(x).detach().numpy(), rtol=0, atol=1e-4)


def test_torchscript_is_kept_as_a_legacy_format(run_copy):
    report = export_run(run_copy, "torchscript", quantize="int8")
    assert "legacy" in report["deprecated"] and report["parity"] == "ok"
    traced = torch.jit.load(report["path"])
    x = _raw_inputs(7)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), load_cascade(run_copy).composed(x), rtol=0, atol=1e-5)
    # int8: measured on the eager model, on the test split
    assert report["int8_linear_layers"]["quantized"] > 0
    assert abs(report["int8_accuracy_change"]) < 0.1
    assert report["int8_test_accuracy"] == pytest.approx(report["eager_test_accuracy"] + report["int8_accuracy_change"])


def test_an_earlier_stage_exports_to_its_own_folder(run_copy, capsys):
    assert cli_main(["export", str(run_copy), "--stage", "encoder"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stage"] == "encoder" and report["path"] == str(run_copy / "export" / "encoder" / "model.pt2")
    program = torch.export.load(report["path"]).module()
    x = _raw_inputs(7)
    with torch.no_grad():
        torch.testing.assert_close(program(x), load_cascade(run_copy, "encoder").composed(x), rtol=0, atol=1e-5)


def test_a_run_whose_data_is_not_here_exports_with_synthetic_parity_and_no_score(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "debug")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["data"] = config["data"] | {"source": "fashion_mnist", "root": str(tmp_path / "not-here")}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    report = export_run(run)
    assert report["parity_inputs"] == "synthetic" and report["parity"] == "ok", report
    assert "does not load here" in report["parity_inputs_note"]
    assert not any("accuracy" in key for key in report)
    # the normalization came from the manifest: the same program as the untouched run's
    program = torch.export.load(report["path"]).module()
    x = _raw_inputs(7)
    with torch.no_grad():
        torch.testing.assert_close(program(x), load_cascade(trained_run).composed(x), rtol=0, atol=1e-5)


def test_a_run_on_s3_exports_to_its_bucket(trained_run_s3, s3, capsys):
    assert cli_main(["export", trained_run_s3, "--format", "pt2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == f"{trained_run_s3}/export/model.pt2" and report["parity"] == "ok"
    prefix = trained_run_s3.removeprefix(f"s3://{s3.bucket}/")
    keys = set(s3.keys(prefix))
    assert {f"{prefix}/export/{name}" for name in ("model.pt2", "pt2.json", "input_spec.json")} <= keys
