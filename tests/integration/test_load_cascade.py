"""The Python API on real runs: run_pipeline -> Run -> model(); load_cascade from local and S3 runs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from paths import CONFIGS

from cascade_ray.api import InputError, RunOptions, load_cascade, run_pipeline
from cascade_ray.data import load_digits
from cascade_ray.errors import ArtifactError, CascadeError


@pytest.fixture(scope="module")
def test_split():
    data = load_digits(train_size=None, val_fraction=0.2, seed=0)  # the debug config's split
    return data.x_test, data.y_test


def test_a_loaded_run_predicts_what_the_run_evaluated(trained_run, test_split):
    x, y = test_split
    cascade = load_cascade(trained_run)
    assert cascade.stage == "classifier" and cascade.spec.input_shape == (1, 8, 8)
    assert cascade.spec.class_names == tuple(str(d) for d in range(10))
    out = cascade.predict(x)
    evaluated = pq.read_table(trained_run / "test_predictions.parquet").column("prediction").to_numpy()
    np.testing.assert_array_equal(out["prediction"], evaluated)  # bit for bit the run's own test predictions
    summary = json.loads((trained_run / "summary.json").read_text())
    assert float((out["prediction"] == y).mean()) == pytest.approx(summary["test_accuracy"])
    np.testing.assert_allclose(out["probabilities"].sum(1), 1.0, rtol=1e-5)
    assert cascade.label_names(out["prediction"][:3]) == [str(int(p)) for p in out["prediction"][:3]]
    # a stage artifact folder loads the cascade up to that stage (its own head predicts)
    encoder = load_cascade(trained_run / "stages" / "encoder")
    assert encoder.stage == "encoder" and encoder.predict(x[:4])["prediction"].shape == (4,)
    with pytest.raises(InputError, match=r"the model takes \(N, 1, 8, 8\)"):
        cascade.predict(np.zeros((2, 28, 28)))


def test_loading_needs_neither_the_data_nor_a_damaged_file_passes(trained_run, tmp_path, monkeypatch):
    import cascade_ray.data.source as source

    copy = tmp_path / "debug"
    shutil.copytree(trained_run, copy)
    monkeypatch.setattr(source, "load_data", lambda *a, **k: pytest.fail("training data read to load a run"))
    assert load_cascade(copy).predict(np.zeros((1, 1, 8, 8)))["prediction"].shape == (1,)
    with pytest.raises(CascadeError, match="no stage 'encodr'; did you mean 'encoder'"):
        load_cascade(copy, stage="encodr")
    weights = copy / "stages" / "classifier" / "weights.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        load_cascade(copy)
    (copy / "summary.json").unlink()
    with pytest.raises(CascadeError, match="not a finished run"):
        load_cascade(copy)


def test_a_run_on_object_storage_loads(trained_run_s3, trained_run, test_split):
    x, _ = test_split
    remote = load_cascade(trained_run_s3)
    assert str(remote.run).startswith("s3://")
    np.testing.assert_array_equal(remote.predict(x)["prediction"], load_cascade(trained_run).predict(x)["prediction"])


def test_run_pipeline_from_a_path_with_keyword_overrides(ray_session, tmp_path, test_split):
    x, y = test_split
    run = run_pipeline(
        CONFIGS / "debug.yaml",
        RunOptions(stop_after="features"),
        log=lambda _: None,
        storage_path=str(tmp_path),
        stages__features__train__epochs=1,
        stages__0__train__batch_size=64,
    )
    assert run.run_dir == str(tmp_path / "debug") and [s["name"] for s in run.stages] == ["features"]
    assert run["stages"][0]["status"] == "trained" and run.cfg.stages[0].train.batch_size == 64
    cascade = run.model()  # a stop_after run has no config.yaml: the Run's own config builds it
    assert cascade.stage == "features"
    accuracy = float((cascade.predict(x)["prediction"] == y).mean())
    assert accuracy > 0.3, accuracy  # one epoch of the features stage, 10 classes
