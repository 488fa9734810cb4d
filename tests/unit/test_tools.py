"""Small CLI tools: ls, cp, doctor."""

from __future__ import annotations

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
