"""Transfer on a real (local) Ray: a published-style network's backbone imported by prefix as a frozen,
import-only stage (no Ray Train job), a head trained on it, --resume reuse and a changed file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file
from user_models import DigitNet

from cascade_ray.api import RunOptions, load_cascade, run_pipeline
from cascade_ray.checks import validate_config
from cascade_ray.data.source import load_data
from cascade_ray.pipeline.artifacts import read_artifact

# the composed model (frozen backbone + a head trained 6 epochs on its outputs) against the
# backbone's own network on the test split; measured: backbone 0.9806, cascade 0.9722 (2 CPUs)
TOLERANCE = 0.05


def _config(storage, weights) -> dict:
    return {
        "name": "transfer",
        "storage_path": str(storage),
        "trusted_modules": ["user_models"],
        "data": {"source": "digits", "val_fraction": 0.2},
        "stages": [
            {
                "name": "backbone",
                "model": {"type": "user_models:digit_features", "width": 16},
                "pretrained": {"path": str(weights), "prefix": "features."},
                "train": {"epochs": 0},
            },
            {
                "name": "head",
                "model": {"type": "mlp", "in_features": 32, "hidden": [32]},
                "solver": {"type": "Adam", "lr": 1e-2},
                "train": {"epochs": 6, "batch_size": 32, "log_interval": 100},
            },
        ],
    }


def _train_backbone(cfg) -> tuple[DigitNet, float]:
    """The "published" network, trained in plain torch on the same normalized splits; its test accuracy."""
    data = load_data(cfg.data, cfg.seed)
    norm = lambda x: (torch.from_numpy(x).float() - torch.from_numpy(data.mean)) / torch.from_numpy(data.std)  # noqa: E731
    x, y = norm(data.x_train), torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    net = DigitNet(width=16)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(15):
        for idx in torch.randperm(len(y)).split(32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        acc = (net(norm(data.x_test)).argmax(1) == torch.from_numpy(data.y_test)).float().mean().item()
    return net, acc


@pytest.fixture(scope="module")
def transfer(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    weights = root / "digitnet.safetensors"
    raw = _config(root / "runs", weights)
    save_file(DigitNet(width=16).state_dict(), str(weights))  # a placeholder, so the config validates
    cfg = validate_config(raw)
    net, backbone_acc = _train_backbone(cfg)
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(weights))
    lines: list[str] = []
    summary = run_pipeline(validate_config(raw), RunOptions(), log=lines.append)
    return raw, state, backbone_acc, summary, lines, root / "runs" / "transfer"


def test_the_backbone_is_imported_frozen_without_a_train_job(transfer):
    raw, state, backbone_acc, summary, lines, run = transfer
    backbone, head = summary["stages"]
    assert (backbone["status"], head["status"]) == ("imported", "trained")
    assert backbone["trainable_params"] == 0 and backbone["num_workers"] == 0 and backbone["ray_run"] == ""
    assert backbone["metrics"]["val_loss"] > 0  # its fresh head, really evaluated
    # no TorchTrainer ran for it: the only Ray run folder is the head's
    assert [p.name.split("-")[1] for p in (run / "ray").iterdir() if p.is_dir()] == ["head"]
    assert any("heads.backbone keep their fresh initialization" in line for line in lines)
    for name in ("backbone", "head"):  # the file's features.* bit for bit, in both artifacts
        _, weights = read_artifact(run / "stages" / name)
        for key, tensor in state.items():
            if key.startswith("features."):
                np.testing.assert_array_equal(
                    weights[f"blocks.backbone.{key.removeprefix('features.')}"], tensor.numpy()
                )


def test_the_cascade_scores_like_the_backbone(transfer):
    _, _, backbone_acc, summary, _, _ = transfer
    print(f"backbone test accuracy {backbone_acc:.4f}, cascade {summary['test_accuracy']:.4f}")
    assert backbone_acc > 0.9
    assert abs(summary["test_accuracy"] - backbone_acc) <= TOLERANCE


def test_the_run_loads_and_predicts_without_the_pretrained_file(transfer, tmp_path):
    raw, _, _, summary, _, run = transfer
    weights = Path(raw["stages"][0]["pretrained"]["path"])
    hidden = tmp_path / weights.name
    shutil.move(weights, hidden)  # loading elsewhere: the run's own files, not the pretrained file
    try:
        cascade = load_cascade(run)
    finally:
        shutil.move(hidden, weights)
    cfg = validate_config(raw)
    data = load_data(cfg.data, cfg.seed)
    prediction = cascade.predict(data.x_test)["prediction"]
    np.testing.assert_array_equal(prediction, pq.read_table(run / "test_predictions.parquet")["prediction"].to_numpy())
    assert float((prediction == data.y_test).mean()) == pytest.approx(summary["test_accuracy"])


def test_resume_reuses_the_import_and_a_changed_file_reimports(transfer):
    raw, state, _, _, _, _ = transfer
    again = run_pipeline(validate_config(raw), RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in again["stages"]] == ["reused", "reused"]
    changed = dict(state)
    changed["features.0.bias"] = state["features.0.bias"] + 0.01
    save_file(changed, raw["stages"][0]["pretrained"]["path"])
    third = run_pipeline(validate_config(raw), RunOptions(resume=True), log=lambda _: None)
    assert [s["status"] for s in third["stages"]] == ["imported", "trained"]
    assert third["stages"][0]["fingerprint"] != again["stages"][0]["fingerprint"]
