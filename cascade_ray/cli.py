"""``cascade-ray``: validate a config, or run a pipeline.

cascade-ray validate pipelines/configs/three_stage.yaml stages[0].solver.lr=3e-4
cascade-ray run pipelines/configs/debug.yaml --address 127.0.0.1:6379
cascade-ray run pipelines/configs/debug.yaml --profile encoder --log-level debug
cascade-ray submit pipelines/configs/debug.yaml storage_path=s3://bucket/runs --address http://127.0.0.1:8265
cascade-ray diagnose pipelines/configs/debug.yaml --stage encoder --steps 20 [--json]
cascade-ray lr-find pipelines/configs/debug.yaml --stage features --out lr_find.png
cascade-ray validate debug        # a shipped config by name (`cascade-ray ls`) where no such file exists
cascade-ray serve ~/cascade-ray-runs/debug --port 8000   (then: cascade-ray serve --reload NEW_RUN --address ...)
cascade-ray predict s3://bucket/runs/debug --data s3://bucket/new/ --out s3://bucket/predictions/debug
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cascade_ray.errors import CascadeError, ConfigError, ConfigIssue
from cascade_ray.options import LOG_LEVELS, RunOptions
from cascade_ray.tools.shipped import SHIPPED, resolve_config, resolve_space

if TYPE_CHECKING:
    from cascade_ray.config.schema import PipelineConfig

# torch, Ray and the rest are imported by the commands that need them: `validate`, `ls` and
# `--help` stay fast


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="pipeline YAML file, or the name of a shipped config (`cascade-ray ls`)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="overrides, e.g. stages[0].solver.lr=3e-4 or stages.encoder.train.epochs=2",
    )
    add_trust_arg(p)


def add_trust_arg(p: argparse.ArgumentParser) -> None:
    """``--trust MODULE`` (repeatable): packages a config's import paths may name; shared with the pipeline script."""
    p.add_argument(
        "--trust",
        action="append",
        default=[],
        metavar="MODULE",
        help="allow model.type / loss.type import paths from this package (repeatable; added to trusted_modules; "
        "never the standard library). Its callables run: see docs/security.md",
    )


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The flags of a pipeline run, shared by ``cascade-ray run`` and ``pipelines/three_stage.py``."""
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse stage artifacts whose fingerprint matches and whose digests verify (after a crash); restore sweeps",
    )
    p.add_argument(
        "--tune",
        nargs="?",
        const=str(SHIPPED["space"]),
        default=None,
        metavar="DIR",
        help="sweep every stage that has a DIR/<stage>.yaml search space (default DIR: %(const)s), "
        "the best trial frozen before the next stage",
    )
    p.add_argument(
        "--profile",
        nargs="?",
        const="all",
        default=None,
        metavar="STAGE",
        help="torch.profiler trace of a few steps (skip 2, warm up 2, record 5) of STAGE (comma-separated names; "
        "alone: every stage), written to {run}/profile/<stage>.trace.json, top operators printed",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="train again over a finished run ({run}/summary.json with status finished) without --resume, "
        "rewriting its outputs (a failed or interrupted run needs neither flag)",
    )
    _add_break_lock(p)
    _add_trust_tune_state(p)
    _add_log_level(p)


def _add_trust_tune_state(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-tune-state",
        action="store_true",
        help="with --resume: restore a sweep whose Tune state (tuner.pkl, unpickled) does not match the sha256 "
        "sidecar cascade-ray wrote; only for a folder you wrote yourself (docs/security.md)",
    )


def _add_break_lock(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--break-lock",
        action="store_true",
        help="take the run lock ({run}/.lock) even from a driver that looks alive; "
        "a dead driver's lock is taken over without it",
    )


def _add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="info (default): cascade-ray's lines and progress, Ray's own log lines hidden (errors still shown); "
        "debug: everything Ray prints too; warning: no progress display, only warnings and errors from workers",
    )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args`` that also takes overrides after options (``tune CONFIG --space S lr=...``:
    argparse alone stops collecting positionals at the first option) and ``--profile key=value``."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a or a.endswith((".yaml", ".yml")) for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if isinstance(getattr(args, "profile", None), str) and "=" in args.profile:  # an override, not a stage
        args.overrides, args.profile = [*args.overrides, args.profile], "all"
    return args


def as_typed(config: str | Path, overrides: Sequence[str]) -> str:
    """The config and its overrides as a shell would take them back, credentials in a URI left out
    (``RunOptions.config_arg``: quoted in error messages and in a sweep's ``best.yaml``)."""
    text = shlex.join([str(config), *overrides])
    if "://" not in text:  # no URI: storage (pyarrow) stays unimported for a config mistake
        return text
    from cascade_ray.storage import redact

    return redact(text)


def run_options(args: argparse.Namespace, cfg: PipelineConfig, config_arg: str | None = None) -> RunOptions:
    """The :class:`RunOptions` of parsed run flags, checked against `cfg` (``--profile`` stage names).
    `config_arg`: the config and overrides as typed (default: ``args.config`` and ``args.overrides``)."""
    from cascade_ray.stage.profiler import check_profile_stages

    spaces: tuple[tuple[str, str], ...] = ()
    if getattr(args, "tune", None):
        folder = Path(args.tune)
        if not folder.is_dir():
            raise ConfigError(
                [ConfigIssue("--tune", f"{folder} is not a folder", "pass a folder of <stage>.yaml spaces")]
            )
        spaces = tuple(
            (s.name, str(folder / f"{s.name}.yaml")) for s in cfg.stages if (folder / f"{s.name}.yaml").is_file()
        )
    return RunOptions(
        address=args.address,
        resume=args.resume,
        log_level=args.log_level,
        profile=frozenset(check_profile_stages(cfg, args.profile)) if getattr(args, "profile", None) else frozenset(),
        spaces=spaces,
        break_lock=args.break_lock,
        overwrite=args.overwrite,
        trust_tune_state=args.trust_tune_state,
        config_arg=config_arg or as_typed(args.config, getattr(args, "overrides", [])),
    )


def _add_in_process_args(p: argparse.ArgumentParser) -> None:
    """``--upstream`` and ``--device`` of the tools that run one stage in this process (diagnose, lr-find)."""
    p.add_argument(
        "--upstream",
        default=None,
        help="artifact of the previous stage (RUN_DIR/stages/<stage>); default: upstream freshly initialized",
    )
    p.add_argument(
        "--device", default=None, help="cpu, cuda, ... (default: cuda if the stage uses a GPU and one is here)"
    )


def _add_run_trust(p: argparse.ArgumentParser) -> None:
    """``--trust`` and ``--untrusted-run`` of the commands that load a finished run (its config.yaml is code)."""
    add_trust_arg(p)
    p.add_argument(
        "--untrusted-run",
        action="store_true",
        help="ignore the run's own trusted_modules (a run you did not write): only --trust packages may be imported",
    )


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """``cascade-ray serve``: start a Ray Serve app of a run, or reload a running one (tools/serve_control.py)."""
    p.add_argument("run", nargs="?", help="a finished run {storage_path}/{name} (or s3:// / gs:// URI) to serve")
    p.add_argument("--reload", default=None, metavar="NEW_RUN", help="swap the running app to NEW_RUN in place")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP proxy binds (default 127.0.0.1: loopback)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=int, default=1, help="model replicas (default 1)")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests one forward pass takes (default 32)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long a batch waits to fill (default 5 ms)")
    p.add_argument("--max-rows", type=int, default=1024, help="most rows per request; more is a 400 (default 1024)")
    p.add_argument("--stage", default=None, help="the stage whose head predicts (default: the run's last)")
    p.add_argument("--name", default="cascade", help="Serve application name (default cascade)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    _add_run_trust(p)
    p.add_argument(
        "--watch",
        default=None,
        metavar="POINTER",
        help="a file or URI holding a run path ('latest'): reload whenever it names another run (RUN may be '-')",
    )
    p.add_argument("--watch-interval", type=float, default=5.0, help="seconds between --watch polls (default 5)")
    _add_log_level(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cascade-ray", description="Train a model in stages on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a config and the stage shape chain; starts no Ray (exit 0 or 2)")
    _add_config_args(p)
    p = sub.add_parser("run", help="train every stage of a config")
    _add_config_args(p)
    add_run_args(p)
    p = sub.add_parser("tune", help="sweep one stage with Ray Tune on top of the trained (or reused) upstream")
    _add_config_args(p)
    p.add_argument(
        "--space",
        required=True,
        help="search space file, e.g. tune_spaces/encoder.yaml, or a shipped one: space/encoder",
    )
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    p.add_argument("--resume", action="store_true", help="restore an interrupted sweep of this stage")
    p.add_argument(
        "--batched",
        action="store_true",
        help="train every sampled config at once in one TorchTrainer job (a stage on cached features; "
        "solver/loss values only; refused otherwise, before Ray starts)",
    )
    _add_break_lock(p)
    _add_trust_tune_state(p)
    _add_log_level(p)
    p = sub.add_parser(
        "submit",
        help="check a config here, then run its pipeline as a Ray job on a cluster and follow the logs (exit 0 SUCCEEDED, 1 FAILED)",
    )
    _add_config_args(p)
    from cascade_ray.tools.jobs import add_submit_args

    add_submit_args(p)
    p = sub.add_parser(
        "diagnose",
        help="run one stage in-process for a few steps (no Ray): solver, lr plan, gradients, updates, verdict (exit 0 healthy, 1 alarms)",
    )
    _add_config_args(p)
    p.add_argument("--stage", required=True, help="stage name")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run (default 20)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler trace of steps 5-9 to profile/<stage>.trace.json, top operators in the report",
    )
    _add_in_process_args(p)
    p = sub.add_parser(
        "lr-find", help="exponential lr range test of one stage (no Ray); writes a PNG and prints the suggested lr"
    )
    _add_config_args(p)
    p.add_argument("--stage", required=True, help="stage name")
    p.add_argument("--out", default=None, help="PNG path (default lr_find_<stage>.png)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of the test (default 200)")
    p.add_argument("--start-lr", type=float, default=1e-7, help="first lr (default 1e-7)")
    p.add_argument("--end-lr", type=float, default=10.0, help="last lr (default 10)")
    _add_in_process_args(p)
    p = sub.add_parser(
        "report",
        help="PNG curves per stage, the composed model's confusion matrix and report.md of a run (finished, "
        "running or failed: a partial run shows its done stages)",
    )
    p.add_argument("run_dir", help="a run: {storage_path}/{name}")
    p.add_argument(
        "--html",
        action="store_true",
        help="also write report/report.html: one self-contained page (figures embedded) that opens offline",
    )
    p = sub.add_parser(
        "export",
        help="export a finished run's composed model (raw inputs, normalization inside) and check parity against eager",
    )
    p.add_argument("run_dir", help="a finished run: {storage_path}/{name} (local or URI), or {run}/stages/<stage>")
    p.add_argument(
        "--format",
        choices=["pt2", "onnx", "torchscript"],
        default="pt2",
        help="pt2: torch.export program (default); onnx; torchscript: legacy (torch.jit is deprecated)",
    )
    p.add_argument(
        "--quantize",
        choices=["int8"],
        default=None,
        help="also report the effect of dynamic int8 quantization (on the eager model; the file stays fp32)",
    )
    p.add_argument("--stage", default=None, help="the stage whose head the model returns (default: the last)")
    _add_run_trust(p)
    _add_serve_args(sub.add_parser("serve", help="serve a finished run over HTTP with Ray Serve (or --reload it)"))
    _add_predict_parser(sub)
    sub.add_parser("ls", help="list the shipped configs and search spaces")
    p = sub.add_parser("cp", help="copy a shipped config or space to edit it")
    p.add_argument("name", help="a name from `cascade-ray ls`")
    p.add_argument("dest", help="file or folder")
    p = sub.add_parser(
        "doctor", help="check versions, devices, cluster, storage and shared memory (exit 1 on a blocking problem)"
    )
    p.add_argument("--address", default=None, help="Ray cluster to check (default: RAY_ADDRESS; none: skip)")
    p.add_argument("--storage", default=None, help="storage_path to check for writability (default ~/cascade-ray-runs)")
    return parser


def _add_predict_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="predict Parquet rows with a finished run on the cluster (Ray Data); prints a JSON report",
    )
    p.add_argument("run_dir", help="a finished run: {storage_path}/{name} (local, s3://, gs://)")
    p.add_argument("--data", required=True, help="Parquet file, folder / prefix or glob (local, s3://, gs://)")
    p.add_argument(
        "--out",
        required=True,
        help="output folder of Parquet files (local, s3://, gs://): prediction[, probabilities] in input row order",
    )
    p.add_argument("--input-column", default=None, help="input column (default: the run's data.inputs.column)")
    p.add_argument("--keep", action="append", default=[], metavar="COLUMN", help="copy an input column (repeatable)")
    p.add_argument("--batch-rows", type=int, default=None, help="rows per batch (default: predict_file's, 1024)")
    p.add_argument("--actors", type=int, default=None, help="predictor actors (default: one per GPU, else one per CPU)")
    p.add_argument("--stage", default=None, help="the stage whose head predicts (default: the run's last)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier prediction's Parquet files in --out")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else an embedded Ray)")
    _add_run_trust(p)
    _add_log_level(p)


