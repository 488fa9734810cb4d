"""``cascade-ray submit``: run a pipeline on a Ray cluster as a job, through the job API.

The config is checked here first (schema, shapes, where the job would write), then the
working dir (the repo root: ``cascade_ray/`` and ``pipelines/``, ``.rayignore`` honoured)
is uploaded with the env knobs of :mod:`cascade_ray.constants` in the job's runtime_env,
and the job's logs are followed until it ends.

    eval "$(cluster/local_head.sh start)"
    cascade-ray submit pipelines/configs/debug.yaml storage_path=$PWD/runs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from pathlib import Path

from cascade_ray.errors import ConfigError, ConfigIssue

DEFAULT_SCRIPT = "pipelines/three_stage.py"


def add_submit_args(p: argparse.ArgumentParser) -> None:
    """Options of ``cascade-ray submit`` (after the config and its overrides)."""
    p.add_argument(
        "--address", default=None, help="the cluster's job API, e.g. http://127.0.0.1:8265 (default: RAY_ADDRESS)"
    )
    p.add_argument(
        "--working-dir",
        default=".",
        help="folder uploaded as the job's working dir, .rayignore/.gitignore honoured (default: %(default)s, the repo root)",
    )
    p.add_argument(
        "--script", default=DEFAULT_SCRIPT, help="pipeline script, relative to the working dir (default: %(default)s)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="pass --resume to the pipeline: reuse stage artifacts already in storage_path",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="pass --overwrite to the pipeline: train over a finished run"
    )
    p.add_argument("--break-lock", action="store_true", help="pass --break-lock to the pipeline: take the run lock")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return instead of following the logs")


def job_entrypoint(args: argparse.Namespace, storage_path: str) -> tuple[str, str, Path]:
    """``(entrypoint, job API address, working dir)`` for a submission, or every problem at once.

    Raises:
        ConfigError: the script or config is not inside the working dir, storage_path is
            relative (it would land in the job's temporary copy), or no address is known.
    """
    from cascade_ray.storage import parse_uri

    # absolute, symlinks kept: Ray's working_dir upload follows them, so pipelines/configs/x.yaml
    # (a symlink into cascade_ray/shipped/) reaches the job under the name the user gave
    workdir, config = Path(os.path.abspath(args.working_dir)), Path(os.path.abspath(args.config))
    if not config.is_relative_to(workdir):  # e.g. a symlinked working dir: compare real paths
        workdir, config = workdir.resolve(), config.resolve()
    address = args.address or os.environ.get("RAY_ADDRESS")
    issues = []
    if not (workdir / args.script).is_file():
        issues.append(
            ConfigIssue(
                "--script",
                f"{workdir / args.script} does not exist",
                "give the pipeline script's path inside --working-dir",
            )
        )
    if not config.is_relative_to(workdir):
        issues.append(
            ConfigIssue(
                "config",
                f"{config} is outside the working dir {workdir}, so the job would not get it",
                "move it under the working dir (`cascade-ray cp NAME .` copies a shipped config), or pass --working-dir",
            )
        )
    if parse_uri(storage_path) is None and not storage_path.startswith(("/", "~")):
        issues.append(
            ConfigIssue(
                "storage_path",
                f"relative path {storage_path!r} would land in the job's temporary working dir",
                "give an absolute path on shared storage, or s3://bucket/prefix, gs://bucket/prefix",
            )
        )
    if not address:
        issues.append(
            ConfigIssue(
                "--address",
                "no job API address",
                "pass --address http://HEAD:8265 or export RAY_ADDRESS (cluster/local_head.sh start prints it)",
            )
        )
    if issues:
        raise ConfigError(issues, source="cascade-ray submit")
    argv = [
        "python",
        args.script,
        "--config",
        str(config.relative_to(workdir)),
        *args.overrides,
        *(f"--trust={name}" for name in getattr(args, "trust", [])),
        *(["--resume"] if args.resume else []),
        *(["--overwrite"] if args.overwrite else []),
        *(["--break-lock"] if args.break_lock else []),
    ]
    return shlex.join(argv), address, workdir


def submit(args: argparse.Namespace, storage_path: str) -> int:
    """Submit the pipeline as a Ray job and (unless ``--no-wait``) follow its logs.

    Returns:
        0 when the job SUCCEEDED (or right away with ``--no-wait``), 1 when it FAILED or was STOPPED.
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    from cascade_ray.constants import apply_ray_env_defaults

    entrypoint, address, workdir = job_entrypoint(args, storage_path)
    client = JobSubmissionClient(address)  # token auth: RAY_AUTH_MODE=token + RAY_AUTH_TOKEN(_PATH)
    job_id = client.submit_job(
        entrypoint=entrypoint, runtime_env={"working_dir": str(workdir), "env_vars": apply_ray_env_defaults()}
    )
    print(f"submitted job {job_id} to {address}: {entrypoint}", flush=True)
    if args.no_wait:
        return 0
    asyncio.run(_follow(client, job_id))
    status = client.get_job_status(job_id)
    print(f"job {job_id}: {status.value}", flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1


async def _follow(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)
