"""Small CLI tools: ls, cp, doctor."""

from __future__ import annotations

from pathlib import Path

import pytest

import cascade_ray
from cascade_ray.cli import main as cli_main
from cascade_ray.tools.doctor import run_doctor


def test_ls_lists_every_shipped_config_and_space(capsys):
    assert cli_main(["ls"]) == 0
    out = capsys.readouterr().out
    for name in ("debug", "three_stage", "debug_joint", "space/encoder"):
        assert f"\n{name} " in "\n" + out


def test_cp_copies_and_never_overwrites(tmp_path, capsys):
    assert cli_main(["cp", "debug", str(tmp_path)]) == 0
    assert (tmp_path / "debug.yaml").read_text().startswith("#")
    assert cli_main(["cp", "debug", str(tmp_path)]) == 1
    assert "exists" in capsys.readouterr().err
    assert cli_main(["cp", "debg", str(tmp_path / "x.yaml")]) == 1
    assert "did you mean 'debug'" in capsys.readouterr().err


def test_doctor_passes_here_and_fails_on_unwritable_storage(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lines: list[str] = []
    assert run_doctor(storage=str(tmp_path), write=lines.append) == 0
    assert any(line.startswith("ok    torch") for line in lines)
    blocked = tmp_path / "file"
    blocked.write_text("")
    lines.clear()
    assert run_doctor(storage=str(blocked / "sub"), write=lines.append) == 1
    assert any(line.startswith("FAIL  storage") for line in lines)


def test_overrides_may_follow_options(capsys):
    from paths import CONFIGS, ROOT

    space = ROOT / "tune_spaces" / "encoder.yaml"
    # a bad override after --space is still an override: validated, exit 2, no Ray
    assert (
        cli_main(["tune", str(CONFIGS / "three_stage.yaml"), "--space", str(space), "stages.encoder.train.epochs=nope"])
        == 2
    )
    assert "stages[1].train.epochs" in capsys.readouterr().err


def test_cp_refuses_a_dangling_symlink_and_writes_nothing_through_it(tmp_path, capsys):
    link, target = tmp_path / "my.yaml", tmp_path / "elsewhere" / "target.yaml"
    (tmp_path / "elsewhere").mkdir()
    link.symlink_to(target)
    assert cli_main(["cp", "debug", str(link)]) == 1
    assert "is a symlink" in capsys.readouterr().err
    assert not target.exists()
    assert cli_main(["cp", "space/encoder", str(tmp_path / "no" / "such" / "dir.yaml")]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_a_shipped_name_is_a_config_unless_a_file_of_that_name_exists(tmp_path, monkeypatch, capsys):
    from cascade_ray.tools.shipped import SHIPPED

    monkeypatch.chdir(tmp_path)
    assert cli_main(["validate", "debug"]) == 0
    assert capsys.readouterr().out.startswith(f"{SHIPPED['config'] / 'debug.yaml'}: OK (3 stages")
    # a file path always wins: ./debug here is a broken config, not the shipped one
    (tmp_path / "debug").write_text("name: [\n")
    assert cli_main(["validate", "debug"]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert cli_main(["validate", "debugg"]) == 2
    err = capsys.readouterr().err
    assert "'debugg' does not exist and is not a shipped config; did you mean 'debug'?" in err
    assert cli_main(["validate", "nothing/like/it.yaml"]) == 2
    assert "'nothing/like/it.yaml' does not exist" in capsys.readouterr().err
    # a search space is not a pipeline config
    assert cli_main(["validate", "space/encoder"]) == 2


def test_a_space_is_found_by_its_shipped_name_unless_a_file_of_that_name_exists(tmp_path, monkeypatch):
    """--space takes the name `cascade-ray ls` prints (space/classifier) or the bare stem; a file path wins."""
    from cascade_ray.errors import ConfigError
    from cascade_ray.tools.shipped import SHIPPED, resolve_space

    monkeypatch.chdir(tmp_path)
    shipped = str(SHIPPED["space"] / "classifier.yaml")
    assert resolve_space("space/classifier") == shipped == resolve_space("classifier")
    (tmp_path / "classifier").write_text("stage: classifier\n")
    assert resolve_space("classifier") == "classifier"
    with pytest.raises(ConfigError, match="'space/clasifier' does not exist and is not a shipped space; did you mean"):
        resolve_space("space/clasifier")


def test_tune_default_is_the_packaged_spaces_folder():
    from cascade_ray.cli import build_parser, parse_args
    from cascade_ray.tools.shipped import SHIPPED

    args = parse_args(build_parser(), ["run", "debug", "--tune"])
    assert args.tune == str(SHIPPED["space"]) and (SHIPPED["space"] / "encoder.yaml").is_file()
    assert SHIPPED["space"].is_relative_to(Path(cascade_ray.__file__).parent)


def test_checkout_paths_are_relative_symlinks_into_the_package():
    """pipelines/configs and tune_spaces, the paths docs and commands use, are the packaged files."""
    import os

    from paths import ROOT

    from cascade_ray.tools.shipped import SHIPPED

    for link, kind in (("pipelines/configs", "config"), ("tune_spaces", "space")):
        path = ROOT / link
        assert path.is_symlink() and not os.path.isabs(os.readlink(path)), f"{link}: a relative symlink (any clone)"
        assert path.resolve() == SHIPPED[kind].resolve()


def test_submit_keeps_the_symlinked_config_path_the_user_gave(monkeypatch):
    """Ray's working_dir upload follows symlinks, so the job gets pipelines/configs/debug.yaml as a file."""
    from paths import ROOT

    from cascade_ray.cli import build_parser, parse_args
    from cascade_ray.tools.jobs import job_entrypoint

    monkeypatch.chdir(ROOT)
    args = parse_args(build_parser(), ["submit", "pipelines/configs/debug.yaml", "--address", "http://127.0.0.1:8265"])
    entrypoint, _, workdir = job_entrypoint(args, "/shared/runs")
    assert workdir == ROOT and "--config pipelines/configs/debug.yaml" in entrypoint, entrypoint