_NO_CONFIG = ("report", "export", "predict", "serve", "ls", "cp", "doctor")


def _run_tool(args: argparse.Namespace) -> int:
    """Subcommands that take no pipeline config."""
    if args.command == "report":
        from cascade_ray.tools.report import build_report

        print(build_report(args.run_dir, html=args.html))
    elif args.command == "export":
        import json

        from cascade_ray.tools.export import export_run

        report = export_run(
            args.run_dir, args.format, args.quantize, args.stage, trust=args.trust, trust_run=not args.untrusted_run
        )
        print(json.dumps(report, indent=2))
    elif args.command == "serve":
        try:
            from cascade_ray.tools.serve_control import serve_command
        except ImportError as exc:
            raise CascadeError(f"serve needs Ray Serve ({exc}): pip install 'cascade-ray[serve]'") from None
        return serve_command(args)
    elif args.command == "predict":
        from cascade_ray.tools.predict import predict_file

        sizes = {"batch_rows": args.batch_rows} if args.batch_rows is not None else {}
        report = predict_file(
            args.run_dir,
            args.data,
            args.out,
            input_column=args.input_column,
            actors=args.actors,
            keep_columns=args.keep,
            overwrite=args.overwrite,
            address=args.address,
            stage=args.stage,
            log_level=args.log_level,
            trust=args.trust,
            trust_run=not args.untrusted_run,
            **sizes,
        )
        print(report.to_json())
        if report.warning:
            print(f"warning: {report.warning}", file=sys.stderr)
    elif args.command == "ls":
        from cascade_ray.tools.shipped import list_shipped

        print(list_shipped())
    elif args.command == "cp":
        from cascade_ray.tools.shipped import copy_shipped

        print(copy_shipped(args.name, args.dest))
    else:
        from cascade_ray.tools.doctor import run_doctor

        return run_doctor(address=args.address, storage=args.storage)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    # not cascade_ray.api: a config mistake is reported before Ray (and, for a YAML-level one,
    # torch) is imported, in a fraction of a second instead of several
    from cascade_ray.checks import load_config

    try:
        if args.command in _NO_CONFIG:
            return _run_tool(args)
        # as typed, for the commands errors suggest and best.yaml's header; never a credential in a URI
        config_arg = as_typed(args.config, getattr(args, "overrides", []))
        args.config = resolve_config(args.config)  # a file path wins over a shipped name
        cfg = load_config(args.config, args.overrides, trust=args.trust)
        if args.command == "validate":
            from cascade_ray.checks.reach import reach_issues
            from cascade_ray.errors import ConfigError
            from cascade_ray.solver.precision import precision_config_issues

            errors, warnings = precision_config_issues(cfg)  # against this machine's CPU
            errors += reach_issues(cfg)  # storage writable, data readable: a small probe
            for issue in warnings:
                print(f"warning: {issue.render()}")
            if errors:
                raise ConfigError(errors, source=str(args.config))
            print(f"{args.config}: OK ({len(cfg.stages)} stages: {', '.join(s.name for s in cfg.stages)})")
            return 0
        if args.command == "submit":
            from cascade_ray.tools.jobs import submit

            return submit(args, cfg.storage_path)
        if args.command == "diagnose":
            from cascade_ray.tools.health import diagnose_command

            return diagnose_command(
                cfg,
                args.stage,
                steps=args.steps,
                as_json=args.json,
                upstream=args.upstream,
                device=args.device,
                profile=args.profile,
            )
        if args.command == "lr-find":
            from cascade_ray.tools.health import lr_find_command

            return lr_find_command(
                cfg,
                args.stage,
                out=args.out,
                steps=args.steps,
                start_lr=args.start_lr,
                end_lr=args.end_lr,
                upstream=args.upstream,
                device=args.device,
            )
        from cascade_ray.api import run_pipeline
        from cascade_ray.logs import apply_log_level
        from cascade_ray.tune.space import load_space

        if args.command == "tune":
            args.space = resolve_space(args.space)  # a file path wins over a shipped name (space/classifier)
            stage = load_space(args.space, cfg).stage
            options = RunOptions(
                address=args.address,
                resume=args.resume,
                log_level=args.log_level,
                spaces=((stage, args.space),),
                stop_after=stage,
                break_lock=args.break_lock,
                trust_tune_state=args.trust_tune_state,
                batched=args.batched,
                config_arg=config_arg,
            )
        else:
            options = run_options(args, cfg, config_arg)
        apply_log_level(options.log_level)
        run_pipeline(cfg, options)
        return 0
    except CascadeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
