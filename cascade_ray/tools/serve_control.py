"""Start, reload and stop the served cascade (``cascade-ray serve``; ``api.serve``).

cascade-ray serve RUN [--host 127.0.0.1] [--port 8000] [--replicas N] [--watch POINTER]
cascade-ray serve --reload NEW_RUN [--name cascade] [--address HOST:PORT]

A reload loads the new run here first (weights verified) and checks it against what the app
serves, so a refusal comes back to the caller and the app is untouched; only then is the app
redeployed with the new run in its ``user_config`` (the replicas reconfigure in place, see
``tools/serve.py``), and every replica is asked which model it now serves.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from cascade_ray.errors import CascadeError, ConfigError, ConfigIssue
from cascade_ray.pipeline.driver import init_ray  # one way to start or join Ray, shared with the pipeline
from cascade_ray.storage import as_storage, parse_uri
from cascade_ray.tools.serve import ServeConfig, build_app, incompatibility, load_served

RELOAD_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Serving:
    """A started app: where it answers, its name and the Ray cluster it runs on (for ``--reload``).
    `token_auth`: the cluster takes only clients with its token (``RAY_AUTH_MODE=token``)."""

    url: str
    name: str
    gcs_address: str
    started_ray: bool
    model: dict[str, Any]
    token_auth: bool = False

    def reload_command(self, env: Mapping[str, str] | None = None) -> str:
        """The command that reloads this app, as another shell on this host runs it: with token auth,
        Ray's client sends the token only with ``RAY_AUTH_MODE=token`` (and finds it where this process
        did: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)."""
        env = os.environ if env is None else env
        prefix = ""
        if self.token_auth:
            prefix = "RAY_AUTH_MODE=token "
            if env.get("RAY_AUTH_TOKEN_PATH"):
                prefix += f"RAY_AUTH_TOKEN_PATH={shlex.quote(env['RAY_AUTH_TOKEN_PATH'])} "
        command = (
            f"{prefix}cascade-ray serve --reload NEW_RUN --name {shlex.quote(self.name)} --address {self.gcs_address}"
        )
        if self.token_auth and env.get("RAY_AUTH_TOKEN") and not env.get("RAY_AUTH_TOKEN_PATH"):
            command += "   # with this shell's RAY_AUTH_TOKEN"
        return command


def token_auth(started_ray: bool, env: Mapping[str, str] | None = None) -> bool:
    """Whether the cluster this process uses takes only clients with its token: one it started (Ray
    turns token auth on for a cluster ``ray.init()`` starts unless ``RAY_AUTH_MODE`` says otherwise), or
    one it joined with ``RAY_AUTH_MODE=token`` (it could not have joined one with auth on without)."""
    env = os.environ if env is None else env
    return env.get("RAY_AUTH_MODE", "token" if started_ray else "").lower() == "token"


def _port_in_use(host: str, port: int) -> str | None:
    """Why `host`:`port` cannot be listened on here (another process holds it), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def run_location(run: str) -> str:
    """`run` as every replica can read it: URIs as given, local folders absolute (replicas have another cwd)."""
    return run if parse_uri(run) else str(Path(run).expanduser().resolve())


def _serve_log_level(level: str) -> str:
    return "DEBUG" if level == "debug" else "WARNING"  # Serve's INFO lines (and access log) only with debug


