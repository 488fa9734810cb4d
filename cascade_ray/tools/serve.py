"""The Ray Serve deployment of a trained cascade: ``POST /predict``, ``GET /healthz``, ``GET /info``.

cascade-ray serve ~/cascade-ray-runs/debug --port 8000          # blocks; Ctrl-C stops it
curl -s localhost:8000/predict -d '{"inputs": [[0, 1, ...64 values]]}'
cascade-ray serve --reload ~/cascade-ray-runs/debug-v2 --address 127.0.0.1:6379

Requests are validated one by one (``Cascade.check_inputs``) before they join a batch, so a
bad request is a 400 of its own and never fails the batch it would have joined; the rows of
concurrent requests are then run as one forward pass (``serve.batch``) and split back. A
reload is ``reconfigure`` with a new ``user_config``: the new run is loaded fully beside the
old one, checked against it, and only then swapped in; requests keep the model they started
with. The HTTP side is a plain Starlette handler, not FastAPI: three routes, and status codes
and messages fully ours (FastAPI answers a body it cannot parse with 422 and its own format).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from cascade_ray.errors import CascadeError
from cascade_ray.pipeline.artifacts import MANIFEST
from cascade_ray.pipeline.records import read_manifest
from cascade_ray.text import did_you_mean
from cascade_ray.tools.inference import Cascade, InputError, load_cascade, prediction_columns

logger = logging.getLogger("cascade_ray.serve")

DEPLOYMENT = "CascadeDeployment"
ROUTES = "POST /predict, GET /healthz, GET /info"


class ServeConfig(BaseModel):
    """The deployment's ``user_config``: checked again in every replica (it crosses a process boundary)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    run: str = Field(description="The run served: an absolute folder or an s3:// / gs:// URI (or a stage artifact).")
    stage: str | None = Field(default=None, description="The stage whose head predicts (default: the run's last).")
    max_batch_size: int = Field(default=32, ge=1, description="Most requests one forward pass takes.")
    batch_wait_ms: float = Field(default=5.0, ge=0, description="How long a batch waits for more requests.")
    max_rows: int = Field(default=1024, ge=1, description="Most rows one request may send (400 beyond).")
    replicas: int = Field(default=1, ge=1, description="Replica count the app was started with (kept on reload).")
    log_level: Literal["DEBUG", "WARNING"] = Field(
        default="WARNING", description="Serve's log level for the replicas (DEBUG adds the access log)."
    )
    trust: list[str] = Field(default_factory=list, description="--trust: packages the run's config may import from.")
    trust_run: bool = Field(default=True, description="Honor the run's own trusted_modules (off: --untrusted-run).")


@dataclass(frozen=True)
class Served:
    """A loaded cascade and what identifies it in responses."""

    cascade: Cascade
    run: str
    fingerprint: str
    pipeline: str

    @property
    def identity(self) -> dict[str, str]:
        return {"run": self.run, "stage": self.cascade.stage, "fingerprint": self.fingerprint}

    def info(self) -> dict[str, Any]:
        spec = self.cascade.spec
        return {
            **self.identity,
            "pipeline": self.pipeline,
            "input_shape": list(spec.input_shape),
            "target_kind": spec.target_kind,
            "out_width": spec.out_width,
            "class_names": list(spec.class_names) if spec.class_names else None,
        }


def load_served(
    run: str, stage: str | None = None, trust: list[str] | tuple[str, ...] = (), trust_run: bool = True
) -> Served:
    """Load a run for serving (weights verified); its fingerprint from the stage's manifest.

    `trust` and `trust_run` are those of :func:`load_cascade`.
    """
    cascade = load_cascade(run, stage=stage, trust=trust, trust_run=trust_run)
    manifest = read_manifest(cascade.run / "stages" / cascade.stage / MANIFEST)
    return Served(cascade, run, manifest.fingerprint, cascade.cfg.name)


