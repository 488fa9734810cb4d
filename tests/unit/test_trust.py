"""Callables only from trusted code (issue 18, part 3): import paths in ``model.type`` / ``loss.type``
are refused before anything is imported unless they come from cascade-ray or a trusted package, and
the standard library never is. Each refused case runs the real entry point and checks that no file
appeared and no module was imported.

    pytest tests/unit/test_trust.py
"""

from __future__ import annotations

import sys

import pytest
from paths import CONFIGS

from cascade_ray.checks import load_config
from cascade_ray.cli import main as cli_main
from cascade_ray.config.trust import import_refusal, module_refusal
from cascade_ray.errors import ConfigError
from cascade_ray.models import ModelSpecError, resolve_factory
from cascade_ray.tools.inference import with_trust

DEBUG = CONFIGS / "debug.yaml"
MODEL_KEY = "stages[0].model.type"
# a sentinel package written to tmp_path: importing it creates a file, so "nothing was imported" is checkable
SENTINEL = "crsentinel"
_SENTINEL_INIT = """
import os
from os import system
open(os.environ["CR_SENTINEL_FILE"], "w").close()

def build(in_channels=1):
    import torch
    return torch.nn.Conv2d(in_channels, 16, 3, padding=1)
"""

# refused import paths: (model.type, a substring of the message)
STDLIB = "standard library is never importable"
REFUSED_TYPES = [
    ("os:system", STDLIB),
    ("subprocess:run", STDLIB),
    ("subprocess:Popen", STDLIB),
    ("builtins:eval", STDLIB),
    ("builtins:exec", STDLIB),
    ("posix:system", STDLIB),
    ("importlib:import_module", STDLIB),
    ("shutil:rmtree", STDLIB),
    ("pickle:loads", STDLIB),
    ("runpy:run_path", STDLIB),
    ("ctypes:CDLL", STDLIB),
    ("os.path:join", STDLIB),
    (f"{SENTINEL}:build", "is not trusted"),  # a user package nobody trusted
    (f"{SENTINEL}.sub:build", "is not trusted"),
    (f"{SENTINEL}:_private", "private attributes"),
    (f".{SENTINEL}:build", "not a dotted module name"),
    (f"{SENTINEL}/x:build", "not a dotted module name"),
    ("cascade_ray.models.registry:_import_callable", "private attributes"),
]

# key=value overrides that try to inject a callable (or trust the standard library): (overrides, key, substring)
OVERRIDE_CASES = [
    (["stages[0].model={type: 'os:system', command: 'touch pwned'}"], MODEL_KEY, STDLIB),
    (["stages[0].model.type=os:system", "stages[0].model.command=touch pwned"], MODEL_KEY, STDLIB),
    (["stages.features.model.type=builtins:eval"], MODEL_KEY, STDLIB),
    (["stages[0].loss.type=subprocess:run"], "stages[0].loss.type", STDLIB),
    (["trusted_modules=[os]", "stages[0].model.type=os:system"], MODEL_KEY, STDLIB),
    (["trusted_modules=[os]"], "trusted_modules[0]", "Python standard library"),
    ([f"stages[0].model={{type: '{SENTINEL}:build'}}"], MODEL_KEY, f"--trust {SENTINEL}"),
    ([f"trusted_modules=[{SENTINEL}]", f"stages[0].model.type={SENTINEL}:os.system"], MODEL_KEY, "not trusted"),
    ([f"trusted_modules=[{SENTINEL}]", f"stages[0].model.type={SENTINEL}:system"], MODEL_KEY, "standard library"),
    (  # a misspelt trusted package: still refused, and the near name is pointed out
        [f"trusted_modules=[{SENTINEL}s]", f"stages[0].model={{type: '{SENTINEL}:build'}}"],
        MODEL_KEY,
        f"trusted_modules lists '{SENTINEL}s', a misspelling?",
    ),
]


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    """A package on sys.path whose import creates ``{tmp_path}/imported``; that path is returned."""
    pkg = tmp_path / "site" / SENTINEL
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_SENTINEL_INIT)
    (pkg / "sub.py").write_text("from crsentinel import build\n")
    marker = tmp_path / "imported"
    monkeypatch.setenv("CR_SENTINEL_FILE", str(marker))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path)  # `touch pwned` would land here
    for name in [m for m in sys.modules if m.split(".")[0] == SENTINEL]:
        monkeypatch.delitem(sys.modules, name)
    yield marker
    for name in [m for m in sys.modules if m.split(".")[0] == SENTINEL]:
        del sys.modules[name]


