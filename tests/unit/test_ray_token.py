"""The embedded Ray's token file is private: created 0600 in a 0700 folder, tightened, or refused."""

from __future__ import annotations

import stat

import pytest

from cascade_ray.errors import ConfigError
from cascade_ray.pipeline.ray_token import ensure_private_token


def _mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def test_a_new_token_is_created_0600_in_a_0700_folder_whatever_the_umask(home):
    import os

    old = os.umask(0o000)  # the worst case: Ray's own write would give 0666
    try:
        path = ensure_private_token()
    finally:
        os.umask(old)
    assert path == home / ".ray" / "auth_token"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # Ray's format: token_hex(32)
    assert ensure_private_token() == path and path.read_text() == token, "an existing token is kept"


def test_a_token_left_readable_by_an_earlier_ray_is_tightened(home):
    folder = home / ".ray"
    folder.mkdir(mode=0o755)
    (folder / "auth_token").write_text("abc")
    (folder / "auth_token").chmod(0o644)
    path = ensure_private_token()
    assert _mode(path) == 0o600 and _mode(folder) == 0o700 and path.read_text() == "abc"


def test_a_readable_token_path_of_the_user_is_refused_naming_the_file_and_chmod(home):
    mine = home / "token"
    mine.write_text("abc")
    mine.chmod(0o640)
    with pytest.raises(ConfigError) as err:
        ensure_private_token({"RAY_AUTH_TOKEN_PATH": str(mine)})
    assert "RAY_AUTH_TOKEN_PATH" in str(err.value) and str(mine) in str(err.value)
    assert f"chmod 600 {mine}" in str(err.value)
    assert _mode(mine) == 0o640, "the user's own file is not changed"
    mine.chmod(0o600)
    assert ensure_private_token({"RAY_AUTH_TOKEN_PATH": str(mine)}) == mine


@pytest.mark.parametrize("env", [{"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": "abc"}])
def test_no_file_when_auth_is_off_or_the_token_is_in_the_environment(home, env):
    assert ensure_private_token(env) is None
    assert not (home / ".ray").exists()
