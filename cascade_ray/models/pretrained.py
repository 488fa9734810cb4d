"""Pretrained imports: a state-dict file mapped onto a stage's module (``stages[i].pretrained``).

The file's keys go through one mapping (:func:`map_keys`: ``prefix`` filters and strips,
then ``rename`` replaces the longest matching key prefix) and are then checked against the
module's state dict: keys, shapes, dtype kinds (:func:`match_issues`, from the safetensors
header alone, so validation stays cheap) and finiteness (:func:`finite_issues`, which needs
the data). :func:`load_pretrained` does all of it and copies the tensors into the module,
cast to the module's dtypes.

``strict: false`` follows ``torch.nn.Module.load_state_dict(strict=False)``: module keys the
file lacks and mapped file keys the module lacks are both ignored (and listed in a note);
shapes must agree either way, and at least one key must match.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from cascade_ray.config.schema import PretrainedConfig
from cascade_ray.errors import ConfigError, ConfigIssue

PRETRAINED_SUFFIXES = (".safetensors", ".pt", ".pth")
# validate reads a file's data (for NaN/Inf) only up to this size; runs always read it
FINITE_CHECK_MAX_BYTES = 256 << 20
_SHOWN = 3  # keys listed per kind of mismatch

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

TensorMeta = dict[str, tuple[tuple[int, ...], torch.dtype]]


def file_issue(pretrained: PretrainedConfig, key: str) -> ConfigIssue | None:
    """The file is not a readable regular state-dict file (wrong suffix, absent, a FIFO, ...), or None.

    Only ``stat`` is used: opening a FIFO would block until a writer appears.
    """
    p = Path(pretrained.path).expanduser()
    if p.suffix not in PRETRAINED_SUFFIXES:
        return ConfigIssue(
            key,
            f"{pretrained.path!r} is not a .safetensors or .pt state-dict file",
            "export the state dict with safetensors.torch.save_file",
        )
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return ConfigIssue(
            key, f"file {str(p)!r} does not exist", "use an absolute path to an existing state-dict file"
        )
    except OSError as exc:
        return ConfigIssue(key, f"cannot stat {str(p)!r}: {exc}", "make the file readable by the driver")
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        return ConfigIssue(key, f"{str(p)!r} is {what}", "point it at a state-dict file")
    if not os.access(p, os.R_OK):
        return ConfigIssue(key, f"{str(p)!r} is not readable", "make the file readable by the driver")
    return None


def _check_framing(path: Path) -> None:
    """An oversized or damaged safetensors header is refused before safetensors allocates for it."""
    from cascade_ray.models.weights import safetensors_header_problem

    problem = safetensors_header_problem(path)
    if problem is not None:
        raise ValueError(problem)


def read_meta(path: str | Path) -> TensorMeta:
    """Key -> (shape, dtype) of a state-dict file; a safetensors file's header only."""
    p = Path(path).expanduser()
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        _check_framing(p)

        out: TensorMeta = {}
        with safe_open(str(p), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = f.get_slice(k)
                name = part.get_dtype()
                if name not in _ST_DTYPES:
                    raise ValueError(f"tensor {k!r} has dtype {name}, which cascade-ray does not load")
                out[k] = (tuple(part.get_shape()), _ST_DTYPES[name])
        return out
    return {k: (tuple(v.shape), v.dtype) for k, v in load_tensors(p).items()}


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A state-dict file's tensors on the CPU: safetensors, or torch with ``weights_only`` (no pickle code)."""
    p = Path(path).expanduser()
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        _check_framing(p)

        return load_file(str(p))
    state = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{p} does not hold a flat state dict of tensors")
    return state


def map_keys(keys: Iterable[str], pretrained: PretrainedConfig) -> tuple[dict[str, str], list[str]]:
    """Module key -> file key after ``prefix`` then ``rename``; and the collisions, in words."""
    rules = sorted(pretrained.rename.items(), key=lambda kv: len(kv[0]), reverse=True)
    mapped: dict[str, str] = {}
    collisions = []
    for key in sorted(keys):
        if not key.startswith(pretrained.prefix):
            continue
        new = key[len(pretrained.prefix) :]
        for old, repl in rules:  # longest first: the most specific rule wins
            if new.startswith(old):
                new = repl + new[len(old) :]
                break
        if new in mapped:
            collisions.append(f"{mapped[new]!r} and {key!r} both map to {new!r}")
            continue
        mapped[new] = key
    return mapped, collisions


def match_issues(
    file_meta: TensorMeta, module_meta: TensorMeta, pretrained: PretrainedConfig, key: str
) -> tuple[list[ConfigIssue], list[str]]:
    """Keys, shapes and dtype kinds of the file (after the mapping) against the module's.

    Returns:
        ``(errors, notes)``; notes say what ``strict: false`` ignores and which dtypes are cast.
    """
    where = f"{pretrained.path!r}" + (f" (after prefix {pretrained.prefix!r})" if pretrained.prefix else "")
    mapping, collisions = map_keys(file_meta, pretrained)
    if collisions:
        return [
            ConfigIssue(
                f"{key}.rename",
                f"{len(collisions)} key collision(s) in {where}: {'; '.join(collisions[:_SHOWN])}",
                "make the rename rules map distinct keys to distinct names",
            )
        ], []
    if not mapping:
        return [
            ConfigIssue(
                f"{key}.prefix",
                f"no key of {pretrained.path!r} starts with {pretrained.prefix!r} "
                f"(the file's keys: {_some(sorted(file_meta))})",
                _prefix_fix(file_meta, module_meta, pretrained) or "use a prefix the file's keys start with",
            )
        ], []
    missing = sorted(set(module_meta) - set(mapping))
    unexpected = sorted(set(mapping) - set(module_meta))
    common = sorted(set(module_meta) & set(mapping))
    wrong = [k for k in common if module_meta[k][0] != file_meta[mapping[k]][0]]
    errors: list[ConfigIssue] = []
    notes: list[str] = []
    if wrong:
        shown = "; ".join(f"{k!r}: file {file_meta[mapping[k]][0]}, module {module_meta[k][0]}" for k in wrong[:_SHOWN])
        errors.append(
            ConfigIssue(
                key,
                f"state dict in {where} does not match the module: wrong shape {len(wrong)} ({shown}"
                f"{', ...' if len(wrong) > _SHOWN else ''})",
                "build the module with the sizes the weights were trained with (stages[i].model kwargs)",
            )
        )
    if not common:
        errors.append(
            ConfigIssue(
                key,
                f"state dict in {where} does not match the module: no key in common "
                f"(file: {_some(list(mapping))}; module: {_some(sorted(module_meta))})",
                _prefix_fix(file_meta, module_meta, pretrained) or f"map the keys with {key}.prefix / {key}.rename",
            )
        )
    elif (missing or unexpected) and pretrained.strict:
        parts = [
            f"{label} {len(keys)} ({_some(keys)})"
            for label, keys in (("missing", missing), ("unexpected", unexpected))
            if keys
        ]
        fixes = [_rename_fix(missing, unexpected, pretrained, key), _prefix_fix(file_meta, module_meta, pretrained)]
        ignored = " and ".join(
            what
            for what, keys in (
                ("keep the fresh initialization of the missing keys", missing),
                ("ignore the unexpected keys", unexpected),
            )
            if keys
        )
        fixes.append(f"{key}.strict: false to {ignored}")
        errors.append(
            ConfigIssue(
                key,
                f"state dict in {where} does not match the module: {', '.join(parts)}",
                "; or ".join(f for f in fixes if f) + " (or save the state dict of this exact module)",
            )
        )
    elif missing or unexpected:
        notes.append(
            f"{key}: strict false: {len(missing)} module key(s) keep their fresh initialization ({_some(missing)}), "
            f"{len(unexpected)} file key(s) ignored ({_some(unexpected)})"
        )
    for k in common:
        (want, got) = module_meta[k][1], file_meta[mapping[k]][1]
        if want == got:
            continue
        if want.is_floating_point and not got.is_floating_point:
            errors.append(
                ConfigIssue(
                    key,
                    f"tensor {mapping[k]!r} of {pretrained.path!r} is {got}, but the module's {k!r} is {want}",
                    "save the floating-point weights, not a quantized or integer copy",
                )
            )
        elif got.is_floating_point and not want.is_floating_point:
            errors.append(
                ConfigIssue(
                    key,
                    f"tensor {mapping[k]!r} of {pretrained.path!r} is {got}, but the module's {k!r} is {want} "
                    "(a counter or index buffer)",
                    "save that buffer with its own integer dtype",
                )
            )
    cast = sorted({(str(file_meta[mapping[k]][1]), str(module_meta[k][1])) for k in common} - _SAME)
    if cast and not errors:
        kinds = ", ".join(f"{a} -> {b}" for a, b in cast)
        notes.append(f"{key}: tensors cast to the module's dtype ({kinds})")
    return errors, notes


def finite_issues(tensors: Mapping[str, torch.Tensor], key: str, path: str) -> list[ConfigIssue]:
    """A NaN or Inf in any floating-point tensor is an error naming the key (one issue per file)."""
    bad = [k for k, t in sorted(tensors.items()) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if not bad:
        return []
    return [
        ConfigIssue(
            key,
            f"{len(bad)} tensor(s) of {path!r} hold NaN or Inf: {_some(bad)}",
            "export the weights from a checkpoint taken before training diverged",
        )
    ]


def module_meta(module: nn.Module) -> TensorMeta:
    """Key -> (shape, dtype) of a module's state dict (works on the meta device)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def preflight_issues(
    pretrained: PretrainedConfig, module: nn.Module, key: str, *, read_bytes: float = 0
) -> list[ConfigIssue]:
    """Checks before Ray: the mapping against the file's header, and NaN/Inf in a file of at most
    `read_bytes` (validation reads files up to :data:`FINITE_CHECK_MAX_BYTES`, a run's driver all)."""
    problem = file_issue(pretrained, key)
    if problem is not None:
        return [problem]
    try:
        meta = read_meta(pretrained.path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file becomes a config issue naming it
        return [
            ConfigIssue(
                key, f"cannot read {pretrained.path!r}: {exc}", "point it at a readable .safetensors or .pt state dict"
            )
        ]
    errors, _ = match_issues(meta, module_meta(module), pretrained, key)
    if not errors and Path(pretrained.path).expanduser().stat().st_size <= read_bytes:
        errors = finite_issues(_mapped(load_tensors(pretrained.path), pretrained), key, pretrained.path)
    return errors


def load_pretrained(module: nn.Module, pretrained: PretrainedConfig, key: str) -> list[str]:
    """Check the file fully and copy its mapped tensors into `module` (cast to the module's dtypes).

    Returns:
        Notes to log (dtype casts, keys ``strict: false`` left out).

    Raises:
        ConfigError: the file is unreadable, does not fit the module, or holds NaN/Inf.
    """
    problem = file_issue(pretrained, key)
    if problem is not None:
        raise ConfigError([problem])
    try:
        tensors = load_tensors(pretrained.path)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is the config's problem
        raise ConfigError(
            [ConfigIssue(key, f"cannot read {pretrained.path!r}: {exc}", "point it at a readable state dict")]
        ) from None
    meta = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
    errors, notes = match_issues(meta, module_meta(module), pretrained, key)
    mapped = _mapped(tensors, pretrained)
    errors += finite_issues(mapped, key, pretrained.path) if not errors else []
    if errors:
        raise ConfigError(errors)
    own = module.state_dict()
    state = {k: t.to(own[k].dtype) for k, t in mapped.items() if k in own}
    module.load_state_dict(state, strict=pretrained.strict)
    return notes


def pretrained_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes, read in 1 MiB chunks; remembered per (path, size, mtime)."""
    p = Path(path).expanduser()
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA:
        h = hashlib.sha256()
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA[key] = h.hexdigest()
    return _SHA[key]


_SHA: dict[tuple[str, int, int], str] = {}


def _mapped(tensors: Mapping[str, torch.Tensor], pretrained: PretrainedConfig) -> dict[str, torch.Tensor]:
    mapping, _ = map_keys(tensors, pretrained)
    return {new: tensors[old] for new, old in mapping.items()}


_SAME = {(str(d), str(d)) for d in _ST_DTYPES.values()}


def _some(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f", ... {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "") if keys else "none"


def _rename_fix(missing: list[str], unexpected: list[str], pretrained: PretrainedConfig, key: str) -> str | None:
    """When a ``rename`` entry made the unexpected keys out of keys the module has (the missing ones, under
    the entry's source prefix): the fix that entry needs, since strict: false would leave them untrained."""
    gone = set(missing)
    for src, dst in (pretrained.rename or {}).items():
        undone = [u for u in unexpected if u.startswith(dst) and src + u[len(dst) :] in gone]
        if undone:
            back = [src + u[len(dst) :] for u in undone]
            return (
                f"{key}.rename maps {src!r} -> {dst!r}, but the module's keys are the ones before it "
                f"({_some(back)}): drop that entry, or map to the module's prefix (rename maps the file's "
                "key prefixes to the module's)"
            )
    return None


def _prefix_fix(file_meta: TensorMeta, module_meta: TensorMeta, pretrained: PretrainedConfig) -> str:
    """``set prefix: features.`` when stripping one more leading component of the file's keys (or a
    different one) makes more module keys match than the current mapping does."""
    current = len(set(map_keys(file_meta, pretrained)[0]) & set(module_meta))
    best, best_count = "", current
    heads = {k.split(".", 1)[0] + "." for k in file_meta if "." in k}
    for head in sorted(heads):
        for candidate in (head, pretrained.prefix + head):
            trial = pretrained.model_copy(update={"prefix": candidate})
            count = len(set(map_keys(file_meta, trial)[0]) & set(module_meta))
            if count > best_count:
                best, best_count = candidate, count
    if not best:
        return ""
    return f"set prefix: {best!r} ({best_count} of the module's {len(module_meta)} keys then match, now {current})"
