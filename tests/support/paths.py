"""Paths tests share (tests/support is on sys.path via tests/conftest.py)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "pipelines" / "configs"

# The example configs' data.path / data.test_path live under this folder (written by
# pipelines/make_example_data.py); tests write the same files to a tmp folder instead.
EXAMPLE_DATA = "~/cascade-ray-data"


def example_data_overrides(config: Path, data_dir: Path) -> list[str]:
    """Overrides pointing a shipped config's example data paths at `data_dir` (none for other configs)."""
    from cascade_ray.config.yaml_io import parse_yaml

    data = parse_yaml(config.read_text()).get("data", {})
    return [
        f"data.{key}={data[key].replace(EXAMPLE_DATA, str(data_dir), 1)}"
        for key in ("path", "test_path")
        if str(data.get(key, "")).startswith(EXAMPLE_DATA)
    ]
