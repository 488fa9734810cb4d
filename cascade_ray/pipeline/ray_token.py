"""The token an embedded Ray uses stays readable by this user only.

Ray 2.60's ``ray.init()``, when it starts a local cluster, turns token auth on and, if no token
exists yet, writes one to ``~/.ray/auth_token`` with the process umask (0644 seen: every user of a
shared host could read it and run code on the cluster). Before an embedded ``ray.init`` we create
that file ourselves, mode 0600 in a 0700 ``~/.ray``, with the same kind of token Ray generates
(``secrets.token_hex(32)``); Ray then finds it and writes nothing. A token file left readable by an
earlier Ray is tightened (that is the file Ray would use). Only public knobs are involved: the
token sources Ray documents (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) and
``RAY_AUTH_MODE``; no private Ray API.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from cascade_ray.errors import ConfigError, ConfigIssue

logger = logging.getLogger(__name__)

PRIVATE_MODE_BITS = 0o077  # group and others: none of them may be set on a token file


def default_token_path() -> Path:
    """Where Ray looks for a token when neither ``RAY_AUTH_TOKEN`` nor ``RAY_AUTH_TOKEN_PATH`` is set."""
    return Path.home() / ".ray" / "auth_token"


def ensure_private_token(env: Mapping[str, str] | None = None) -> Path | None:
    """Before an embedded ``ray.init()``: make the token file Ray will use private; its path.

    None when Ray writes no file: ``RAY_AUTH_MODE`` set to anything but ``token`` (auth off) or the
    token given in ``RAY_AUTH_TOKEN``.

    Raises:
        ConfigError: ``RAY_AUTH_TOKEN_PATH`` names a file readable by group/others (naming the file
            and ``chmod 600``), or ``~/.ray`` cannot be written.
    """
    env = os.environ if env is None else env
    mode = env.get("RAY_AUTH_MODE")
    if (mode is not None and mode.lower() != "token") or env.get("RAY_AUTH_TOKEN"):
        return None
    if env.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(env["RAY_AUTH_TOKEN_PATH"]).expanduser()
        # the user's own file: refused, not changed (the same rule as cluster/local_head.sh --token-file)
        if path.is_file() and path.stat().st_mode & PRIVATE_MODE_BITS:
            raise ConfigError([_readable_issue("RAY_AUTH_TOKEN_PATH", path)])
        return path
    path = default_token_path()
    try:
        _private_folder(path.parent)
        _create_or_tighten(path)
    except OSError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    "HOME",
                    f"cannot write Ray's token file {path}: {exc.strerror or exc}",
                    "make ~/.ray writable, or put a token in a file of mode 0600 and set RAY_AUTH_TOKEN_PATH to it",
                )
            ]
        ) from None
    return path


def _readable_issue(key: str, path: Path) -> ConfigIssue:
    mode = stat.S_IMODE(path.stat().st_mode)
    return ConfigIssue(
        key,
        f"token file {path} is readable by group/others (mode {mode:04o}); anyone who reads it can run code on the cluster",
        f"chmod 600 {path}",
    )


def _private_folder(folder: Path) -> None:
    """``~/.ray`` as 0700: created so, or tightened (it holds nothing but the user's Ray credentials)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(folder.stat().st_mode) & PRIVATE_MODE_BITS:
        folder.chmod(0o700)


def _create_or_tighten(path: Path) -> None:
    try:
        # O_EXCL with mode 0600: the token is never readable by others, not even for an instant
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if stat.S_IMODE(path.stat().st_mode) & PRIVATE_MODE_BITS:
            path.chmod(0o600)
            logger.warning("Ray's token file %s was readable by group/others; set it to mode 0600", path)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what Ray's own generator writes (256 bits)


def unreachable_cluster(target: str, exc: BaseException, env: Mapping[str, str] | None = None) -> ConfigIssue:
    """Why ``ray.init(address=target)`` found no cluster it could join, and what to do. Most often the
    cluster takes only clients with its token: Ray's client sends one only with ``RAY_AUTH_MODE=token``
    (Ray turns token auth on for a cluster ``ray.init()`` starts, which includes an embedded Ray of
    ``cascade-ray serve``, and for ``ray start`` with ``RAY_AUTH_MODE=token``)."""
    env = os.environ if env is None else env
    where = "check that a cluster runs there (`ray status --address " + target + "`)"
    if env.get("RAY_AUTH_MODE", "").lower() == "token":
        fix = f"{where}, and that this process has its token (RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or ~/.ray/auth_token)"
    else:
        fix = (
            "if the cluster uses token auth, set RAY_AUTH_MODE=token here (its token from RAY_AUTH_TOKEN_PATH, "
            f"RAY_AUTH_TOKEN or ~/.ray/auth_token); else {where}"
        )
    return ConfigIssue("--address / RAY_ADDRESS", f"no Ray cluster could be joined at {target} ({exc})", fix)