def _nothing_ran(tmp_path, marker) -> None:
    assert not marker.exists(), "the sentinel package was imported"
    assert not any(m.split(".")[0] == SENTINEL for m in sys.modules)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(("type_name", "needle"), REFUSED_TYPES, ids=[t for t, _ in REFUSED_TYPES])
def test_refused_before_anything_is_imported(type_name, needle, sentinel, tmp_path, capsys):
    overrides = [f"stages[0].model={{type: '{type_name}', command: 'touch pwned'}}"]
    with pytest.raises(ConfigError) as info:
        load_config(DEBUG, overrides, trust=["cascade_ray"])
    issues = {i.path: i.render() for i in info.value.issues}
    assert set(issues) == {MODEL_KEY} and needle in issues[MODEL_KEY], issues
    assert "fix:" in issues[MODEL_KEY]
    with pytest.raises(ModelSpecError, match="importable|trusted|dotted|private"):
        resolve_factory(type_name, ["cascade_ray"])  # the registry refuses on its own too (workers, tools)
    capsys.readouterr()
    assert cli_main(["validate", str(DEBUG), *overrides]) == 2
    assert f"{MODEL_KEY}: " in capsys.readouterr().err
    _nothing_ran(tmp_path, sentinel)


@pytest.mark.parametrize(
    ("overrides", "key", "needle"), OVERRIDE_CASES, ids=[" ".join(o) for o, _, _ in OVERRIDE_CASES]
)
def test_an_override_cannot_inject_a_callable(overrides, key, needle, sentinel, tmp_path, capsys):
    assert cli_main(["validate", str(DEBUG), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"{key}: " in err and needle in err, err
    if "trusted_modules=" not in overrides[0]:  # the attribute-path cases import the trusted package, by design
        _nothing_ran(tmp_path, sentinel)
    assert not (tmp_path / "pwned").exists()


def test_trusting_the_package_allows_it_and_its_submodules(sentinel, capsys):
    model = f"stages[0].model={{type: '{SENTINEL}.sub:build', in_channels: 1}}"
    assert cli_main(["validate", str(DEBUG), model]) == 2  # not trusted: refused
    assert not sentinel.exists()
    capsys.readouterr()
    assert cli_main(["validate", str(DEBUG), model, "--trust", SENTINEL]) == 0, capsys.readouterr().err
    assert sentinel.exists()  # the positive control: the sentinel does create its file when imported
    cfg = load_config(DEBUG, [model], trust=[SENTINEL])
    assert cfg.trusted_modules == [SENTINEL]  # saved with the run's config.yaml


@pytest.mark.parametrize("name", ["os", "builtins", "subprocess", "importlib.util", "../x", "", "a b"])
def test_trust_flag_refuses_the_standard_library_and_non_names(name, capsys):
    assert cli_main(["validate", str(DEBUG), "--trust", name]) == 2
    assert "--trust: " in capsys.readouterr().err
    assert module_refusal(name) is not None


def test_prefix_match_is_on_dotted_names():
    assert import_refusal("mypkg.models:Net", ["mypkg"]) is None
    assert import_refusal("mypkg:Net", ["mypkg"]) is None
    assert import_refusal("mypkg.models:Net", ["mypkg.models"]) is None
    assert "not trusted" in import_refusal("mypkg:Net", ["mypkg.models"])
    assert "not trusted" in import_refusal("mypkgx:Net", ["mypkg"])
    assert "not trusted" in import_refusal("mypkg:Net", ["my"])
    assert import_refusal("cascade_ray.models.mlp:mlp", []) is None  # cascade-ray's own, always


def test_a_run_config_trust_can_be_ignored_or_extended(debug_raw):
    debug_raw["trusted_modules"] = ["user_models"]
    from cascade_ray.checks import validate_config

    cfg = validate_config(debug_raw)
    assert with_trust(cfg).trusted_modules == ["user_models"]  # your own run: its list is honored
    assert with_trust(cfg, trust_run=False).trusted_modules == []  # --untrusted-run
    assert with_trust(cfg, ["mypkg"], trust_run=False).trusted_modules == ["mypkg"]
    with pytest.raises(ConfigError, match="--trust"):
        with_trust(cfg, ["os"])
    tampered = cfg.model_copy(update={"trusted_modules": ["subprocess"]})  # a config.yaml edited by hand
    with pytest.raises(ConfigError, match="trusted_modules"):
        with_trust(tampered)


def test_the_misspelling_hint_is_not_given_for_a_trusted_subpackage():
    from cascade_ray.config.trust import import_refusal

    assert "a misspelling?" in import_refusal("mypkg.heads:Head", ["mypkgs"])
    refusal = import_refusal("mypkg.heads:Head", ["mypkg.model"])  # trusts a part of mypkg, spelled right
    assert "is not trusted" in refusal and "misspelling" not in refusal
