"""A sha256 sidecar for the Tune experiment state a sweep writes, verified before a restore.

``tune --resume`` hands ``{run}/tune/<stage>/tune/`` to ``Tuner.restore``, which unpickles
``tuner.pkl`` (and decodes cloudpickled values in ``experiment_state-*.json``) on the driver:
whoever can write that folder could run code there. So cascade-ray records the sha256 of every
state file Tune restores from (``*.pkl`` and ``*.json`` directly in the experiment folder) in
``{run}/tune/<stage>/tune_state.sha256`` (``sha256sum`` format), and :func:`verify_state`
checks it before Tune reads a byte.

When it is written: when ``tuner.fit()`` returns (Ray has synced its final state by then),
and during the sweep by :class:`StateDigestCallback` at most every
``STATE_DIGEST_INTERVAL_S`` seconds after Ray's own experiment checkpoint, so a sweep whose
driver died mid-way can still be resumed. A driver killed between Ray's write and the next
digest leaves a stale sidecar: the resume then fails closed (start a fresh sweep, or pass
``--trust-tune-state`` after checking the folder).
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from typing import Any

from ray import tune

from cascade_ray.errors import ArtifactError
from cascade_ray.storage import StorageDir, as_storage, full_uri

STATE_SIDECAR = "tune_state.sha256"
STATE_DIGEST_INTERVAL_S = 10.0
_RESTORE_FILE = "tuner.pkl"  # what Tuner.can_restore looks for


def _state_files(experiment: StorageDir) -> list[StorageDir]:
    """The files Tune restores an experiment from: ``*.pkl`` / ``*.json`` directly in its folder."""
    if not experiment.is_dir():
        return []
    return sorted(
        (p for p in experiment.iterdir() if p.name.endswith((".pkl", ".json")) and p.is_file()), key=lambda p: p.name
    )


def drop_state(exp_dir: StorageDir) -> None:
    """Remove the Tune state a restore would read (``tune/*.pkl|json``) and its sidecar, before a sweep
    that does not continue it: a new Tuner adds its own state beside an old one, and Ray restores the
    newest by file name (local time, one-second resolution), so an old state left there could be
    restored under new values. Trial folders stay (the new trials' ids differ)."""
    for p in _state_files(exp_dir / "tune"):
        p.unlink()
    (exp_dir / STATE_SIDECAR).unlink(missing_ok=True)


def state_digest(experiment: StorageDir) -> str:
    """``sha256sum`` lines (``<hex>  <name>``) of the experiment folder's state files, sorted by name."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in _state_files(experiment)]
    return "".join(lines)


def write_state(exp_dir: StorageDir) -> None:
    """Record the digest of ``exp_dir/tune``'s state files in ``exp_dir/tune_state.sha256``."""
    (exp_dir / STATE_SIDECAR).write_text(state_digest(exp_dir / "tune"))


def verify_state(exp_dir: StorageDir, *, trust_state: bool = False) -> None:
    """Check ``exp_dir/tune`` against its sidecar before ``Tuner.restore`` unpickles it.

    Nothing to check when there is no Tune state (a fresh sweep). `trust_state`
    (``--trust-tune-state``) skips the check.

    Raises:
        ArtifactError: state without a sidecar, a file whose sha256 differs, or a state file
            the sidecar does not list (or one it lists that is gone); the message names the
            file and how to go on.
    """
    experiment, sidecar = exp_dir / "tune", exp_dir / STATE_SIDECAR
    if trust_state or not (experiment / _RESTORE_FILE).exists():
        return
    how = (
        f"start a fresh sweep (delete {experiment} or use another storage_path), or, if you wrote that folder "
        "yourself and it was only interrupted, pass --trust-tune-state"
    )
    if not sidecar.is_file():
        raise ArtifactError(
            f"{experiment}/{_RESTORE_FILE}: no {sidecar.name} beside it, so cascade-ray cannot tell that it wrote "
            f"this Tune state (restoring unpickles it: code); {how}"
        )
    expected = {}
    for line in sidecar.read_text().splitlines():
        digest, _, name = line.partition("  ")
        expected[name] = digest
    actual = {name: digest for digest, _, name in (ln.partition("  ") for ln in state_digest(experiment).splitlines())}
    for name in sorted(set(expected) | set(actual)):
        if expected.get(name) != actual.get(name):
            what = (
                "is not listed in"
                if name not in expected
                else "is missing but listed in"
                if name not in actual
                else "does not match its sha256 in"
            )
            raise ArtifactError(f"{experiment}/{name} {what} {sidecar}; restoring would unpickle it; {how}")


class StateDigestCallback(tune.Callback):
    """Rewrites the sidecar during a sweep, after Ray's experiment checkpoint (``on_step_end``
    follows it), at most every ``STATE_DIGEST_INTERVAL_S``; picklable (Tune pickles callbacks
    into ``tuner.pkl``), so it holds the folder's URI, not a file system object."""

    def __init__(self, exp_dir: StorageDir, interval_s: float = STATE_DIGEST_INTERVAL_S):
        self.exp_uri = full_uri(exp_dir)
        self.interval_s = interval_s
        self._last: float | None = None  # never written: the first step writes (not "monotonic 0", a boot time)

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval_s:
            self._last = now
            write_state(as_storage(self.exp_uri))

    def on_experiment_end(self, trials: list[Any], **info: Any) -> None:
        write_state(as_storage(self.exp_uri))

    def __getstate__(self) -> dict[str, Any]:
        return {"exp_uri": self.exp_uri, "interval_s": self.interval_s, "_last": None}


# set when Ctrl-C (SIGINT) reaches the driver during a sweep's fit (:class:`InterruptWatch`)
_INTERRUPTED = threading.Event()


class InterruptWatch(tune.Callback):
    """Notes a Ctrl-C (or SIGUSR1) during ``Tuner.fit``, so the sweep is not taken as finished.

    On SIGINT or SIGUSR1 Ray Tune 2.60 saves the experiment and returns from ``fit`` as if the sweep had
    ended: the trials it stopped look finished, the trials it never started are missing, and
    nothing in the result grid says so. Tune installs its SIGINT handler before it sets up its
    callbacks; ``setup`` puts a handler in front of Tune's that records the signal and passes it on
    (Tune's then saves the state as before). Only from the main thread, where signals are delivered.
    """

    def setup(self, **info: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # Tune stops the sweep on SIGUSR1 as well (a scheduler's preemption warning, e.g. Slurm --signal)
        for sig in _stop_signals():
            signal.signal(sig, _noting(signal.getsignal(sig)))


def _noting(tunes: Any) -> Any:
    """`tunes` (the handler Tune installed) behind one that records the signal first."""

    def noted(sig: int, frame: Any) -> None:
        if tunes == signal.SIG_IGN:  # ignored before Tune (TUNE_DISABLE_SIGINT_HANDLER in a background job)
            return
        _INTERRUPTED.set()
        if callable(tunes):
            tunes(sig, frame)
        elif sig == signal.SIGINT:  # Tune's handler not installed (TUNE_DISABLE_SIGINT_HANDLER): Python's default
            raise KeyboardInterrupt

    return noted


def watch_interrupts() -> None:
    """Forget an earlier sweep's Ctrl-C (call before ``Tuner.fit``)."""
    _INTERRUPTED.clear()


def interrupted() -> bool:
    """Whether Ctrl-C reached the driver since :func:`watch_interrupts`."""
    return _INTERRUPTED.is_set()


def _stop_signals() -> tuple[signal.Signals, ...]:
    return (signal.SIGINT, *((signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()))


def signal_handlers() -> dict[signal.Signals, Any]:
    """The handlers of the signals Tune stops a sweep on (SIGINT, SIGUSR1); empty outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in _stop_signals()}


def restore_signal_handlers(handlers: dict[signal.Signals, Any]) -> None:
    """Put back :func:`signal_handlers`' handlers: Ray Tune 2.60 leaves its stop handler installed after a
    sweep, so a later Ctrl-C (the next stage) would only set a finished sweep's flag and be lost."""
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
