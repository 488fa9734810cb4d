"""The reference of Tune space files (docs/tune_spaces.md), generated from ``TuneSpace``.

python -m cascade_ray.tune.reference > docs/tune_spaces.md
"""

from __future__ import annotations

from cascade_ray.config.reference import render_model
from cascade_ray.tune.space import TuneSpace

HEADER = """# Tune space files

Generated from `cascade_ray/tune/space.py` by `python -m cascade_ray.tune.reference`; do not
edit by hand (a test fails when this file is stale). A space file sweeps one stage:
`cascade-ray tune CONFIG --space FILE`, or, in `cascade-ray run --tune DIR`, one `<stage>.yaml`
per swept stage. Unknown keys and wrong types are errors, reported with the file's name before
Ray starts; so are values a trial could not train with: each value against the stage, then the
values in combination (every listed value and each range's bounds, the first 64 combinations)
with the whole pipeline's shape check, so an encoder width the next stage does not take or
`betas` with `solver.type: SGD` is found before any trial. Each key under `space` is a dotted key of the stage's own config (`solver.lr`,
`loss.scale`, `model.hidden`), given exactly one distribution. Examples: `tune_spaces/` (the
shipped ones: `cascade-ray ls`); batched sweeps: "Batched sweeps" in `docs/guide.md`.
"""


def render() -> str:
    """The space file reference as markdown."""
    return render_model(TuneSpace, HEADER, top="space file")


if __name__ == "__main__":
    print(render(), end="")
