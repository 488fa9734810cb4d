"""The one place cascade-ray touches Ray's private internals (checked against Ray 2.60.0 only).

Every private Ray module, function, class attribute or instance attribute cascade-ray uses
is listed in :data:`PRIVATE_SYMBOLS` and used only here; the rest of the package imports the
public names below. Each shim says which Ray version it was read against, what it buys and
what happens without it. When a shim's private symbol is missing or behaves differently
(another Ray version), the shim falls back to Ray's plain behaviour and logs one WARNING per
shim per process on the ``cascade_ray.ray_compat`` logger, naming the shim, the installed Ray
version and the consequence. No shim fails a run: each one is an optional speed-up or
workaround.

``tests/unit/test_ray_compat.py`` imports every symbol in :data:`PRIVATE_SYMBOLS` against the
installed Ray, so a Ray upgrade that moves one fails there first.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.torch import TorchTrainer

logger = logging.getLogger(__name__)

CHECKED_RAY_VERSION = "2.60.0"


@dataclass(frozen=True)
class PrivateSymbol:
    """One private Ray name the fence uses.

    ``attr`` is a dotted path inside ``module`` (``Class.method``, ``object.attribute``). With
    ``instance=True`` its last part is an attribute the class's methods set on each instance
    (``Class.attribute``, e.g. in ``__init__``); it is checked in the class's source
    (``self.attribute``), not on the class.
    """

    module: str
    attr: str
    shim: str
    instance: bool = False

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


_TRAIN_CALLBACKS = "ray.train.v2._internal.callbacks"
_CHECKPOINT_MANAGER = "ray.train.v2._internal.execution.checkpoint.checkpoint_manager"
_PG_CALLBACK = "ray.train.v2._internal.callbacks.placement_group_callback"
_VARIANT_GENERATOR = "ray.tune.search.variant_generator"

PRIVATE_SYMBOLS: tuple[PrivateSymbol, ...] = (
    # LeanTorchTrainer
    PrivateSymbol(
        "ray.train.v2.api.data_parallel_trainer", "DataParallelTrainer._create_default_callbacks", "LeanTorchTrainer"
    ),
    PrivateSymbol(_TRAIN_CALLBACKS, "DatasetsCallback", "train_callback_classes"),
    PrivateSymbol(_PG_CALLBACK, "PlacementGroupCleanerCallback", "train_callback_classes"),
    PrivateSymbol(_PG_CALLBACK, "PlacementGroupCleanerCallback._stop_cleaner", "quick_stop_cleaner_class"),
    PrivateSymbol(_PG_CALLBACK, "PlacementGroupCleanerCallback._cleaner", "quick_stop_cleaner_class", instance=True),
    # wrap_worker_output_printer
    PrivateSymbol("ray._private.ray_logging", "global_worker_stdstream_dispatcher", "wrap_worker_output_printer"),
    PrivateSymbol(
        "ray._private.ray_logging", "WorkerStandardStreamDispatcher.handlers", "wrap_worker_output_printer", True
    ),
    PrivateSymbol("ray._private.worker", "connect", "wrap_worker_output_printer"),  # registers _RAY_PRINTER
    # wait_for_tune_reports_taken
    PrivateSymbol("ray.train._internal.session", "get_session", "wait_for_tune_reports_taken"),
    PrivateSymbol("ray.train._internal.session", "_TrainSession.result_queue", "wait_for_tune_reports_taken", True),
    PrivateSymbol(
        "ray.train._internal.session", "_TrainSession._inter_actor_queue", "wait_for_tune_reports_taken", True
    ),
    # uncount_asha_stop
    PrivateSymbol(
        "ray.tune.schedulers.async_hyperband", "AsyncHyperBandScheduler._num_stopped", "uncount_asha_stop", True
    ),
    # autoscaling_status
    PrivateSymbol("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS", "autoscaling_status"),
    PrivateSymbol("ray.experimental.internal_kv", "_internal_kv_get", "autoscaling_status"),
    # autoscaler_node_groups
    PrivateSymbol("ray._private.state", "state.get_cluster_config", "autoscaler_node_groups"),
    # detected_cpus
    PrivateSymbol("ray._private.utils", "get_num_cpus", "detected_cpus"),
    # worker_failure_cause
    PrivateSymbol(
        "ray.train.v2._internal.exceptions",
        "WorkerHealthCheckFailedError.health_check_failure",
        "worker_failure_cause",
        instance=True,
    ),
    # unreadable_run_errors
    PrivateSymbol("ray.train.v2._internal.exceptions", "CheckpointManagerInitializationError", "unreadable_run_errors"),
    # read_run_result
    PrivateSymbol(_CHECKPOINT_MANAGER, "logger", "read_run_result"),
    # quiet_preset_warnings
    PrivateSymbol(_VARIANT_GENERATOR, "logger", "quiet_preset_warnings"),
    # pin_deployment_version
    PrivateSymbol("ray.serve.deployment", "Deployment._version", "pin_deployment_version", True),
    PrivateSymbol("ray.serve._private.client", "ServeControllerClient.deploy_applications", "pin_deployment_version"),
)

_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(shim: str, problem: str, consequence: str) -> None:
    """One WARNING per shim per process: what broke, the Ray version, what the run loses."""
    with _warned_lock:
        if shim in _warned:
            return
        _warned.add(shim)
    logger.warning(
        "cascade-ray ray_compat.%s: %s in Ray %s (checked against Ray %s only); %s",
        shim,
        problem,
        ray.__version__,
        CHECKED_RAY_VERSION,
        consequence,
    )


def resolve(symbol: PrivateSymbol) -> Any:
    """The object `symbol` names in the installed Ray (for an instance attribute: its class).

    Raises ImportError / AttributeError when Ray moved it.
    """
    obj: Any = importlib.import_module(symbol.module)
    parts = symbol.attr.split(".")
    for part in parts[:-1] if symbol.instance else parts:
        obj = getattr(obj, part)
    if symbol.instance and not re.search(rf"\bself\.{parts[-1]}\b", inspect.getsource(obj)):
        raise AttributeError(f"{obj.__qualname__} no longer has self.{parts[-1]}")
    return obj


def _symbol(module: str, attr: str) -> Any:
    return resolve(next(s for s in PRIVATE_SYMBOLS if s.module == module and s.attr == attr))


# --- LeanTorchTrainer: Ray Train's default controller callbacks minus two fixed costs ---------


def train_callback_classes() -> tuple[type, type] | None:
    """Ray Train's ``(DatasetsCallback, PlacementGroupCleanerCallback)`` classes, or None.

    Ray 2.60.0: both in ``ray.train.v2._internal.callbacks``; ``DataParallelTrainer._create_default_callbacks``
    adds one of each to every fit. Fallback (moved): None, and :func:`lean_callbacks` keeps
    Ray's callbacks unchanged: each fit pays the ~1.3 s measured below again.
    """
    try:
        return (
            _symbol(_TRAIN_CALLBACKS, "DatasetsCallback"),
            _symbol(_PG_CALLBACK, "PlacementGroupCleanerCallback"),
        )
    except (ImportError, AttributeError) as exc:
        _warn_once(
            "train_callback_classes",
            f"Ray Train's callback classes are gone ({exc})",
            "stage fits use Ray Train's default callbacks (about 1.3 s more per fit, measured on Ray 2.60.0)",
        )
        return None


@functools.cache
def quick_stop_cleaner_class(base: type) -> type | None:
    """A ``PlacementGroupCleanerCallback`` subclass whose stop is sent without waiting (made once).

    Ray 2.60.0: ``PlacementGroupCleanerCallback._stop_cleaner`` does
    ``ray.get(self._cleaner.stop.remote(), timeout=...)``; the actor's stop joins a monitor
    thread that sleeps up to its 1 s check interval. Buys ~0.97 s of teardown per fit
    (``benchmarks/bench_startup.py``, docs/benchmarks.md "Stage fit start-up": 1.01 -> 0.04 s).
    Not waiting is safe: the controller has removed its placement group when the stop is sent.
    Fallback (no ``_stop_cleaner``): None, Ray's cleaner is kept as is and the stop waits.
    """
    if not callable(getattr(base, "_stop_cleaner", None)):
        _warn_once(
            "quick_stop_cleaner_class",
            f"{base.__qualname__} has no _stop_cleaner method",
            "each stage fit waits for the placement-group cleaner's stop again (about 1 s more per fit)",
        )
        return None

    class QuickStopCleanerCallback(base):  # type: ignore[misc, valid-type]
        def _stop_cleaner(self) -> None:
            cleaner = getattr(self, "_cleaner", None)
            if cleaner is None:
                return
            try:
                cleaner.stop.remote()
            except Exception:  # the cleaner already exited: nothing left to stop
                logger.debug("placement group cleaner already gone at stop", exc_info=True)
            finally:
                self._cleaner = None

    return QuickStopCleanerCallback


def lean_callbacks(callbacks: list[Any], *, has_datasets: bool) -> list[Any]:
    """Ray's default controller callbacks without ``DatasetsCallback`` (when no Ray datasets
    are passed) and with the cleaner's stop not waited for; unchanged if Ray moved them.

    Ray 2.60.0. The ``DatasetsCallback`` starts a ``DatasetManager`` actor per fit; cascade-ray
    passes no Ray datasets. Together with :func:`quick_stop_cleaner_class`: 1.33 s less per
    no-op fit (7.75 -> 6.42 s, 1 worker x 2 CPUs; 0.36 s of it start-up), docs/benchmarks.md
    "Stage fit start-up", commit 5112f70.
    """
    found = train_callback_classes()
    if found is None:
        return callbacks
    datasets_cls, cleaner_cls = found
    quick = quick_stop_cleaner_class(cleaner_cls)
    out = []
    for cb in callbacks:
        if isinstance(cb, datasets_cls) and not has_datasets:
            continue
        if quick is not None and type(cb) is cleaner_cls:
            if hasattr(cb, "_cleaner"):
                cb.__class__ = quick  # the same instance: Ray's check interval and timeouts
            else:
                _warn_once(
                    "quick_stop_cleaner_class",
                    "PlacementGroupCleanerCallback instances have no _cleaner attribute",
                    "each stage fit waits for the placement-group cleaner's stop again (about 1 s more per fit)",
                )
        out.append(cb)
    return out


class LeanTorchTrainer(TorchTrainer):
    """``TorchTrainer`` whose controller callbacks go through :func:`lean_callbacks`.

    Ray 2.60.0: overrides the private ``DataParallelTrainer._create_default_callbacks``, which
    ``fit()`` calls once. Fallback: when Ray no longer has that method, nothing is overridden
    (warned once at construction) and every fit runs Ray's callbacks; an error inside
    :func:`lean_callbacks` is warned once and Ray's callbacks are used for that fit.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not callable(getattr(TorchTrainer, "_create_default_callbacks", None)):
            _warn_once(
                "LeanTorchTrainer",
                "TorchTrainer has no _create_default_callbacks method",
                "stage fits use Ray Train's default callbacks (about 1.3 s more per fit, measured on Ray 2.60.0)",
            )

    def _create_default_callbacks(self) -> list[Any]:
        callbacks = super()._create_default_callbacks()
        try:
            return lean_callbacks(callbacks, has_datasets=bool(getattr(self, "datasets", None)))
        except Exception as exc:  # noqa: BLE001 - an optional speed-up never fails a fit
            _warn_once(
                "LeanTorchTrainer",
                f"changing Ray Train's default callbacks failed ({type(exc).__name__}: {exc})",
                "stage fits use Ray Train's default callbacks (about 1.3 s more per fit, measured on Ray 2.60.0)",
            )
            return callbacks


