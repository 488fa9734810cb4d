"""Three-stage cascade on Fashion-MNIST: ResNet features -> Transformer encoder -> MLP classifier.

Each stage is its own Ray Train TorchTrainer job; every finished stage is frozen,
written to ``{storage_path}/{name}/stages/<stage>/`` and handed to the next stage
through the Ray object store. The composed model is evaluated on the official test set.

Local, with an embedded Ray (or the cluster in RAY_ADDRESS when set):

    python pipelines/three_stage.py
    python pipelines/three_stage.py --config pipelines/configs/debug.yaml stages.encoder.solver.lr=1e-3
    python pipelines/three_stage.py --tune          # sweep each stage with a tune_spaces/<stage>.yaml
    python pipelines/three_stage.py --log-level debug   # Ray's own log lines too (default: hidden)
    python pipelines/three_stage.py --profile encoder   # torch.profiler trace of a few encoder steps

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

from cascade_ray.api import load_config, run_pipeline
from cascade_ray.cli import add_run_args, add_trust_arg, parse_args, run_options
from cascade_ray.config.metrics import HEADLINE_METRIC
from cascade_ray.errors import CascadeError
from cascade_ray.logs import apply_log_level
from cascade_ray.tools.shipped import resolve_config

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "three_stage.yaml"


def build_parser() -> argparse.ArgumentParser:
    """The same run flags as ``cascade-ray run`` (one shared definition), plus ``--config``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="pipeline YAML, or a shipped config's name (default: %(default)s)"
    )
    add_run_args(parser)
    add_trust_arg(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. stages[0].train.epochs=1"
    )
    return parser


def main() -> int:
    args = parse_args(build_parser())
    try:
        # 1. the plan: config + overrides, validated with the shape preflight (no Ray yet)
        cfg = load_config(resolve_config(args.config), args.overrides, trust=args.trust)  # a file, or a shipped name
        options = run_options(args, cfg)  # --tune DIR, --profile, --resume, --log-level, --address
        apply_log_level(options.log_level)
        print(f"config {args.config}: {' -> '.join(s.name for s in cfg.stages)}", flush=True)
        print(cfg.model_dump_json(indent=2, exclude_defaults=True), flush=True)

        # 2. the stages, in order, each frozen and handed on through the object store
        #    (with --tune: stages that have a search space are swept, the best trial kept)
        summary = run_pipeline(cfg, options, log=lambda line: print(line, flush=True))
    except CascadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

    # 3. the result
    metric = HEADLINE_METRIC[summary["target_kind"]]  # accuracy, map (multilabel) or r2 (regression)
    print(f"test_{metric}={summary['test_metrics'][metric]:.4f} summary={summary['storage']}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
