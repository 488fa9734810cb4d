"""StageTrainer: Ray Train's controller callbacks minus the two fixed costs (no Ray needed)."""

from __future__ import annotations

import ray.train
from ray.train.torch import TorchTrainer

from cascade_ray import ray_compat
from cascade_ray.pipeline.trainer import StageTrainer
from cascade_ray.ray_compat import lean_callbacks

# Ray Train's private callback classes, through the fence (test_ray_compat fails first if Ray moved them)
DatasetsCallback, PlacementGroupCleanerCallback = ray_compat.train_callback_classes()


def _loop(_config) -> None:
    return None


def _callbacks(cls):
    return cls(_loop, scaling_config=ray.train.ScalingConfig(num_workers=1))._create_default_callbacks()


def test_no_dataset_manager_and_a_quick_stop_cleaner_with_rays_settings():
    ray_default = _callbacks(TorchTrainer)
    ours = _callbacks(StageTrainer)
    assert any(isinstance(cb, DatasetsCallback) for cb in ray_default)
    assert not any(isinstance(cb, DatasetsCallback) for cb in ours)
    (ray_cleaner,) = [cb for cb in ray_default if isinstance(cb, PlacementGroupCleanerCallback)]
    (cleaner,) = [cb for cb in ours if isinstance(cb, PlacementGroupCleanerCallback)]
    assert type(cleaner).__name__ == "QuickStopCleanerCallback"
    assert vars(cleaner) == vars(ray_cleaner), "same check interval and timeouts as Ray's own cleaner"
    # every other callback is Ray's, in Ray's order
    assert [type(cb) for cb in ours if cb is not cleaner] == [
        type(cb) for cb in ray_default if not isinstance(cb, (DatasetsCallback, PlacementGroupCleanerCallback))
    ]


def test_datasets_keep_the_dataset_callback():
    kept = lean_callbacks(_callbacks(TorchTrainer), has_datasets=True)
    assert any(isinstance(cb, DatasetsCallback) for cb in kept)


class _Remote:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = 0, fail

    def remote(self):
        self.calls += 1
        if self.fail:
            raise RuntimeError("actor gone")
        return object()  # a ref nobody waits for


class _Cleaner:
    def __init__(self, fail: bool = False):
        self.stop = _Remote(fail)


def _quick_cleaner():
    (cleaner,) = [cb for cb in _callbacks(StageTrainer) if isinstance(cb, PlacementGroupCleanerCallback)]
    return cleaner


def test_the_cleaner_stop_is_sent_once_and_not_waited_for():
    cleaner = _quick_cleaner()
    actor = _Cleaner()
    cleaner._cleaner = actor
    cleaner._stop_cleaner()
    cleaner._stop_cleaner()  # shutdown and abort may both call it
    assert actor.stop.calls == 1 and cleaner._cleaner is None


def test_a_cleaner_that_already_exited_does_not_fail_the_fit():
    cleaner = _quick_cleaner()
    cleaner._cleaner = _Cleaner(fail=True)
    cleaner._stop_cleaner()
    assert cleaner._cleaner is None


def test_if_ray_moves_its_callbacks_the_defaults_are_kept(monkeypatch):
    monkeypatch.setattr(ray_compat, "train_callback_classes", lambda: None)
    assert [type(cb) for cb in _callbacks(StageTrainer)] == [type(cb) for cb in _callbacks(TorchTrainer)]