def incompatibility(serving: Mapping[str, Any], fresh: Mapping[str, Any]) -> str | None:
    """Why the model `fresh` describes cannot replace the one `serving` describes (:meth:`Served.info`), or None.

    Clients are built against the pipeline, input shape, target kind and output width; a run
    that changes any of them is a new service, not a reload.
    """
    keys = ("pipeline", "input_shape", "target_kind", "out_width")
    diffs = [f"{k} {serving.get(k)!r} -> {fresh[k]!r}" for k in keys if serving.get(k) != fresh[k]]
    if not diffs:
        return None
    return (
        f"{fresh['run']} is not a newer run of the served pipeline ({'; '.join(diffs)}); "
        "serve it as a new app (cascade-ray serve RUN --name OTHER --port OTHER) instead of reloading"
    )


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def parse_inputs(body: bytes, cascade: Cascade, max_rows: int) -> torch.Tensor:
    """The checked input rows of a ``{"inputs": [...]}`` body, or :class:`InputError` saying what is wrong."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise InputError(f'the body is not JSON ({exc}); send {{"inputs": [[...], ...]}}') from None
    if not isinstance(payload, dict):
        raise InputError(f'the body must be a JSON object {{"inputs": [...]}}, got {type(payload).__name__}')
    unknown = [k for k in payload if k != "inputs"]
    if unknown:
        raise InputError(f"unknown key {unknown[0]!r}{did_you_mean(unknown[0], ['inputs'])}; the body takes 'inputs'")
    if "inputs" not in payload:
        raise InputError('the body has no "inputs": send {"inputs": [[...], ...]} (a list of rows)')
    inputs = payload["inputs"]
    if not isinstance(inputs, list) or not inputs:
        raise InputError(f"inputs must be a non-empty list of rows, got {type(inputs).__name__} {inputs!r:.60}")
    # before the values are read: a list of numbers is one flat row (its values), anything else a list of rows
    if isinstance(inputs[0], int | float):
        size = math.prod(cascade.spec.input_shape)
        if len(inputs) != size:
            raise InputError(
                f"inputs is a list of {len(inputs)} numbers; one flat row takes exactly {size}; "
                'send several rows as a list of rows: {"inputs": [[...], ...]}'
            )
    elif len(inputs) > max_rows:
        raise InputError(f"{len(inputs)} rows in one request; the server takes at most {max_rows} (--max-rows)")
    x = cascade.check_inputs(inputs)
    if len(x) > max_rows:  # flat rows reshaped into more rows than the list had
        raise InputError(f"{len(x)} rows in one request; the server takes at most {max_rows} (--max-rows)")
    return x


@serve.deployment(name=DEPLOYMENT)
class CascadeDeployment:
    """One replica: the served cascade, swapped in place by ``reconfigure``."""

    def __init__(self) -> None:
        self.model: Served | None = None
        self.config: ServeConfig | None = None
        self.last_error: str | None = None
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "loads": 0}
        self._loaded: tuple[str, str | None] | None = None  # (run, stage) as the config asked for them
        self._reload = asyncio.Lock()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve the run `user_config` names; keep the current model when it cannot be loaded or does not fit.

        The first load raises (a replica without a model never comes up); a failed reload is
        recorded in ``last_error`` (``/healthz``, ``info``) and the old model keeps serving.
        """
        config = ServeConfig.model_validate(user_config)
        self.batched.set_max_batch_size(config.max_batch_size)
        self.batched.set_batch_wait_timeout_s(config.batch_wait_ms / 1000)
        async with self._reload:
            self.config = config
            if self.model is not None and self._loaded == (config.run, config.stage):
                return  # a batching change only
            try:
                # loaded in a thread beside the old model: the event loop keeps answering requests
                new = await asyncio.to_thread(load_served, config.run, config.stage, config.trust, config.trust_run)
                why = incompatibility(self.model.info(), new.info()) if self.model is not None else None
                if why:
                    raise CascadeError(why)
            except Exception as exc:
                if self.model is None:
                    raise
                self.last_error = f"reload to {config.run} failed, still serving {self.model.run}: {exc}"
                logger.error("%s", self.last_error)
                return
            self.model, self.last_error, self._loaded = new, None, (config.run, config.stage)
            self.stats["loads"] += 1
            logger.info("serving %s (%s)", new.run, new.fingerprint)

    def info(self) -> dict[str, Any]:
        """What this replica serves: identity, input spec, config, batching counters, last reload error."""
        return {
            "model": self.model.info() if self.model else None,
            "config": self.config.model_dump() if self.config else None,
            "stats": dict(self.stats),
            "last_error": self.last_error,
            "pid": os.getpid(),  # a reload reconfigures in place: the same process before and after
        }

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def batched(self, models: list[Served], rows: list[torch.Tensor]) -> list[dict[str, Any]]:
        """One forward pass per model over the rows of every request in the batch, split back per request."""
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(rows))
        answers: list[dict[str, Any] | None] = [None] * len(rows)
        # during a reload one batch may hold requests for the old and the new model
        for model in {id(m): m for m in models}.values():
            idx = [i for i, m in enumerate(models) if m is model]
            x = torch.cat([rows[i] for i in idx])
            columns = prediction_columns(
                await asyncio.to_thread(model.cascade.outputs, x), model.cascade.spec.target_kind
            )
            start = 0
            for i in idx:
                part = {k: v[start : start + len(rows[i])] for k, v in columns.items()}
                start += len(rows[i])
                answer: dict[str, Any] = {"predictions": part["prediction"].tolist()}
                if "probabilities" in part:
                    answer["probabilities"] = part["probabilities"].tolist()
                labels = model.cascade.label_names(part["prediction"])
                if labels is not None:
                    answer["labels"] = labels
                note = model.cascade.spec.scale_warning(rows[i])
                if note:  # predicted all the same: the client hears why its answers may be wrong
                    answer["warning"] = note
                answers[i] = answer | {"model": model.identity}
        return answers  # type: ignore[return-value]

    async def __call__(self, request: Request) -> JSONResponse:
        route = (request.method, request.url.path.rstrip("/") or "/")
        try:
            if route[1] in ("/healthz", "/health"):
                if self.model is None:
                    return error(503, "no model loaded yet")
                return JSONResponse({"status": "ok", **self.model.identity, "last_error": self.last_error})
            if route == ("GET", "/info"):
                return JSONResponse(self.info())
            if route == ("POST", "/predict"):
                return await self._predict(request)
            if route[1] in ("/predict", "/info"):
                return error(405, f"{route[0]} {route[1]} is not a route; routes: {ROUTES}")
            return error(404, f"no route {route[0]} {route[1]}; routes: {ROUTES}")
        except Exception as exc:  # one line to the client, the traceback to the replica's log
            logger.exception("unexpected error on %s %s", *route)
            return error(500, f"internal error ({type(exc).__name__}: {str(exc)[:200]}); see the replica log")

    async def _predict(self, request: Request) -> JSONResponse:
        model, config = self.model, self.config  # a reload swaps these; this request keeps its model
        if model is None or config is None:
            return error(503, "no model loaded yet")
        try:
            rows = parse_inputs(await request.body(), model.cascade, config.max_rows)
        except InputError as exc:
            return error(400, str(exc))
        self.stats["requests"] += 1
        return JSONResponse(await self.batched(model, rows))


def build_app(config: ServeConfig) -> Any:
    """The Serve application of `config`: the same deployment options on every (re)deploy, so a
    redeploy that changes only the run is a ``reconfigure`` of the running replicas."""
    from cascade_ray import __version__
    from cascade_ray.ray_compat import pin_deployment_version

    deployment = CascadeDeployment.options(
        num_replicas=config.replicas,
        user_config=config.model_dump(),
        # serve.batch can only gather what Serve lets into the replica at once (Serve's default is 5)
        max_ongoing_requests=max(64, 2 * config.max_batch_size),
        logging_config={"log_level": config.log_level, "enable_access_log": config.log_level == "DEBUG"},
    )
    pin_deployment_version(deployment, f"cascade-ray-serve-{__version__}")
    return deployment.bind()
