"""The sweep's scheduler and search: ASHA never stops the current-values trial; the concurrency limit holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray.tune.schedulers import TrialScheduler

from cascade_ray.tune.sweep import baseline_asha

BASELINE = {"solver.lr": 1e-3, "loss.scale": 1.0}


@dataclass
class FakeTrial:
    trial_id: str
    config: dict = field(default_factory=dict)


def _scheduler():
    scheduler = baseline_asha(BASELINE, time_attr="epoch", max_t=3, grace_period=1, reduction_factor=2)
    scheduler.set_search_properties("val_accuracy", "max")
    return scheduler


def _epoch_one(scheduler, trials, scores):
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    return [scheduler.on_trial_result(None, t, {"epoch": 1, "val_accuracy": s}) for t, s in zip(trials, scores)]


def test_asha_stops_a_slow_sampled_trial_but_not_the_baseline():
    sampled = [FakeTrial(f"t{i}", {"solver.lr": 0.01 * (i + 1), "loss.scale": 1.5}) for i in range(3)]
    slow_sampled, baseline = (
        FakeTrial("slow", {"solver.lr": 5e-4, "loss.scale": 0.7}),
        FakeTrial("base", dict(BASELINE)),
    )
    scheduler = _scheduler()
    actions = _epoch_one(scheduler, [*sampled, slow_sampled, baseline], [0.9, 0.91, 0.92, 0.5, 0.5])
    assert actions[3] == TrialScheduler.STOP  # plain ASHA behaviour for a sampled trial behind the rung
    assert actions[4] == TrialScheduler.CONTINUE  # the same score on the baseline: kept running
    # at max_t every trial ends, the baseline included
    assert scheduler.on_trial_result(None, baseline, {"epoch": 3, "val_accuracy": 0.5}) == TrialScheduler.STOP


def test_without_a_baseline_it_is_plain_asha():
    scheduler = baseline_asha(None, time_attr="epoch", max_t=3, grace_period=1, reduction_factor=2)
    scheduler.set_search_properties("val_accuracy", "max")
    trials = [FakeTrial(f"t{i}", dict(BASELINE)) for i in range(4)]
    actions = _epoch_one(scheduler, trials, [0.9, 0.91, 0.92, 0.5])
    assert actions[3] == TrialScheduler.STOP


def test_the_current_values_generator_keeps_the_concurrency_limit():
    from cascade_ray.tune.space import TuneSpace
    from cascade_ray.tune.sweep import search_algorithm

    space = TuneSpace.model_validate({"stage": "encoder", "space": {"solver.lr": {"loguniform": [1e-4, 1e-2]}}})
    generator, limit = search_algorithm(space, {"solver.lr": 1e-3}, 3, "space.yaml")
    # Tune ignores TuneConfig.max_concurrent_trials for a generator passed in: it must hold it
    assert limit is None and generator.max_concurrent == 3 and generator._points_to_evaluate == [{"solver.lr": 1e-3}]
    plain, limit = search_algorithm(space, None, 3, "space.yaml")
    assert limit is None and plain.max_concurrent == 3 and not plain._points_to_evaluate


def test_random_search_is_seeded_by_the_pipeline_seed():
    from ray.tune import Experiment, loguniform

    from cascade_ray.tune.space import TuneSpace
    from cascade_ray.tune.sweep import search_algorithm

    space = TuneSpace.model_validate({"stage": "encoder", "space": {"solver.lr": {"loguniform": [1e-4, 1e-2]}}})

    def samples(seed):
        generator, _ = search_algorithm(space, None, 3, "space.yaml", seed=seed)
        generator.add_configurations(
            Experiment("seeded", lambda config: None, config={"solver.lr": loguniform(1e-4, 1e-2)}, num_samples=3)
        )
        return [generator.next_trial().config["solver.lr"] for _ in range(3)]

    assert samples(0) == samples(0) != samples(1)
