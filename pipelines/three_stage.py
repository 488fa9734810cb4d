"""Three-stage cascade on Fashion-MNIST: ResNet features -> Transformer encoder -> MLP classifier.

Each stage is its own Ray Train TorchTrainer job; every finished stage is frozen,
written to ``{storage_path}/{name}/stages/<stage>/`` and handed to the next stage
through the Ray object store. The composed model is evaluated on the official test set.

Local, with an embedded Ray (or the cluster in RAY_ADDRESS when set):

    python pipelines/three_stage.py
    python pipelines/three_stage.py --config pipelines/configs/debug.yaml stages.encoder.solver.lr=1e-3
    python pipelines/three_stage.py --tune          # sweep each stage with a tune_spaces/<stage>.yaml
    python pipelines/three_stage.py --log-level debug   # Ray's own log lines too (default: hidden)

On a cluster (storage_path must be storage every node can reach):

    ray job submit --working-dir . -- python pipelines/three_stage.py storage_path=/shared/runs

Exit codes: 0 done, 2 invalid config / data / resources (nothing was started), 1 a stage failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Importable from a checkout, or from the copy `ray job submit --working-dir .` unpacks,
# without installing the package on the cluster first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cascade_ray.checks import load_config
from cascade_ray.errors import CascadeError

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "three_stage.yaml"
SPACES = Path(__file__).resolve().parents[1] / "tune_spaces"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="pipeline YAML (default: %(default)s)")
    parser.add_argument("--address", default=None, help="Ray address; default RAY_ADDRESS, else an embedded Ray")
    parser.add_argument(
        "--tune",
        nargs="?",
        const=str(SPACES),
        default=None,
        metavar="DIR",
        help="sweep every stage with a DIR/<stage>.yaml space (default DIR: %(const)s), best trial frozen before the next",
    )
    parser.add_argument(
        "--resume", action="store_true", help="reuse finished stages whose fingerprint matches (after a crash)"
    )
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        default="info",
        help="info: progress and cascade-ray's lines, Ray's own hidden (errors shown); debug: everything; warning: no progress",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. stages[0].train.epochs=1"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    try:
        from cascade_ray.logs import set_log_level

        set_log_level(args.log_level)
        # 1. the plan: config + overrides, validated with the shape preflight (no Ray yet)
        cfg = load_config(args.config, args.overrides)
        print(f"config {args.config}: {' -> '.join(s.name for s in cfg.stages)}", flush=True)
        print(cfg.model_dump_json(indent=2, exclude_defaults=True), flush=True)

        # 2. the stages, in order, each frozen and handed on through the object store
        #    (with --tune: stages that have a search space are swept, the best trial kept)
        from cascade_ray.pipeline.driver import run_pipeline

        spaces = {
            s.name: str(Path(args.tune) / f"{s.name}.yaml")
            for s in cfg.stages
            if args.tune and (Path(args.tune) / f"{s.name}.yaml").is_file()
        }
        summary = run_pipeline(
            cfg, address=args.address, resume=args.resume, spaces=spaces, log=lambda line: print(line, flush=True)
        )
    except CascadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

    # 3. the result
    print(f"test_accuracy={summary['test_accuracy']:.4f} summary={summary['storage']}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
