"""Write the example Parquet data sets the shipped example configs train on.

From scikit-learn's bundled loaders (offline), as ``OUT_DIR/<name>/{train,test}.parquet``
(seeded 80/20 split): ``breast_cancer`` ([30] vectors, class), ``diabetes`` ([10]
vectors, regression) and ``digits_multilabel`` ([8, 8] sequences, multilabel). See
:mod:`cascade_ray.data.examples` for what each holds.

    python pipelines/make_example_data.py ~/cascade-ray-data
    python pipelines/make_example_data.py ~/cascade-ray-data --only diabetes

then train one, e.g. ``python pipelines/three_stage.py --config pipelines/configs/tabular.yaml``
(its data.path points at ``~/cascade-ray-data/breast_cancer/train.parquet``).

Exit codes: 0 written, 2 an unknown name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Importable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cascade_ray.data.examples import EXAMPLES, INPUT_COLUMN, TARGET_COLUMN, example_set, write_example_data
from cascade_ray.data.parquet import load_parquet
from cascade_ray.errors import CascadeError

DEFAULT_OUT_DIR = "~/cascade-ray-data"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_OUT_DIR, help=f"default {DEFAULT_OUT_DIR}")
    parser.add_argument("--only", action="append", metavar="NAME", help=f"one of {', '.join(EXAMPLES)} (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="random state of the 80/20 split")
    args = parser.parse_args(argv)
    try:
        written = write_example_data(args.out_dir, args.only, seed=args.seed)
    except CascadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, (train, test) in written.items():
        # read back the way a config does: the shape comes from the file's metadata
        kind = example_set(name).target_kind
        splits = load_parquet(
            train, test_path=test, input_column=INPUT_COLUMN, target_column=TARGET_COLUMN, target_kind=kind,
            train_size=None, val_fraction=0.1, seed=args.seed,
        )  # fmt: skip
        rows = len(splits.x_train) + len(splits.x_val)
        print(
            f"{name}: {rows} train + {len(splits.x_test)} test rows, input {list(splits.input_shape)}, {kind} -> {train.parent}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
