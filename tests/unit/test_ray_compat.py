"""The fence around Ray's internals: every private symbol exists in the installed Ray, a missing
one costs a single WARNING and Ray's plain behaviour, and no other module reaches past it."""

from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading

import pytest
import ray
import ray.train
from fakes import checkpoint_manager_logger, records_of, shim_logger
from paths import ROOT
from ray.train.torch import TorchTrainer

from cascade_ray import ray_compat
from cascade_ray.logs import install_worker_filter
from cascade_ray.pipeline.trainer import StageTrainer
from cascade_ray.ray_compat import PRIVATE_SYMBOLS

PACKAGE = ROOT / "cascade_ray"
FENCE = PACKAGE / "ray_compat.py"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the once-per-process warnings as a new process would."""
    monkeypatch.setattr(ray_compat, "_warned", set())
    ray_compat.quick_stop_cleaner_class.cache_clear()
    yield
    ray_compat.quick_stop_cleaner_class.cache_clear()


def _warnings(caplog, shim: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "cascade_ray.ray_compat" and r.levelno == logging.WARNING and f"ray_compat.{shim}:" in r.message
    ]


def _assert_one_warning(caplog, shim: str) -> None:
    found = _warnings(caplog, shim)
    assert len(found) == 1, [r.message for r in caplog.records]
    assert f"Ray {ray.__version__}" in found[0].message and ray_compat.CHECKED_RAY_VERSION in found[0].message


def _break_module(monkeypatch, shim: str) -> None:
    """Make the first private module listed for `shim` unimportable (as if Ray had moved it)."""
    module = next(s.module for s in PRIVATE_SYMBOLS if s.shim == shim)
    monkeypatch.setitem(sys.modules, module, None)


def _loop(_config) -> None:
    return None


def _callbacks(cls):
    return cls(_loop, scaling_config=ray.train.ScalingConfig(num_workers=1))._create_default_callbacks()


# --- the installed Ray has every symbol --------------------------------------------------------


@pytest.mark.parametrize("symbol", PRIVATE_SYMBOLS, ids=str)
def test_every_private_symbol_exists_in_the_installed_ray(symbol):
    try:
        ray_compat.resolve(symbol)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            f"Ray {ray.__version__} has no {symbol} (used by ray_compat.{symbol.shim}; checked against Ray "
            f"{ray_compat.CHECKED_RAY_VERSION}): {type(exc).__name__}: {exc}"
        )
    assert ray_compat.missing_private_symbols([symbol]) == []


def test_ray_registers_its_printer_under_the_name_the_filter_replaces():
    import inspect

    connect = ray_compat.resolve(next(s for s in PRIVATE_SYMBOLS if s.attr == "connect"))
    assert f'"{ray_compat._RAY_PRINTER}"' in inspect.getsource(connect), (
        f"Ray {ray.__version__} no longer registers its worker-output printer as {ray_compat._RAY_PRINTER!r}"
    )


def test_the_installed_ray_is_the_version_the_fence_was_checked_against():
    assert ray.__version__ == ray_compat.CHECKED_RAY_VERSION, (
        f"Ray {ray.__version__} is installed; cascade_ray/ray_compat.py was checked against Ray "
        f"{ray_compat.CHECKED_RAY_VERSION}: re-read each shim's Ray source, then update CHECKED_RAY_VERSION"
    )


def test_a_missing_symbol_is_reported_with_its_error():
    fake = ray_compat.PrivateSymbol("ray.train", "NoSuchTrainer", "test")
    [(symbol, error)] = ray_compat.missing_private_symbols([fake])
    assert symbol is fake and error.startswith("AttributeError")
    gone = ray_compat.PrivateSymbol("ray.train.torch", "TorchTrainer.no_such_attribute", "test", instance=True)
    assert [s for s, _ in ray_compat.missing_private_symbols([gone])] == [gone]


def test_every_shim_in_the_list_exists_and_has_a_fallback_test():
    shims = {s.shim for s in PRIVATE_SYMBOLS}
    assert all(hasattr(ray_compat, name) for name in shims)
    assert shims == {case[0] for case in MODULE_GONE} | SEPARATELY_TESTED


# --- no module but the fence touches Ray's internals ---------------------------------------------


def _private_patterns() -> list[re.Pattern[str]]:
    names = {
        part
        for s in PRIVATE_SYMBOLS
        for part in s.attr.split(".")
        if part.startswith("_") and not part.startswith("__")
    }
    return [
        re.compile(r"\bray(?:\.\w+)*\._\w+"),  # ray._private, ray.train._internal, ray._raylet, ...
        re.compile(r"\bfrom ray[\w.]* import [^\n]*\b_[a-z]\w*"),  # a private name imported from Ray
        re.compile(r"_internal_kv"),
        *(re.compile(re.escape(s.module) + r"\b") for s in PRIVATE_SYMBOLS),
        *(re.compile(rf"\b{re.escape(name)}\b") for name in sorted(names)),
    ]


def _hits(path) -> list[str]:
    text = path.read_text()
    return [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for pattern in _private_patterns()
        for m in pattern.finditer(text)
    ]


def test_only_ray_compat_touches_rays_internals():
    outside = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != FENCE for hit in _hits(path)]
    assert outside == [], "private Ray names outside cascade_ray/ray_compat.py:\n" + "\n".join(outside)


def test_the_scan_finds_the_fences_own_private_names():
    found = "\n".join(_hits(FENCE))
    for needle in ("ray._private", "ray.train._internal", "_internal_kv", "_stop_cleaner", "_num_stopped"):
        assert needle in found, needle


# --- a missing symbol: one WARNING, Ray's plain behaviour ------------------------------------------


MODULE_GONE = [
    ("train_callback_classes", lambda: ray_compat.train_callback_classes(), None),
    ("wrap_worker_output_printer", lambda: ray_compat.wrap_worker_output_printer(lambda printer: printer), False),
    ("wait_for_tune_reports_taken", lambda: ray_compat.wait_for_tune_reports_taken(timeout_s=5), False),
    ("autoscaling_status", lambda: ray_compat.autoscaling_status(), None),
    ("autoscaler_node_groups", lambda: ray_compat.autoscaler_node_groups(), ()),
    ("detected_cpus", lambda: ray_compat.detected_cpus(), float(os.cpu_count() or 1)),
    ("pin_deployment_version", lambda: ray_compat.pin_deployment_version(object(), "v1"), False),
    ("worker_failure_cause", lambda: ray_compat.worker_failure_cause(RuntimeError("x")), None),
    ("unreadable_run_errors", ray_compat.unreadable_run_errors, (RuntimeError,)),
]
SEPARATELY_TESTED = {
    "LeanTorchTrainer",
    "quick_stop_cleaner_class",
    "uncount_asha_stop",
    "read_run_result",
    "quiet_preset_warnings",
}


@pytest.mark.parametrize(("shim", "call", "fallback"), MODULE_GONE, ids=[c[0] for c in MODULE_GONE])
def test_a_missing_private_module_warns_once_and_falls_back(monkeypatch, caplog, shim, call, fallback):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # the autoscaler reads run only after ray.init
    _break_module(monkeypatch, shim)
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert call() == fallback
        assert call() == fallback
    _assert_one_warning(caplog, shim)


def test_reading_a_run_back_drops_only_rays_resume_notice(monkeypatch):
    """Ray's checkpoint manager logs its resume notice while from_path reads the snapshot: dropped
    for that call; its other records pass, and the filter is gone afterwards."""
    ray_logger = checkpoint_manager_logger()

    def from_path(path):
        ray_logger.info(ray_compat.RESUME_NOTICE + f" at: '{path}'\nIf you meant to start a brand new training job ...")
        ray_logger.info("another record")
        return "result of " + path

    monkeypatch.setattr(ray.train.Result, "from_path", from_path)
    with records_of(ray_logger) as records:
        assert ray_compat.read_run_result("/runs/a") == "result of /runs/a"
        assert records.messages == ["another record"]
        assert ray_logger.filters == []
        ray_logger.info(ray_compat.RESUME_NOTICE + " at: '/runs/b'")  # a real resume (a fit) still says so
        assert len(records.messages) == 2


def test_without_the_checkpoint_managers_logger_a_run_is_read_as_ray_reads_it(monkeypatch, caplog, tmp_path):
    _break_module(monkeypatch, "read_run_result")
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="doesn't exist"):  # Ray's own error for a missing run
                ray_compat.read_run_result(str(tmp_path / "missing"))
    _assert_one_warning(caplog, "read_run_result")


def _preset(key: str) -> str:  # Ray 2.60.0's wording (ray/tune/search/variant_generator.py)
    return f"Pre-set value `0.0` is not within valid values of parameter `{key}`: (1e-05, 0.01)"


def test_tunes_preset_warning_is_dropped_for_the_named_keys_only_inside_the_block():
    ray_logger = shim_logger("quiet_preset_warnings")
    with records_of(ray_logger) as records:
        with ray_compat.quiet_preset_warnings(["solver.weight_decay"]):
            ray_logger.warning(_preset("solver.weight_decay"))  # explained by cascade-ray's note: dropped
            ray_logger.warning(_preset("weight_decay"))  # another parameter: kept
            ray_logger.warning(_preset("solver.lr"))
            ray_logger.info("another record")
        assert records.messages == [_preset("weight_decay"), _preset("solver.lr"), "another record"]
        assert ray_logger.filters == []
        ray_logger.warning(_preset("solver.weight_decay"))  # outside the block: Tune's own warning again
        assert records.messages[-1] == _preset("solver.weight_decay")
        with ray_compat.quiet_preset_warnings([]):  # nothing explained: nothing dropped
            ray_logger.warning(_preset("solver.weight_decay"))
        assert len(records.messages) == 5


def test_without_the_variant_generators_logger_tunes_warning_stays(monkeypatch, caplog):
    _break_module(monkeypatch, "quiet_preset_warnings")
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        for _ in range(2):
            with ray_compat.quiet_preset_warnings(["solver.weight_decay"]):
                pass
    _assert_one_warning(caplog, "quiet_preset_warnings")


def test_without_rays_callback_classes_a_stage_fit_keeps_rays_callbacks(monkeypatch, caplog):
    _break_module(monkeypatch, "train_callback_classes")
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert [type(cb) for cb in _callbacks(StageTrainer)] == [type(cb) for cb in _callbacks(TorchTrainer)]
        _callbacks(StageTrainer)
    _assert_one_warning(caplog, "train_callback_classes")


def test_without_the_cleaners_stop_method_rays_cleaner_is_kept(monkeypatch, caplog):
    _, cleaner_cls = ray_compat.train_callback_classes()
    monkeypatch.delattr(cleaner_cls, "_stop_cleaner")
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert ray_compat.quick_stop_cleaner_class(cleaner_cls) is None
        ours = [type(cb) for cb in _callbacks(StageTrainer)]
        _callbacks(StageTrainer)
    assert cleaner_cls in ours, "Ray's own cleaner, not the quick-stop one"
    _assert_one_warning(caplog, "quick_stop_cleaner_class")


def test_without_the_trainers_callback_hook_a_warning_at_construction(monkeypatch, caplog):
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    monkeypatch.delattr(DataParallelTrainer, "_create_default_callbacks")
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        StageTrainer(_loop, scaling_config=ray.train.ScalingConfig(num_workers=1))
        StageTrainer(_loop, scaling_config=ray.train.ScalingConfig(num_workers=1))
    _assert_one_warning(caplog, "LeanTorchTrainer")


def test_a_failing_callback_change_keeps_rays_callbacks_and_warns_once(monkeypatch, caplog):
    def broken(callbacks, *, has_datasets):
        raise TypeError("Ray changed its callbacks")

    monkeypatch.setattr(ray_compat, "lean_callbacks", broken)
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert [type(cb) for cb in _callbacks(StageTrainer)] == [type(cb) for cb in _callbacks(TorchTrainer)]
        _callbacks(StageTrainer)
    _assert_one_warning(caplog, "LeanTorchTrainer")


def test_asha_without_its_counter_warns_once_and_goes_on(caplog):
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        ray_compat.uncount_asha_stop(object())
        ray_compat.uncount_asha_stop(object())
    _assert_one_warning(caplog, "uncount_asha_stop")


def test_before_ray_init_the_autoscaler_reads_are_empty_without_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert ray_compat.autoscaling_status() is None
        assert ray_compat.autoscaler_node_groups() == ()
    assert not caplog.records


# --- the shims do what they say with the symbols present ------------------------------------------


@pytest.fixture
def dispatcher(monkeypatch):
    """Ray's worker-output dispatcher with a stand-in for the printer ``ray.init`` registers."""
    dispatcher = ray_compat.resolve(next(s for s in PRIVATE_SYMBOLS if s.attr == "global_worker_stdstream_dispatcher"))
    printed: list[dict] = []
    monkeypatch.setattr(dispatcher, "handlers", [("other", lambda data: None), ("ray_print_logs", printed.append)])
    return dispatcher, printed


