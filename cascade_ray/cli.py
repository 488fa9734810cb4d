"""``cascade-ray``: validate a config, or run a pipeline.

    cascade-ray validate pipelines/configs/three_stage.yaml stages[0].solver.lr=3e-4
    cascade-ray run pipelines/configs/debug.yaml --address http://127.0.0.1:8265
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cascade_ray.errors import CascadeError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. stages[0].solver.lr=3e-4 or stages.encoder.train.epochs=2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cascade-ray", description="Train a model in stages on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a config and the stage shape chain; starts no Ray (exit 0 or 2)")
    _add_config_args(p)
    p = sub.add_parser("run", help="train every stage of a config")
    _add_config_args(p)
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    p.add_argument("--resume", action="store_true", help="reuse stage artifacts whose fingerprint matches and whose digests verify")
    p = sub.add_parser("tune", help="sweep one stage with Ray Tune on top of the trained (or reused) upstream")
    _add_config_args(p)
    p.add_argument("--space", required=True, help="search space file, e.g. tune_spaces/encoder.yaml")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    p.add_argument("--resume", action="store_true", help="restore an interrupted sweep of this stage")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cascade_ray.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            print(f"{args.config}: OK ({len(cfg.stages)} stages: {', '.join(s.name for s in cfg.stages)})")
            return 0
        from cascade_ray.pipeline.driver import run_pipeline

        if args.command == "tune":
            from cascade_ray.tune.space import load_space

            stage = load_space(args.space, cfg).stage
            run_pipeline(cfg, address=args.address, resume=args.resume, spaces={stage: args.space}, stop_after=stage)
            return 0
        run_pipeline(cfg, address=args.address, resume=args.resume)
        return 0
    except CascadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