def start_serving(
    run: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int = 1,
    max_batch_size: int = 32,
    batch_wait_ms: float = 5.0,
    max_rows: int = 1024,
    stage: str | None = None,
    name: str = "cascade",
    address: str | None = None,
    log_level: str = "info",
    trust: list[str] | tuple[str, ...] = (),
    trust_run: bool = True,
) -> Serving:
    """Deploy the cascade of `run` on Ray Serve (embedded Ray unless `address` / ``RAY_ADDRESS``).

    The run is loaded here first, so a wrong path or a damaged artifact is an error before
    Ray starts. Serve's proxy binds `host` only (default loopback).

    Raises:
        CascadeError: not a finished run, damaged artifact, or replicas that failed to start.
    """
    config = ServeConfig(
        run=run_location(run),
        stage=stage,
        max_batch_size=max_batch_size,
        batch_wait_ms=float(batch_wait_ms),
        max_rows=max_rows,
        replicas=replicas,
        log_level=_serve_log_level(log_level),
        trust=list(trust),
        trust_run=trust_run,
    )
    embedded = not (address or os.environ.get("RAY_ADDRESS") or ray.is_initialized())
    busy = _port_in_use(host, port) if embedded else None  # the proxy of a Ray started here binds it
    if busy:
        raise ConfigError(
            [
                ConfigIssue(
                    "--port",
                    f"{host}:{port} cannot be listened on: {busy} (another process holds it)",
                    "pass --port with a free port, or stop what listens there",
                )
            ]
        )
    served = load_served(config.run, stage, config.trust, config.trust_run)  # fail here, before Ray, on a bad run
    started = init_ray(address, log_level)
    # Serve's own INFO lines in this process ("Started Serve", "Connecting to existing Serve app ... will
    # not be applied", "Application ... is ready"): with --log-level debug only, as Ray's elsewhere
    logging.getLogger("ray.serve").setLevel(config.log_level)
    serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": config.log_level})
    try:
        serve.run(build_app(config), name=name, route_prefix="/")
    except Exception as exc:  # noqa: BLE001 - Serve's deploy errors carry replica tracebacks: one line here
        _stop(name, started)
        raise CascadeError(f"serve: {served.run} did not start: {str(exc).strip().splitlines()[-1][:500]}") from None
    gcs = ray.get_runtime_context().gcs_address
    return Serving(f"http://{host}:{port}", name, gcs, started, served.identity, token_auth(started))


def replica_infos(name: str, calls: int) -> list[dict[str, Any]]:
    """``info()`` of the app's replicas: `calls` handle calls (Serve spreads them over the replicas)."""
    handle = serve.get_app_handle(name)
    return [r.result(timeout_s=60) for r in [handle.info.remote() for _ in range(calls)]]


