"""``cascade-ray doctor``: is this machine (and cluster) ready to run a cascade?

Each check prints ``ok``, ``warn`` or ``FAIL`` with the measured value and, when not ok,
what to do. The exit code is 1 when any check FAILs (a blocking problem), else 0.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

Check = tuple[str, str, str]  # (status, name, detail)

_MIN_VERSIONS = {"torch": (2, 2), "ray": (2, 60), "pyarrow": (14, 0), "pydantic": (2, 6)}
OBJECT_STORE_FRACTION = 0.3  # Ray's default object store size, as a fraction of RAM


def _version_tuple(text: str) -> tuple[int, int]:
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def check_packages() -> list[Check]:
    out: list[Check] = [("ok", "python", platform.python_version())]
    for name in ("torch", "ray", "pyarrow", "pydantic", "numpy", "safetensors", "sklearn", "yaml"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            out.append(("FAIL", name, f"not importable ({exc}); pip install -e . in this environment"))
            continue
        version = getattr(module, "__version__", "?")
        low = _MIN_VERSIONS.get(name)
        if low and _version_tuple(version) < low:
            out.append(("FAIL", name, f"{version} < {'.'.join(map(str, low))}: upgrade it"))
        else:
            out.append(("ok", name, version))
    try:
        importlib.import_module("ray.dashboard")
        out.append(("ok", "ray[default]", "dashboard present (job submission works)"))
    except ImportError:
        out.append(("warn", "ray[default]", "no dashboard: `ray job submit` will fail; pip install 'ray[default]'"))
    return out


def check_devices() -> list[Check]:
    import torch

    out: list[Check] = [("ok", "cpus", str(os.cpu_count()))]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        out += [("ok", "cuda", f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}: {names}")]
        out.append(
            (
                "ok" if torch.cuda.is_bf16_supported() else "warn",
                "bf16",
                "supported" if torch.cuda.is_bf16_supported() else "not supported: use precision fp16 or fp32",
            )
        )
    else:
        out.append(("ok", "cuda", f"none (torch {torch.__version__}); stages run on CPU with gloo"))
    return out


def check_shared_memory() -> list[Check]:
    shm = Path("/dev/shm")
    if not shm.exists():
        return [("warn", "/dev/shm", "missing: Ray falls back to /tmp for the object store (slower)")]
    free = shutil.disk_usage(shm).total
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    want = OBJECT_STORE_FRACTION * ram
    status = "ok" if free >= want else "warn"
    detail = f"{free / 2**30:.1f} GiB for a default object store of {want / 2**30:.1f} GiB"
    if status == "warn":
        detail += " (in Docker pass --shm-size, or set ray.init(object_store_memory=...))"
    return [(status, "/dev/shm", detail)]


def check_storage(storage: str | None) -> list[Check]:
    path = Path(storage or "~/cascade-ray-runs").expanduser()
    if "://" in str(storage or ""):
        from cascade_ray.checks.reach import storage_issues
        from cascade_ray.errors import ConfigError
        from cascade_ray.storage import as_storage

        try:
            where = as_storage(storage)
            issues = storage_issues(where)
        except ConfigError as exc:
            issues = list(exc.issues)
        if issues:
            return [("FAIL", "storage", issue.render()) for issue in issues]
        return [("ok", "storage", f"{where}: a probe object was written, read back and deleted")]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        return [("FAIL", "storage", f"{path} is not writable ({exc.strerror}); set storage_path to a writable folder")]
    return [("ok", "storage", f"{path} writable, {shutil.disk_usage(path).free / 2**30:.1f} GiB free")]


def check_cluster(address: str | None) -> list[Check]:
    target = address or os.environ.get("RAY_ADDRESS")
    if not target:
        return [("ok", "cluster", "no RAY_ADDRESS: pipelines start an embedded Ray")]
    import ray

    try:
        ray.init(address=target, logging_level="ERROR", log_to_driver=False)
        resources = ray.cluster_resources()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    except Exception as exc:  # noqa: BLE001 - any failure to connect is the finding
        from cascade_ray.pipeline.ray_token import unreachable_cluster

        issue = unreachable_cluster(target, exc)  # token auth, or nothing there
        return [("FAIL", "cluster", f"{issue.message}; {issue.fix}")]
    finally:
        if ray.is_initialized():
            ray.shutdown()
    shown = ", ".join(
        f"{k} {v:g}" for k, v in sorted(resources.items()) if k in ("CPU", "GPU", "memory") or not k.startswith("node:")
    )
    return [("ok", "cluster", f"{target}: {nodes} node(s); {shown}")]


def run_doctor(*, address: str | None = None, storage: str | None = None, write: Callable[[str], None] = print) -> int:
    """Run every check; print one line each; 1 if any FAILs."""
    checks = (
        check_packages() + check_devices() + check_shared_memory() + check_storage(storage) + check_cluster(address)
    )
    for status, name, detail in checks:
        write(f"{status:<4}  {name:<13} {detail}")
    failed = [name for status, name, _ in checks if status == "FAIL"]
    write(f"{len(checks)} checks, {len(failed)} blocking problem(s)" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_doctor())