# --- wrap_worker_output_printer: --log-level's filter of forwarded worker output --------------

_RAY_PRINTER = "ray_print_logs"  # the handler name ray._private.worker.connect registers (Ray 2.60.0)


def wrap_worker_output_printer(
    wrap: Callable[[Callable[[dict[str, Any]], None]], Callable[[dict[str, Any]], None]],
) -> bool:
    """Replace Ray's printer of forwarded worker output (after ``ray.init``) by ``wrap(printer)``.

    Ray 2.60.0: ``ray.init(log_to_driver=True)`` registers ``print_to_stdstream`` as handler
    ``"ray_print_logs"`` on ``ray._private.ray_logging.global_worker_stdstream_dispatcher``.
    The wrapper replaces it in one list assignment (no batch is lost) and keeps the name, so
    Ray's shutdown removes it as its own. A second call wraps Ray's printer, not the first
    wrapper. Buys: ``--log-level info|warning`` hides Ray's INFO/WARNING records and the
    output of Ray's internal actors (``cascade_ray/logs.py``); errors are never hidden.
    Returns False without a warning when ``log_to_driver=False`` (no printer: nothing to
    filter). Fallback (dispatcher moved or changed): False, and every forwarded line is
    printed unfiltered, as with ``--log-level debug``.
    """
    consequence = "forwarded Ray worker output is printed unfiltered (as with --log-level debug)"
    try:
        dispatcher = _symbol("ray._private.ray_logging", "global_worker_stdstream_dispatcher")
        handlers = dispatcher.handlers
    except (ImportError, AttributeError) as exc:
        _warn_once("wrap_worker_output_printer", f"Ray's worker-output dispatcher is gone ({exc})", consequence)
        return False
    try:
        pairs = [(name, handler) for name, handler in handlers]
    except (TypeError, ValueError) as exc:
        _warn_once(
            "wrap_worker_output_printer",
            f"the dispatcher's handlers are not (name, handler) pairs ({exc})",
            consequence,
        )
        return False
    printers = [handler for name, handler in pairs if name == _RAY_PRINTER]
    if not printers:
        if pairs:  # handlers, but none of Ray's name: renamed
            _warn_once(
                "wrap_worker_output_printer", f"no {_RAY_PRINTER!r} handler among {[n for n, _ in pairs]}", consequence
            )
        return False  # log_to_driver=False: nothing is printed, nothing to filter
    original = getattr(printers[0], "ray_printer", printers[0])
    wrapped = wrap(original)
    wrapped.ray_printer = original  # type: ignore[attr-defined]
    dispatcher.handlers = [(name, wrapped if name == _RAY_PRINTER else handler) for name, handler in pairs]
    return True