def test_the_worker_filter_wraps_rays_printer_in_place(dispatcher, caplog):
    dispatcher, printed = dispatcher
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert install_worker_filter("info")
        assert install_worker_filter("info")  # a second ray.init: wraps Ray's printer, not the first wrapper
    assert [name for name, _ in dispatcher.handlers] == ["other", "ray_print_logs"]
    ray_info = "2026-11-30 10:36:52,291\tINFO worker.py:2029 -- Started a local Ray instance."
    dispatcher.emit({"lines": [ray_info, "epoch 1 done"], "actor_name": "", "pid": 7, "is_err": False})
    dispatcher.emit({"lines": [ray_info], "actor_name": "", "pid": 7, "is_err": False})  # nothing left to print
    assert [d["lines"] for d in printed] == [["epoch 1 done"]]
    assert not caplog.records


def test_without_log_to_driver_there_is_nothing_to_filter(monkeypatch, caplog, dispatcher):
    dispatcher, _ = dispatcher
    monkeypatch.setattr(dispatcher, "handlers", [])
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert not install_worker_filter("info")
    assert not caplog.records


def test_a_renamed_printer_warns_once_and_leaves_the_output_unfiltered(monkeypatch, caplog, dispatcher):
    dispatcher, printed = dispatcher
    monkeypatch.setattr(dispatcher, "handlers", [("print_logs_v3", printed.append)])
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert not install_worker_filter("info")
        assert not install_worker_filter("info")
    assert dispatcher.handlers == [("print_logs_v3", printed.append)]
    _assert_one_warning(caplog, "wrap_worker_output_printer")


