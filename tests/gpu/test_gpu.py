"""GPU checks: Ray Train's backend choice, use_gpu auto, bf16 / fp16 (GradScaler) stages, and a
2-worker NCCL stage with SyncBatchNorm. Every test skips without CUDA; `bash scripts/gpu_check.sh`
runs them on a GPU machine (with a CUDA build of torch).
"""

from __future__ import annotations

import json

import pytest
import torch
from paths import CONFIGS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize(("use_gpu", "backend", "device"), [(True, "nccl", "cuda"), (False, "gloo", "cpu")])
def test_ray_train_picks_nccl_on_gpu_and_gloo_on_cpu(tmp_path, use_gpu, backend, device):
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    def _backend_loop(_config):  # nested: cloudpickle ships it by value (workers cannot import this test file)
        import ray.train.torch
        import torch.distributed as dist

        return {
            "backend": dist.get_backend(),
            "device": str(ray.train.torch.get_device()),
        }  # rank 0's -> Result.return_value

    ray.init(num_cpus=4, num_gpus=GPUS)
    try:
        result = TorchTrainer(
            _backend_loop,
            scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=use_gpu),
            run_config=ray.train.RunConfig(name=f"backend-{backend}", storage_path=str(tmp_path)),
        ).fit()
    finally:
        ray.shutdown()
    reported = result.return_value
    assert reported["backend"] == backend and reported["device"].startswith(device), reported


def test_fp16_has_a_cuda_grad_scaler_and_bf16_autocasts_without_one():
    from cascade_ray.checks import validate_config
    from cascade_ray.config.yaml_io import read_yaml
    from cascade_ray.solver import build_precision

    raw = read_yaml(CONFIGS / "debug.yaml")
    raw["stages"][0]["solver"]["precision"] = "fp16"
    raw["stages"][1]["solver"]["precision"] = "bf16"
    cfg = validate_config(raw)
    cuda = torch.device("cuda")
    fp16 = build_precision(cfg.stages[0].solver, cuda, "stages[0].solver")
    bf16 = build_precision(cfg.stages[1].solver, cuda, "stages[1].solver")
    assert isinstance(fp16.scaler, torch.amp.GradScaler) and fp16.scaler.is_enabled() and bf16.scaler is None
    layer = torch.nn.Linear(8, 4).to(cuda)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for precision, dtype in ((fp16, torch.float16), (bf16, torch.bfloat16)):
        with precision.autocast():
            out = layer(torch.randn(16, 8, device=cuda))
        assert out.dtype == dtype
        precision.backward(out.float().square().mean())
        precision.unscale(opt)
        precision.step(opt)
        opt.zero_grad(set_to_none=True)
        assert all(torch.isfinite(p).all() for p in layer.parameters())


def _run(tmp_path, overrides):
    from cascade_ray.api import run_pipeline
    from cascade_ray.checks import load_config

    lines: list[str] = []
    cfg = load_config(CONFIGS / "debug.yaml", [f"storage_path={tmp_path}", *overrides])
    summary = run_pipeline(cfg, log=lines.append)
    return summary, lines


def test_debug_pipeline_on_gpu_with_auto_bf16_and_fp16_stages(tmp_path):
    summary, lines = _run(
        tmp_path,
        [
            "stages.features.solver.precision=bf16",
            "stages.encoder.solver.precision=fp16",
            "stages.encoder.scaling.num_workers=1",
        ],
    )
    for stage in ("features", "encoder", "classifier"):
        assert f"stage {stage!r}: use_gpu auto -> GPU (NCCL) x 1 worker(s)" in lines
    on_disk = json.loads((tmp_path / "debug" / "summary.json").read_text())
    assert on_disk["test_accuracy"] == summary["test_accuracy"] > 0.5, "digits: far above chance (0.1) even in 2 epochs"
    for record in summary["stages"]:
        assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in record["history"]), record["name"]


@pytest.mark.skipif(GPUS < 2, reason="a 2-worker NCCL stage needs 2 GPUs")
def test_two_gpu_workers_with_sync_batchnorm(tmp_path):
    summary, lines = _run(
        tmp_path,
        [
            "stages.features.scaling.num_workers=2",
            "stages.features.scaling.sync_batchnorm=true",
            "stages.encoder.scaling.num_workers=2",
        ],
    )
    assert "stage 'features': use_gpu auto -> GPU (NCCL) x 2 worker(s)" in lines
    features = next(r for r in summary["stages"] if r["name"] == "features")
    assert features["num_workers"] == 2 and features["status"] == "trained"


def test_precision_auto_on_this_gpu_follows_its_compute_capability():
    """The detected GPU, not an injected one: bf16 from compute capability 8.0, else fp16 with a scaler."""
    from cascade_ray.checks import load_config
    from cascade_ray.hardware import detect_hardware
    from cascade_ray.solver import build_precision

    cuda = torch.device("cuda")
    hw = detect_hardware(cuda)
    major, _ = torch.cuda.get_device_capability(cuda)
    assert hw.kind == "cuda" and hw.native_bf16 is (major >= 8)
    cfg = load_config(CONFIGS / "debug.yaml")
    precision = build_precision(cfg.stages[0].solver, cuda, "stages[0].solver")
    assert precision.choice.requested == "auto"
    assert (precision.name, precision.scaler is None) == (("bf16", True) if major >= 8 else ("fp16", False))


def test_feature_cache_tasks_of_a_gpu_stage_compute_on_the_gpu(digits):
    """A GPU stage's feature cache is computed by Ray tasks that each hold a GPU and run the frozen
    upstream there; the features equal the CPU's within TF32 rounding: cuDNN convolutions use TF32
    by default (a 10-bit mantissa), so the tolerance is 2e-3 of the features' largest magnitude
    (on an H200, 23 of 294,144 train values missed rtol 1e-2 + atol 1e-3, by at most 2.7e-3)."""
    import numpy as np
    import ray

    from cascade_ray.checks import load_config
    from cascade_ray.pipeline.features import compute_features, upstream_outputs
    from cascade_ray.stage.setup import build_stage_model

    cfg = load_config(CONFIGS / "debug.yaml", ["stages.classifier.scaling.use_gpu=true"])
    model, _ = build_stage_model(cfg, 1, digits, None)  # features + encoder: the classifier's upstream
    upstream = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    sizes = {"train": len(digits.y_train), "val": len(digits.y_val)}
    ray.init(num_cpus=4, num_gpus=GPUS)
    try:
        refs = [ray.put(digits.to_arrays()), ray.put(upstream)]
        shards, nodes, devices = compute_features(cfg, 2, *refs, None, None, sizes)  # where auto: GPU -> tasks
    finally:
        ray.shutdown()
    assert devices == ["cuda"] * cfg.stages[2].scaling.num_workers and len(nodes) == len(devices)
    expected = upstream_outputs(cfg, 2, digits, upstream)  # in this process, on the CPU
    for split in ("train", "val"):
        got = shards[f"x_{split}"]
        assert got.shape == expected[split].shape and np.isfinite(got).all()
        scale = float(np.abs(expected[split]).max())
        np.testing.assert_allclose(got, expected[split], rtol=0, atol=2e-3 * scale, err_msg=split)