def reload_serving(
    run: str,
    *,
    name: str = "cascade",
    stage: str | None = None,
    address: str | None = None,
    log: Callable[[str], None] = print,
    trust: list[str] | tuple[str, ...] = (),
    trust_run: bool = True,
) -> dict[str, Any]:
    """Swap the app `name` to `run` in place; returns the new model's identity.

    Raises:
        CascadeError: no such app, `run` cannot be loaded, or it is not a newer run of the
            served pipeline (input spec, target kind or pipeline name differ); the app keeps
            serving its model.
    """
    location = run_location(run)
    new = load_served(location, stage, trust, trust_run)  # verified here: a damaged run never reaches the replicas
    told = ray.is_initialized() or bool(address or os.environ.get("RAY_ADDRESS"))
    if not ray.is_initialized():
        init_ray(address, "warning")  # no address: a local `ray start` cluster, else a new embedded Ray
    apps = serve.status().applications
    if name not in apps:
        shown = f"no app {name!r} on this cluster (apps: {', '.join(apps) or 'none'})"
        if told:
            raise CascadeError(f"serve: {shown}; pass --name")
        raise ConfigError(
            [
                ConfigIssue(
                    "--address",
                    f"{shown}: without --address or RAY_ADDRESS this process joined a local `ray start` cluster "
                    "or started a Ray of its own",
                    "pass --address HOST:PORT as the serving command printed it (its 'reload:' line), "
                    "or set RAY_ADDRESS",
                )
            ]
        )
    [current] = replica_infos(name, 1)
    why = incompatibility(current["model"], new.info())
    if why:
        raise CascadeError(f"serve: reload refused: {why}; still serving {current['model']['run']}")
    old = ServeConfig.model_validate(current["config"])
    config = old.model_copy(update={"run": location, "stage": stage, "trust": list(trust), "trust_run": trust_run})
    log(f"reloading {name}: {current['model']['run']} -> {location}")
    serve.run(build_app(config), name=name, route_prefix="/")
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    while True:
        infos = replica_infos(name, 4 * config.replicas)
        errors = {i["last_error"] for i in infos if i["last_error"]}
        if errors:  # a replica could not load it (e.g. storage it cannot reach): back to the old run
            serve.run(build_app(old), name=name, route_prefix="/")
            raise CascadeError(f"serve: reload failed on a replica, rolled back: {sorted(errors)[0]}")
        if all(i["model"]["run"] == location and i["model"]["fingerprint"] == new.fingerprint for i in infos):
            log(f"serving {location} ({new.fingerprint[:12]})")
            return new.identity
        if time.monotonic() > deadline:
            raise CascadeError(f"serve: replicas still not on {location} after {RELOAD_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


def read_pointer(pointer: str) -> str:
    """The run a "latest" pointer file (local or URI) names: its first non-empty line."""
    text = as_storage(pointer, "--watch").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise CascadeError(f"--watch {pointer}: the file is empty; write the path of a finished run into it")
    return lines[0]


def _stop(name: str, started_ray: bool) -> None:
    """Remove the app; shut Serve and Ray down when this process started Ray."""
    if started_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(name)


def _follow(pointer: str, watched: str | None, name: str, stage: str | None, args: Any = None) -> str | None:
    """One poll of ``--watch``: reload when the pointer names another run; returns the run it named.

    A bad pointer or run is printed and not retried until the pointer changes again; the app
    keeps serving its model.
    """
    try:
        target = read_pointer(pointer)
    except CascadeError as exc:
        print(f"error: {exc}")
        return watched
    if target == watched:
        return watched
    try:
        trust = {"trust": args.trust, "trust_run": not args.untrusted_run} if args is not None else {}
        reload_serving(target, name=name, stage=stage, **trust)
    except CascadeError as exc:
        print(f"error: {exc}")
    return target


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve_command(args: Any) -> int:
    """``cascade-ray serve``: reload (and return), or start and block until Ctrl-C, polling ``--watch``."""
    if args.reload:
        identity = reload_serving(
            args.reload,
            name=args.name,
            stage=args.stage,
            address=args.address,
            trust=args.trust,
            trust_run=not args.untrusted_run,
        )
        print(f"reloaded {args.name}: {identity['run']} (stage {identity['stage']}, {identity['fingerprint'][:12]})")
        return 0
    if not args.run:
        raise CascadeError("serve: pass the run to serve (cascade-ray serve RUN), or --reload NEW_RUN")
    run = read_pointer(args.watch) if args.watch and args.run == "-" else args.run
    serving = start_serving(
        run,
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_rows=args.max_rows,
        stage=args.stage,
        name=args.name,
        address=args.address,
        log_level=args.log_level,
        trust=args.trust,
        trust_run=not args.untrusted_run,
    )
    print(f"serving {serving.model['run']} (stage {serving.model['stage']}) at {serving.url}")
    print(f'  curl -s {serving.url}/predict -H "content-type: application/json" -d \'{{"inputs": [[...]]}}\'')
    print(f"  health: {serving.url}/healthz   spec: {serving.url}/info")
    print(f"  reload: {serving.reload_command()}")
    watched = read_pointer(args.watch) if args.watch else None
    # SIGTERM (what systemd, docker and Kubernetes send) stops it as Ctrl-C does: the app removed and the
    # Ray this process started shut down, instead of Ray's stack dump and its agents left running
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(args.watch_interval if args.watch else 3600)
            if not args.watch:
                continue
            watched = _follow(args.watch, watched, serving.name, args.stage, args)
    except KeyboardInterrupt:
        print("stopping")
    finally:
        _stop(serving.name, serving.started_ray)
    return 0
