"""Error types. Every error says what was found, where, and what to do.

All errors derive from :class:`CascadeError` and survive pickling, because they are
raised inside Ray workers and re-raised in the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class CascadeError(Exception):
    """Base class of every error cascade-ray raises on purpose."""

    exit_code: int = 1

    def __reduce__(self):  # picklable across actor boundaries
        return (self.__class__, self.args)


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration.

    Attributes:
        path: dotted key path, e.g. ``stages[1].solver.type``.
        message: what is wrong, including the offending value.
        fix: what to change, empty when the message already says it.
    """

    path: str
    message: str
    fix: str = ""

    def render(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class ConfigError(CascadeError):
    """A configuration is invalid. Carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, issues: list[ConfigIssue] | tuple[ConfigIssue, ...], source: str = "", note: str = ""):
        self.issues = tuple(issues)
        self.source = source
        self.note = note  # what was not checked because of these issues
        where = f" in {source}" if source else ""
        lines = [f"{len(self.issues)} problem(s){where}:"]
        lines += [f"  - {issue.render()}" for issue in self.issues]
        if note:
            lines.append(f"  ({note})")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (self.__class__, (self.issues, self.source, self.note))


class DataError(CascadeError):
    """Input data is missing or malformed."""

    exit_code = 2


class ResourceError(CascadeError):
    """A stage asks for more than the cluster can ever provide."""

    exit_code = 2


class RunLockedError(CascadeError):
    """Another driver holds the run lock of ``{storage_path}/{name}`` (see :mod:`cascade_ray.storage_lock`).

    Attributes:
        run: the run folder, without credentials.
        holder: what the lock file says: host, pid, user, started, heartbeat (may be partial).
        detail: how old the last heartbeat is, or why the holder counts as alive.
    """

    exit_code = 2

    def __init__(self, run: str, holder: dict, detail: str):
        self.run, self.holder, self.detail = run, dict(holder), detail
        who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "user", "started", "heartbeat") if k in holder)
        super().__init__(
            f"{run} is locked by another driver ({who or 'holder unreadable'}; {detail})\n"
            "    fix: wait for that run to end or stop it; a dead holder's lock is taken over on its own "
            "(dead pid on this host, or no heartbeat for the stale limit); to take the lock now, pass "
            "--break-lock (RunOptions(break_lock=True))"
        )

    def __reduce__(self):
        return (self.__class__, (self.run, self.holder, self.detail))


class RunFinishedError(CascadeError):
    """``{storage_path}/{name}`` holds a finished run (``summary.json``, status finished) and neither resume nor
    overwrite was asked."""

    exit_code = 2

    def __init__(self, run: str):
        self.run = run
        super().__init__(
            f"{run} holds a finished run (summary.json, status finished)\n"
            "    fix: pass --resume to reuse its stages whose fingerprint matches, --overwrite to train again "
            "and rewrite it (RunOptions(resume=True) / RunOptions(overwrite=True)), or choose another name= or storage_path="
        )

    def __reduce__(self):
        return (self.__class__, (self.run,))


class RunInterruptedError(CascadeError):
    """Ctrl-C during a stage's fit or a sweep: nothing of it was adopted; ``--resume`` continues it (from the
    stage's latest checkpoint, or the sweep's saved state)."""

    exit_code = 130  # as a shell reports a command ended by SIGINT


class FrozenDriftError(CascadeError):
    """A parameter or buffer that was meant to be frozen changed during a stage."""


class HealthError(CascadeError):
    """A runtime health rule (``stages[i].health``) fired: training diverged, stalled or is misconfigured.

    Attributes:
        rule: the rule's name, e.g. ``stall``.
        stage: the stage's name.
        step: the optimizer step at which it fired.
        detail: what was measured, with the numbers.
        key: the config key most likely to fix it.
        fix: what to change.
    """

    def __init__(self, rule: str, stage: str, step: int, detail: str, key: str, fix: str):
        self.rule, self.stage, self.step, self.detail, self.key, self.fix = rule, stage, step, detail, key, fix
        super().__init__(f"stage {stage!r}, optimizer step {step}: {rule}: {detail}\n    key: {key}\n    fix: {fix}")

    def __reduce__(self):
        return (self.__class__, (self.rule, self.stage, self.step, self.detail, self.key, self.fix))


class StageFailedError(CascadeError):
    """A stage's workers failed: a worker process died (killed by a signal, usually the out-of-memory
    killer), the storage is full or unreachable, or the training code raised (the exception and the frame
    it came from). Earlier stages' artifacts stay.

    Attributes:
        stage: the stage's name.
        detail: what happened, naming the process or the path.
        fix: what to change.
    """

    def __init__(self, stage: str, detail: str, fix: str):
        self.stage, self.detail, self.fix = stage, detail, fix
        super().__init__(f"stage {stage!r}: {detail}\n    fix: {fix}")

    def __reduce__(self):
        return (self.__class__, (self.stage, self.detail, self.fix))


class ArtifactError(CascadeError):
    """A stage artifact is missing, truncated or altered."""

    exit_code = 2


def innermost(error: BaseException, wanted: Callable[[BaseException], bool]) -> Any:
    """The innermost exception in `error`'s chain of causes (Ray's ``cause``, then ``__cause__``, at
    most 20 deep) for which `wanted` holds, or None. Innermost, because Ray's wrapper of an error raised
    in a worker or actor is an instance of its class too (``RayTaskError(HealthError)``), with the remote
    stack in its text."""
    found, seen = None, error
    for _ in range(20):
        if seen is None:
            break
        if wanted(seen):
            found = seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return found