class _Session:
    def __init__(self):
        self.result_queue: queue.Queue = queue.Queue(1)
        self._inter_actor_queue = None


@pytest.fixture
def session(monkeypatch):
    """A stand-in for the Tune trial's Train session that ``get_session`` returns."""
    fake = _Session()
    get_session = next(s for s in PRIVATE_SYMBOLS if s.attr == "get_session")
    monkeypatch.setattr(sys.modules[get_session.module], "_session", fake)  # what get_session() returns
    return fake


def test_the_trial_waits_until_tune_took_its_last_report(session):
    session.result_queue.put({"epoch": 3})
    taker = threading.Timer(0.3, session.result_queue.get)
    taker.start()
    assert ray_compat.wait_for_tune_reports_taken(timeout_s=10, poll_s=0.01)
    assert session.result_queue.empty()
    taker.join()


def test_a_report_never_taken_ends_the_wait_at_the_timeout(session, caplog):
    session.result_queue.put({"epoch": 3})
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert not ray_compat.wait_for_tune_reports_taken(timeout_s=0.2, poll_s=0.01)
    assert not caplog.records


def test_outside_a_trial_there_is_no_session_to_wait_for(caplog):
    with caplog.at_level(logging.WARNING, logger="cascade_ray.ray_compat"):
        assert not ray_compat.wait_for_tune_reports_taken(timeout_s=5)
    _assert_one_warning(caplog, "wait_for_tune_reports_taken")


def test_the_spared_baseline_trial_is_not_counted_as_stopped():
    from cascade_ray.tune.sweep import baseline_asha

    scheduler = baseline_asha({"lr": 1.0}, time_attr="epoch", max_t=3, grace_period=1, reduction_factor=2)
    scheduler.set_search_properties("acc", "max")

    class Trial:
        def __init__(self, trial_id, config):
            self.trial_id, self.config = trial_id, config

    trials = [Trial(f"t{i}", {"lr": 2.0 + i}) for i in range(3)] + [Trial("base", {"lr": 1.0})]
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    actions = [scheduler.on_trial_result(None, t, {"epoch": 1, "acc": a}) for t, a in zip(trials, [0.9, 0.8, 0.7, 0.1])]
    assert actions[-1] == "CONTINUE"
    stopped = actions.count("STOP")
    assert stopped >= 1 and f"num_stopped={stopped}" in scheduler.debug_string()
