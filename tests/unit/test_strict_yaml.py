"""The strict YAML reader (cascade_ray.config.yaml_io): YAML 1.2 core scalars where PyYAML reads
YAML 1.1, duplicate keys, the size cap, the alias budget and UTF-8, each as a ConfigError.

    pytest tests/unit/test_strict_yaml.py
"""

from __future__ import annotations

import time

import pytest
import yaml

from cascade_ray.config.loader import yaml11_fix
from cascade_ray.config.yaml_io import MAX_CONFIG_BYTES, MAX_YAML_NODES, parse_yaml, read_yaml
from cascade_ray.errors import ConfigError
from cascade_ray.text import short_repr

# (plain scalar, what PyYAML's SafeLoader makes of it, what this reader makes of it)
SCALARS = [
    ("1:30", 90, "1:30"),
    ("0x1_F", 31, "0x1_F"),
    ("0o1_7", "0o1_7", "0o1_7"),
    ("010", 8, "010"),
    ("yes", True, "yes"),
    ("No", False, "No"),
    ("on", True, "on"),
    ("OFF", False, "OFF"),
    ("2024-01-01", __import__("datetime").date(2024, 1, 1), "2024-01-01"),
    ("1e-3", "1e-3", 0.001),
    ("0x1F", 31, 31),
    ("0o17", "0o17", 15),
    ("1_000", 1000, 1000),
    ("-7", -7, -7),
    ("true", True, True),
    ("FALSE", False, False),
    ("~", None, None),
    (".inf", float("inf"), float("inf")),
]
BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)
)


@pytest.mark.parametrize(("text", "pyyaml", "ours"), SCALARS, ids=[s[0] for s in SCALARS])
def test_plain_scalars_follow_yaml_1_2(text, pyyaml, ours):
    assert yaml.safe_load(f"v: {text}")["v"] == pyyaml  # the YAML 1.1 reading this module exists to refuse
    got = parse_yaml(f"v: {text}")["v"]
    assert got == ours and type(got) is type(ours)


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("1:30", "write 90"),
        ("0x1_F", "write 31"),
        ("0o1_7", "write 15"),
        ("010", "write 10"),
        ("yes", "write a number"),
    ],
)
def test_yaml_1_1_numbers_get_the_number_to_write(value, fix):
    assert fix in yaml11_fix(value)
    assert "write true/false" in yaml11_fix("off", "bool")
    assert yaml11_fix("features") == "" and yaml11_fix("1" * 100) == ""


def test_duplicate_keys_name_the_path_and_both_lines():
    with pytest.raises(ConfigError) as info:
        parse_yaml("a:\n  b: 1\n  c: {d: 1}\n  b: 2\n")
    (issue,) = info.value.issues
    assert issue.path == "a.b" and "lines 2 and 4" in issue.message
    with pytest.raises(ConfigError, match=r"x\[1\]\.lr: duplicate key 'lr' \(line 1, columns 9 and 16\)"):
        parse_yaml("x: [1, {lr: 1, lr: 2}]")
    with pytest.raises(ConfigError, match=r"stages\[0\]\.solver\.lr: duplicate key"):
        parse_yaml("{lr: 1, lr: 2}", prefix=("stages", 0, "solver"))


def test_the_alias_bomb_fails_in_milliseconds():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_NODES} YAML nodes"):
        parse_yaml(BOMB)
    assert time.perf_counter() - start < 0.5
    assert parse_yaml("a: &a [1, 2]\nb: *a\n") == {"a": [1, 2], "b": [1, 2]}  # a few aliases are fine


def test_recursion_and_depth_are_errors_not_tracebacks():
    with pytest.raises(ConfigError, match="recursive alias"):
        parse_yaml("a: &a {b: *a}")
    for text in ("[" * 2000, "a: " + "[" * 100 + "]" * 100):
        with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
            parse_yaml(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_yaml("a: " + "9" * 5000)  # past Python's int-parsing digit limit


def test_file_size_and_encoding(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" + b"#" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError, match="byte limit"):
        read_yaml(big)
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: ok\nx: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"byte 0xe9 at byte offset 15 \(line 2\)"):
        read_yaml(bad)
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfname: ok\n")
    assert read_yaml(bom) == {"name": "ok"}


def test_short_repr_never_builds_the_whole_repr():
    huge = ["x" * 10_000] * 10_000  # a 100 MB repr
    start = time.perf_counter()
    text = short_repr(huge)
    assert time.perf_counter() - start < 0.05 and len(text) <= 80
    assert short_repr(10**5000).startswith("<int of about 5000 digits")


@pytest.mark.parametrize("name", ["125-alias-bomb", "83-duplicate-key-in-solver", "128-non-utf8-byte"])
def test_a_yaml_level_mistake_exits_2_before_torch_or_ray_is_imported(name):
    """`cascade-ray validate` reports what the YAML reader finds without importing torch or Ray
    (several seconds of imports), in a fresh interpreter as a user runs it."""
    import subprocess
    import sys

    from paths import ROOT

    code = (
        "import sys; from cascade_ray.cli import main; rc = main(['validate', sys.argv[1]]); "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "tests" / "bad_configs" / f"{name}.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
    assert "error:" in proc.stderr