# --- wait_for_tune_reports_taken: the Tune trial-actor deadlock workaround --------------------


def wait_for_tune_reports_taken(timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """In a Tune function trial: wait until Tune took the trial's last forwarded report.

    Ray 2.60.0: a trial function that returns while ``TuneReportCallback``'s last report
    still sits in the session's inter-actor queue (``_TrainSession._inter_actor_queue``) or
    ``result_queue`` deadlocks the trial actor, and the sweep waits forever (seen in a
    16-trial sweep on 2 CPUs, commit 77f0291; ``tests/integration/test_soak.py`` runs one).
    Returns True once both queues are empty, False on timeout or when the session cannot be
    read. Fallback (session moved or changed): returns at once; a sweep may hang again.
    """
    consequence = "a Tune trial returns without waiting for its last report (Ray 2.60 could deadlock the trial actor)"
    try:
        get_session = _symbol("ray.train._internal.session", "get_session")
    except (ImportError, AttributeError) as exc:
        _warn_once("wait_for_tune_reports_taken", f"Ray's Train session is gone ({exc})", consequence)
        return False
    session = get_session()
    result_queue = getattr(session, "result_queue", None)
    if session is None or result_queue is None or not hasattr(session, "_inter_actor_queue"):
        _warn_once(
            "wait_for_tune_reports_taken",
            f"the trial's session ({type(session).__name__}) has no result_queue / _inter_actor_queue",
            consequence,
        )
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        queue = session._inter_actor_queue  # created on the first report: read it each time
        if (queue is None or queue.empty()) and result_queue.empty():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


# --- uncount_asha_stop: the baseline trial's ASHA bookkeeping ---------------------------------


def uncount_asha_stop(scheduler: Any) -> None:
    """Undo the count of one STOP that a subclass of ASHA turned into CONTINUE.

    Ray 2.60.0: ``AsyncHyperBandScheduler.on_trial_result`` adds 1 to ``self._num_stopped``
    for every STOP it returns; the count is only shown in ``debug_string()`` ("Using
    AsyncHyperBand: num_stopped=N"). Buys an honest count in that string, nothing else.
    Fallback (no such counter): the string counts the baseline trial's overridden stops.
    """
    stopped = getattr(scheduler, "_num_stopped", None)
    if not isinstance(stopped, int):
        _warn_once(
            "uncount_asha_stop",
            f"{type(scheduler).__name__} has no integer _num_stopped",
            "ASHA's debug string 'num_stopped' also counts stops the baseline trial was spared",
        )
        return
    scheduler._num_stopped = stopped - 1


# --- autoscaling_status / autoscaler_node_groups: what the resource check may count on ---------

_NO_AUTOSCALER = (
    "an autoscaling cluster (cluster launcher, KubeRay) is checked as fixed at its alive nodes: a stage "
    "that needs nodes the autoscaler would add fails the resource check instead of waiting for them"
)


def autoscaling_status() -> bytes | None:
    """The autoscaler's status report (JSON bytes) as Ray's monitor publishes it, or None.

    Ray 2.60.0: ``ray.experimental.internal_kv._internal_kv_get(ray._private.ray_constants.DEBUG_AUTOSCALING_STATUS)``
    (what ``ray status`` reads). Buys: ``cascade_ray.pipeline.fit`` tells a real autoscaler
    from the read-only stand-in, so on a launcher/KubeRay cluster without published limits a
    stage that does not fit yet is a warning, not an error (``tests/unit/test_scaling.py``).
    None without a warning before ``ray.init``. Fallback (moved, or the read fails): None,
    i.e. "no autoscaler".
    """
    if not ray.is_initialized():
        return None
    try:
        key = _symbol("ray._private.ray_constants", "DEBUG_AUTOSCALING_STATUS")
        return _symbol("ray.experimental.internal_kv", "_internal_kv_get")(key)
    except Exception as exc:  # noqa: BLE001 - unknown means "no autoscaler" (the strict check)
        _warn_once(
            "autoscaling_status", f"reading the autoscaler status failed ({type(exc).__name__}: {exc})", _NO_AUTOSCALER
        )
        return None


def autoscaler_node_groups() -> tuple[tuple[dict[str, float], int], ...]:
    """``(resources per node, max nodes)`` of each autoscaler node group (-1: no limit); () if none.

    Ray 2.60.0: ``ray._private.state.state.get_cluster_config()`` (the ``ClusterConfig`` Ray
    Train's own worker-group check reads; None without an autoscaler). Buys: a stage may ask
    for nodes an autoscaler group can add, e.g. GPU workers on a cluster scaled to zero
    (``tests/unit/test_scaling.py``). () without a warning before ``ray.init``. Fallback
    (moved, or the read fails): (), the alive nodes only.
    """
    if not ray.is_initialized():
        return ()
    try:
        config = _symbol("ray._private.state", "state.get_cluster_config")()
        if config is None:
            return ()
        return tuple((dict(g.resources), int(g.max_count)) for g in config.node_group_configs)
    except Exception as exc:  # noqa: BLE001 - unknown means the alive nodes only (the strict check)
        _warn_once(
            "autoscaler_node_groups", f"reading the cluster config failed ({type(exc).__name__}: {exc})", _NO_AUTOSCALER
        )
        return ()


# --- detected_cpus: the embedded Ray's CPU count before it starts ------------------------------


def detected_cpus() -> float:
    """The CPUs an embedded ``ray.init()`` will detect on this machine.

    Ray 2.60.0: ``ray._private.utils.get_num_cpus()`` (cgroup/container-quota aware, what
    ``ray.init`` uses). Buys: the resource check before an embedded Ray starts agrees with
    Ray inside a CPU-limited container; on a plain machine it equals ``os.cpu_count()``
    (2 = 2 on the development machine, so nothing measured beyond that). Fallback (moved or
    failing): ``os.cpu_count()``; the check after ``ray.init`` still uses Ray's own count.
    """
    try:
        return float(_symbol("ray._private.utils", "get_num_cpus")())
    except Exception as exc:  # noqa: BLE001 - an early check only: fall back to the OS count
        _warn_once(
            "detected_cpus",
            f"Ray's CPU detection failed ({type(exc).__name__}: {exc})",
            "the resource check before an embedded Ray starts counts os.cpu_count() CPUs (a container's CPU "
            "quota is ignored until the check after ray.init)",
        )
        return float(os.cpu_count() or 1)


# --- pin_deployment_version: a Serve redeploy that only reconfigures ------------------------------


def pin_deployment_version(deployment: Any, version: str) -> bool:
    """Give a Serve deployment a fixed code version (in place); True when it took.

    Ray 2.60.0: ``serve.run`` sends ``Deployment._version or get_random_string()``
    (``ServeControllerClient.deploy_applications``), so every redeploy of an imperative app
    counts as new code and Serve restarts its replicas. With the same version on every deploy
    of the same code, a redeploy that changes only ``user_config`` makes Serve call
    ``reconfigure`` on the running replicas instead (seen: same replica process, about 1 s).
    Buys: ``cascade-ray serve --reload`` swaps the model in place; each replica keeps
    answering with the old model until the new one is loaded. Fallback (moved): the version
    stays random and a reload is Serve's rolling restart of the replicas (new replicas load
    the new run, old ones drain).
    """
    try:
        _symbol("ray.serve._private.client", "ServeControllerClient.deploy_applications")
        _symbol("ray.serve.deployment", "Deployment._version")
        if not hasattr(deployment, "_version"):
            raise AttributeError(f"{type(deployment).__name__} has no _version")
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        _warn_once(
            "pin_deployment_version",
            f"Serve's deployment version is gone ({exc})",
            "a reload restarts the replicas (Serve's rolling update) instead of reconfiguring them in place",
        )
        return False
    deployment._version = version
    return True


# --- worker_failure_cause: what killed a worker that died without an exception -----------------


def worker_failure_cause(failure: BaseException) -> BaseException | None:
    """The error a Ray Train worker-health-check failure wraps, or None (another kind of failure).

    Ray 2.60.0: a worker process that died without raising (SIGKILL, e.g. the kernel's OOM
    killer) is in ``WorkerGroupError.worker_failures`` as
    ``ray.train.v2._internal.exceptions.WorkerHealthCheckFailedError``, whose
    ``health_check_failure`` is Ray's public ``ActorDiedError``. Buys: the stage's error says a
    worker was killed and how to use less memory (``cascade_ray.pipeline.failures``,
    ``tests/e2e/test_faults.py``). Fallback (moved): None, and the stage fails with Ray's own
    ``WorkerGroupError`` (its text still mentions the OOM killer).
    """
    try:
        cls = _symbol("ray.train.v2._internal.exceptions", "WorkerHealthCheckFailedError.health_check_failure")
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        _warn_once(
            "worker_failure_cause",
            f"Ray Train's worker health-check error is gone ({exc})",
            "a killed worker is reported with Ray's own error, without cascade-ray's memory advice",
        )
        return None
    return getattr(failure, "health_check_failure", None) if isinstance(failure, cls) else None


def unreadable_run_errors() -> tuple[type[BaseException], ...]:
    """What ``ray.train.Result.from_path`` raises for a Ray run folder it cannot read back.

    Ray 2.60.0 raises ``RuntimeError`` without a snapshot and
    ``ray.train.v2._internal.exceptions.CheckpointManagerInitializationError`` (not a public
    class) when the snapshot names a checkpoint folder that is gone, e.g. the newest one
    ``train.checkpoint.save_last: false`` deleted. Buys: ``--resume`` trains such a stage afresh
    instead of failing (``cascade_ray.pipeline.fit.resumable_run``). Fallback (moved): only
    ``RuntimeError``, and such a folder fails the resume with Ray's own error.
    """
    try:
        cls = _symbol("ray.train.v2._internal.exceptions", "CheckpointManagerInitializationError")
    except (ImportError, AttributeError) as exc:
        _warn_once(
            "unreadable_run_errors",
            f"Ray Train's checkpoint-snapshot error is gone ({exc})",
            "a Ray run folder missing a checkpoint fails --resume with Ray's own error",
        )
        return (RuntimeError,)
    return (RuntimeError, cls)


RESUME_NOTICE = "A run snapshot was found in storage folder"  # how Ray 2.60.0's notice begins
PRESET_WARNING = "Pre-set value `"  # how Ray 2.60.0's warning about a points_to_evaluate value begins


class _DropRecords(logging.Filter):
    def __init__(self, drop: Callable[[str], bool]) -> None:
        super().__init__()
        self.drop = drop

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.drop(record.getMessage())


@contextlib.contextmanager
def _dropped_from(module: str, drop: Callable[[str], bool], shim: str, lost: str) -> Iterator[None]:
    """Records of Ray's `module` logger whose message `drop` accepts are dropped inside the block
    (a filter on that logger, removed after it). Fallback when the logger moved: one warning,
    nothing dropped."""
    try:
        ray_logger = _symbol(module, "logger")
        if not isinstance(ray_logger, logging.Logger):
            raise AttributeError(f"its logger is a {type(ray_logger).__name__}, not a logging.Logger")
    except (ImportError, AttributeError) as exc:
        _warn_once(shim, f"the logger of {module} is gone ({exc})", lost)
        yield
        return
    dropper = _DropRecords(drop)
    ray_logger.addFilter(dropper)
    try:
        yield
    finally:
        ray_logger.removeFilter(dropper)


def read_run_result(path: str) -> ray.train.Result:
    """``ray.train.Result.from_path(path)`` for a run that is only read back, without Ray's resume notice.

    Ray 2.60.0's checkpoint manager logs at INFO, whenever it loads a run folder's snapshot, "A run
    snapshot was found ... If you meant to start a brand new training job ... delete the existing
    folder": advice for a fit that resumes, printed here after every Tune sweep (the best trial is
    read back to adopt it) and by ``--resume``'s look at an earlier run, where nothing is resumed
    by Ray and nothing should be deleted. Buys: that notice is dropped (a filter on the checkpoint
    manager's module logger for the call's duration; every other record passes). Fallback
    (moved): the notice is printed.
    """
    with _dropped_from(
        _CHECKPOINT_MANAGER,
        lambda message: message.startswith(RESUME_NOTICE),
        "read_run_result",
        "reading a finished run back prints Ray's 'A run snapshot was found' resume notice",
    ):
        return ray.train.Result.from_path(path)


def quiet_preset_warnings(keys: Iterable[str]) -> contextlib.AbstractContextManager[None]:
    """Inside the block, Tune's warnings that a pre-set value of one of `keys` lies outside its domain are dropped.

    A random sweep's first trial runs the stage's configured values (``evaluate_current``), passed to
    Tune's ``BasicVariantGenerator`` as ``points_to_evaluate``; Ray 2.60.0's variant generator logs a
    WARNING, "Pre-set value `0.0` is not within valid values of parameter `solver.weight_decay`", for
    each such value outside the space, every time it generates the trials. cascade-ray runs that
    value on purpose (the sweep's baseline) and logs its own note saying so and how to turn it off
    (:func:`cascade_ray.tune.sweep.reference_note`). Buys: Tune's warning, which reads like a
    mistake, is dropped for `keys` only (a filter on the variant generator's module logger for the
    block's duration). Fallback (moved): Tune's warning is printed after cascade-ray's note.
    """
    wanted = tuple(f"parameter `{key}`" for key in keys)
    return _dropped_from(
        _VARIANT_GENERATOR,
        lambda message: message.startswith(PRESET_WARNING) and any(w in message for w in wanted),
        "quiet_preset_warnings",
        "Tune's 'Pre-set value ... is not within valid values' warning is printed beside cascade-ray's note",
    )


def missing_private_symbols(symbols: Iterable[PrivateSymbol] = PRIVATE_SYMBOLS) -> list[tuple[PrivateSymbol, str]]:
    """The symbols the installed Ray lacks, each with the error resolving it gave."""
    missing = []
    for symbol in symbols:
        try:
            resolve(symbol)
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            missing.append((symbol, f"{type(exc).__name__}: {exc}"))
    return missing
