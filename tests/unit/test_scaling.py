"""Scaling: the preflight resource check on a fake cluster, use_gpu auto, sync_batchnorm. No Ray started."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from cascade_ray.checks import validate_config
from cascade_ray.errors import ConfigError, ResourceError
from cascade_ray.pipeline import fit
from cascade_ray.pipeline.fit import Cluster, check_resources, cluster_view, resolve_use_gpu

LAPTOP = Cluster(({"CPU": 2.0, "memory": 8e9},))
GPU_BOX = Cluster(({"CPU": 16.0, "GPU": 2.0},))


def _cfg(raw, **scaling):
    for stage in raw["stages"]:
        stage.setdefault("scaling", {}).update(scaling)
    return validate_config(raw)


def test_debug_config_fits_a_two_cpu_laptop_and_auto_says_cpu(debug_raw):
    lines = check_resources(validate_config(debug_raw), LAPTOP)
    assert lines == [
        f"stage {s!r}: use_gpu auto -> CPU (gloo) x {n} worker(s)"
        for s, n in (("features", 1), ("encoder", 2), ("classifier", 1))
    ]


def test_more_workers_than_the_cluster_can_place_names_stage_and_numbers(debug_raw):
    debug_raw["stages"][1]["scaling"] = {"num_workers": 3}
    with pytest.raises(ResourceError) as info:
        check_resources(validate_config(debug_raw), LAPTOP)
    text = str(info.value)
    assert text.startswith("stages[1].scaling: stage 'encoder' needs 3 worker(s) x {CPU: 1}")
    assert "at most 2 at once" in text and "1 alive node(s) with 2 CPU, 0 GPU" in text and "num_workers" in text
    assert info.value.exit_code == 2


def test_each_worker_must_fit_on_one_node(debug_raw):
    cfg = _cfg(debug_raw, num_workers=2, resources_per_worker={"CPU": 2.0})
    three_small = Cluster(({"CPU": 1.0},) * 3, hosts=3)  # 3 CPUs in total, but no node has 2
    with pytest.raises(ResourceError, match=r"stages\[0\].scaling.*at most 0 at once"):
        check_resources(cfg, three_small)
    check_resources(cfg, Cluster(({"CPU": 3.0},) * 2, hosts=2))  # one worker per node


def test_use_gpu_auto_takes_gpus_only_when_every_worker_gets_one(debug_raw):
    cfg = _cfg(debug_raw, num_workers=2)
    assert all(resolve_use_gpu(s, GPU_BOX) for s in cfg.stages)
    one_gpu = Cluster(({"CPU": 16.0, "GPU": 1.0},))
    assert not any(resolve_use_gpu(s, one_gpu) for s in cfg.stages)
    assert check_resources(cfg, GPU_BOX)[0] == "stage 'features': use_gpu auto -> GPU (NCCL) x 2 worker(s)"
    fractional = _cfg(debug_raw, num_workers=2, resources_per_worker={"CPU": 1.0, "GPU": 0.5})
    assert resolve_use_gpu(fractional.stages[0], one_gpu)  # resources_per_worker names a GPU: auto follows it
    check_resources(fractional, one_gpu)


def test_use_gpu_true_without_gpus_is_an_error_suggesting_auto(debug_raw):
    with pytest.raises(ResourceError, match=r"needs 1 worker\(s\) x \{CPU: 1, GPU: 1\}.*use_gpu: auto"):
        check_resources(_cfg(debug_raw, use_gpu=True, num_workers=1), LAPTOP)


def test_autoscaler_groups_count_as_capacity(debug_raw):
    cfg = _cfg(debug_raw, use_gpu=True, num_workers=4)
    head_only_now = Cluster(({"CPU": 4.0},), groups=(({"CPU": 4.0}, 1), ({"CPU": 8.0, "GPU": 1.0}, 4)))
    assert head_only_now.may_add_nodes
    check_resources(cfg, head_only_now)
    assert resolve_use_gpu(_cfg(debug_raw, num_workers=4).stages[0], head_only_now)
    with pytest.raises(ResourceError, match="autoscaler groups: 1 x {CPU: 4}, 4 x {CPU: 8, GPU: 1}"):
        check_resources(_cfg(debug_raw, use_gpu=True, num_workers=5), head_only_now)
    assert not Cluster(({"CPU": 4.0},), groups=(({"CPU": 4.0}, 1),)).may_add_nodes
    assert Cluster(({"CPU": 4.0},), groups=(({"GPU": 1.0}, -1),)).may_add_nodes


def test_an_autoscaler_with_unknown_limits_turns_the_error_into_a_warning(debug_raw):
    cfg = _cfg(debug_raw, use_gpu=True, num_workers=2)
    autoscaling = Cluster(({"CPU": 4.0},), autoscaling=True)  # launcher / KubeRay: no limits published
    assert autoscaling.may_add_nodes
    lines = check_resources(cfg, autoscaling)
    assert len(lines) == 3 and all(line.startswith("WARNING: stages[") and "autoscaler" in line for line in lines)
    assert "GPU: 1" in lines[0] and "waits forever" in lines[0]


def test_autoscaler_is_told_apart_from_rays_read_only_stand_in():
    from cascade_ray.pipeline.fit import autoscaler_in_status

    def status(active, pending=None):
        return json.dumps(
            {
                "load_metrics_report": {},
                "autoscaler_report": {"active_nodes": active, "idle_nodes": {}, "pending_launches": pending or {}},
            }
        )

    node_id = "f" * 56
    assert not autoscaler_in_status(status({f"node_{node_id}": 1}))  # `ray start --head` without a config
    assert autoscaler_in_status(status({"head": 1}))  # cluster launcher
    assert autoscaler_in_status(status({"headgroup": 1}, {"gpu": 1}))  # KubeRay
    assert not autoscaler_in_status(None) and not autoscaler_in_status(json.dumps({"load_metrics_report": {}}))


def test_gpu_only_features_on_cpu_stages_fail_at_preflight(debug_raw):
    with pytest.raises(ResourceError, match=r"stages\[0\].scaling.sync_batchnorm: stage 'features' runs on CPU"):
        check_resources(_cfg(debug_raw, num_workers=2, sync_batchnorm=True), LAPTOP)
    check_resources(_cfg(debug_raw, num_workers=1, sync_batchnorm=True), LAPTOP)  # one worker: nothing to sync
    check_resources(_cfg(debug_raw, num_workers=2, sync_batchnorm=True), GPU_BOX)


def test_fp16_on_a_stage_that_resolves_to_cpu_fails_at_preflight(debug_raw):
    debug_raw["stages"][0]["solver"]["precision"] = "fp16"
    cfg = validate_config(debug_raw)  # use_gpu auto: might be a GPU, so the config itself is fine
    with pytest.raises(ResourceError, match=r"stages\[0\].solver.precision.*fp16 needs a CUDA GPU"):
        check_resources(cfg, LAPTOP)
    check_resources(cfg, GPU_BOX)


def test_use_gpu_accepts_auto_true_false_only(debug_raw):
    assert validate_config(debug_raw).stages[0].scaling.use_gpu == "auto"
    for value in (True, False, "auto"):
        debug_raw["stages"][0]["scaling"] = {"use_gpu": value}
        assert validate_config(debug_raw).stages[0].scaling.use_gpu == value
    debug_raw["stages"][0]["scaling"] = {"use_gpu": "yes"}
    with pytest.raises(ConfigError, match=r"stages\[0\].scaling.use_gpu"):
        validate_config(debug_raw)


def test_cluster_view_reads_alive_nodes_and_hosts(monkeypatch):
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 1.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 64.0, "GPU": 8.0}},
    ]
    monkeypatch.setattr(fit.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(fit, "_autoscaler_groups", lambda: ())
    monkeypatch.setattr(fit, "_autoscaler_running", lambda: False)
    view = cluster_view()
    assert view.hosts == 2 and len(view.nodes) == 3 and view.placeable({"CPU": 1.0, "GPU": 1.0}) == 2
    assert not view.autoscaling and not view.may_add_nodes


def test_fit_stage_hands_workers_the_resolved_use_gpu(debug_raw, monkeypatch, tmp_path):
    seen = {}

    class FakeTrainer:
        def __init__(self, fn, *, train_loop_config, scaling_config, run_config):
            seen.update(config=train_loop_config, scaling=scaling_config)

        def fit(self):
            return "result"

    monkeypatch.setattr(fit, "StageTrainer", FakeTrainer)
    monkeypatch.setattr(fit, "cluster_view", lambda: GPU_BOX)
    cfg = validate_config(debug_raw)
    assert fit.fit_stage(cfg, 1, data_ref=None, upstream_ref=None, ray_dir=tmp_path, run_name="r") == "result"
    assert seen["scaling"].use_gpu is True and seen["scaling"].num_workers == 2
    assert seen["config"]["pipeline"]["stages"][1]["scaling"]["use_gpu"] is True
    assert cfg.stages[1].scaling.use_gpu == "auto", "the driver's config (and so the fingerprint) keeps `auto`"


def _stage_model(debug_raw, index):
    from cascade_ray.data.source import load_data
    from cascade_ray.stage.setup import build_stage_model

    cfg = validate_config(debug_raw)
    model, _ = build_stage_model(cfg, index, load_data(cfg.data, cfg.seed), None)
    return model


def test_sync_batchnorm_converts_trainable_batchnorm_and_keeps_parameters(debug_raw):
    from cascade_ray.stage.worker import convert_trainable_batchnorm

    model = _stage_model(debug_raw, 0)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    converted = convert_trainable_batchnorm(model)
    assert converted and all(n.startswith("blocks.features.") for n in converted)
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules())
    assert all(params[n] is p for n, p in model.named_parameters()), "optimizer-visible parameters unchanged"
    assert list(model.state_dict()) == keys
    model(torch.zeros(4, 1, 8, 8), heads=["features"])  # no process group: plain batch norm


def test_sync_batchnorm_leaves_frozen_upstream_batchnorm_alone(debug_raw):
    from cascade_ray.stage.worker import convert_trainable_batchnorm

    model = _stage_model(debug_raw, 1)  # features frozen (eval-pinned), encoder trains
    assert convert_trainable_batchnorm(model) == []
    assert any(type(m) is nn.BatchNorm2d for m in model.blocks["features"].modules())
    model.train()
    assert not model.blocks["features"].training


def test_placement_strategy_defaults_to_pack_and_reaches_ray_trains_scaling_config(debug_raw, monkeypatch, tmp_path):
    assert validate_config(debug_raw).stages[1].scaling.placement_strategy == "PACK"
    cfg = _cfg(debug_raw, placement_strategy="STRICT_SPREAD")
    made = {}

    class Trainer:  # stands in for StageTrainer: what fit_stage hands Ray Train
        def __init__(self, loop, **kwargs):
            made.update(kwargs)

        def fit(self):
            return "result"

    monkeypatch.setattr(fit, "StageTrainer", Trainer)
    monkeypatch.setattr(fit, "cluster_view", lambda: Cluster(({"CPU": 1.0},) * 2, hosts=1))
    assert fit.fit_stage(cfg, 1, data_ref="data", upstream_ref=None, ray_dir=tmp_path, run_name="r") == "result"
    assert made["scaling_config"].placement_strategy == "STRICT_SPREAD"
    assert made["scaling_config"].num_workers == 2  # the encoder's


@pytest.mark.parametrize("value", ["strict_spread", "Spread", "STRICTSPREAD"])
def test_placement_strategy_miscased_or_misspelt_is_an_error_naming_the_key(debug_raw, value):
    debug_raw["stages"][1]["scaling"]["placement_strategy"] = value
    with pytest.raises(ConfigError) as info:
        validate_config(debug_raw)
    text = str(info.value)
    assert "stages[1].scaling.placement_strategy" in text and "did you mean" in text
    assert "PACK, SPREAD, STRICT_PACK, STRICT_SPREAD" in text


def test_strict_spread_needs_one_node_per_worker_that_fits_one(debug_raw):
    cfg = _cfg(debug_raw, num_workers=2, placement_strategy="STRICT_SPREAD")
    # 2 CPUs on one node hold both workers, but not on two different nodes
    with pytest.raises(ResourceError) as info:
        check_resources(cfg, LAPTOP)
    text = str(info.value)
    assert text.startswith("stages[0].scaling.placement_strategy: stage 'features' asks for STRICT_SPREAD")
    assert "at most 1 that way" in text and "placement_strategy: SPREAD" in text and info.value.exit_code == 2
    head_and_two_nodes = Cluster(({"CPU": 0.0}, {"CPU": 1.0}, {"CPU": 1.0}))  # local_head.sh start + add-node x2
    check_resources(cfg, head_and_two_nodes)
    with pytest.raises(ResourceError, match="STRICT_SPREAD"):
        check_resources(
            _cfg(debug_raw, num_workers=3, placement_strategy="STRICT_SPREAD"), Cluster(({"CPU": 4.0},) * 2)
        )
    # SPREAD is best effort: any placement that fits passes
    check_resources(_cfg(debug_raw, num_workers=2, placement_strategy="SPREAD"), LAPTOP)


def test_strict_pack_needs_one_node_that_holds_every_worker(debug_raw):
    cfg = _cfg(debug_raw, num_workers=2, placement_strategy="STRICT_PACK")
    check_resources(cfg, LAPTOP)
    with pytest.raises(ResourceError, match=r"STRICT_PACK: 2 worker\(s\) x \{CPU: 1\} all on one node"):
        check_resources(cfg, Cluster(({"CPU": 1.0},) * 2))
    pack = _cfg(debug_raw, num_workers=2, placement_strategy="PACK")
    check_resources(pack, Cluster(({"CPU": 1.0},) * 2))  # PACK spills over


def test_autoscaler_groups_count_as_nodes_for_strict_spread(debug_raw):
    cfg = _cfg(debug_raw, num_workers=4, placement_strategy="STRICT_SPREAD")
    check_resources(cfg, Cluster(({"CPU": 0.0},), groups=(({"CPU": 1.0}, 4),), autoscaling=True))
    with pytest.raises(ResourceError, match="STRICT_SPREAD"):
        check_resources(cfg, Cluster(({"CPU": 0.0},), groups=(({"CPU": 8.0}, 2),), autoscaling=True))


def test_use_gpu_auto_follows_the_placement_strategy(debug_raw):
    cfg = _cfg(debug_raw, num_workers=2, placement_strategy="STRICT_SPREAD")
    assert not resolve_use_gpu(cfg.stages[0], GPU_BOX)  # 2 GPUs, but on one node
    assert resolve_use_gpu(cfg.stages[0], Cluster(({"CPU": 4.0, "GPU": 1.0},) * 2, hosts=2))
