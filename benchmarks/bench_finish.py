"""The driver's finish of a stage on a large frozen upstream: its best checkpoint (``train.checkpoint.frozen:
reference``) made whole, checked and written as the stage's artifact, with the upstream's tensor
digests known from its verified manifest (now) vs hashed twice (before: once to check the
checkpoint's recorded digests, once more for the artifact's manifest).

    flock /tmp/cascade-cpu.lock .venv/bin/python benchmarks/bench_finish.py [--width 10000] [--repeats 7]

The stages are those of ``bench_checkpoint.py``: a ``backbone`` MLP (64 -> W -> W; W = 10000:
~100M parameters, ~400 MB), randomly initialised, and a small ``head`` MLP (W -> 64 -> 10) on it,
whose reference checkpoint is written once, untimed. Timed: ``StageSession.finish`` on that
checkpoint, in this process, to local disk, each round into a fresh artifact folder; the two
ways alternate (before, now, now, before, ...) and the medians are printed. Before is the same
code given what it had before: a hand-off without digests and ``write_artifact`` hashing every
tensor (its ``known`` dropped). No Ray: ``ray.put`` of the hand-off is replaced by a no-op in both
(it is the same one put either way). Both artifacts are checked to be the same, byte for byte,
and to verify.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_checkpoint import _config  # noqa: E402  the same two stages


class _Result:
    """What StageSession.finish reads of a ray.train.Result: the best checkpoint and rank 0's return value."""

    def __init__(self, folder: Path, metrics: dict):
        self.folder, self.return_value = folder, {"history": [metrics], "world_size": 1}

    def get_best_checkpoint(self, metric, mode):
        return self

    @contextmanager
    def as_directory(self):
        yield str(self.folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=10000, help="the backbone's hidden width W")
    parser.add_argument("--repeats", type=int, default=7, help="timed finishes per way")
    args = parser.parse_args()

    import ray
    import torch

    from cascade_ray.checks import validate_config
    from cascade_ray.data import load_digits
    from cascade_ray.hardware import hardware_line
    from cascade_ray.models.weights import state_digests, to_numpy_state
    from cascade_ray.pipeline import stages
    from cascade_ray.pipeline.artifacts import WEIGHTS, read_artifact, write_artifact
    from cascade_ray.stage.setup import build_stage_model
    from cascade_ray.stage.worker import write_checkpoint

    print(hardware_line(), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-finish-"))
    ray.put = lambda value: "ref"  # no object store: the one put is the same both ways
    try:
        cfg = validate_config(_config(str(work / "runs"), args.width, 1), source="bench_finish")
        data = load_digits(train_size=None, val_fraction=0.2, seed=0)
        torch.manual_seed(0)
        backbone, _ = build_stage_model(cfg, 0, data, None)
        upstream = to_numpy_state(backbone.state_dict())
        del backbone
        head, plan = build_stage_model(cfg, 1, data, upstream)
        state = to_numpy_state(head.state_dict())
        del head
        metrics = {"epoch": 1, "step": 9, "train_loss": 1.5, "val_loss": 1.2, "val_accuracy": 0.6}
        folder = work / "checkpoint"
        folder.mkdir()
        write_checkpoint(folder, state, metrics, nodes=["a" * 56], frozen=state_digests(state, plan.frozen_keys))
        upstream_digests = state_digests(upstream)  # what the backbone's artifact manifest records
        frozen_mb = sum(upstream[k].nbytes for k in plan.frozen_keys) / 1e6
        print(
            f"head on a frozen backbone 64 -> {args.width} -> {args.width}: {len(plan.frozen_keys)} frozen tensors, "
            f"{frozen_mb:.1f} MB; the head's own {len(state) - len(plan.frozen_keys)} tensors "
            f"{sum(v.nbytes for k, v in state.items() if k not in plan.frozen_keys) / 1e6:.2f} MB",
            flush=True,
        )

        def hash_all(directory, state, fields, *, known=None):  # write_artifact as it was: every tensor hashed
            return write_artifact(directory, state, fields)

        def finish(way: str, round_: int) -> tuple[float, str]:
            run = work / f"run-{way}-{round_}"
            session = stages.StageSession(cfg, run, "data-ref", "d" * 64, data.input_shape, data.out_width)
            known = upstream_digests if way == "now" else None
            handoff = stages.Handoff(upstream, "up-ref", "p" * 64, known)
            stages.write_artifact = write_artifact if way == "now" else hash_all
            t0 = time.perf_counter()
            record, _ = session.finish(
                1, handoff, _Result(folder, metrics), fp="f" * 64, run_name="01-head", started=t0
            )
            return time.perf_counter() - t0, record["artifact"]

        finish("now", 0)  # warm: the first artifact write of the process
        walls: dict[str, list[float]] = {"before": [], "now": []}
        written: dict[str, str] = {}
        for i in range(args.repeats):
            for way in ("before", "now") if i % 2 == 0 else ("now", "before"):
                wall, written[way] = finish(way, i + 1)
                walls[way].append(wall)
                if i + 1 < args.repeats:  # keep the disk to the last round's two artifacts
                    shutil.rmtree(work / f"run-{way}-{i + 1}")
        manifests = {way: read_artifact(path)[0].manifest for way, path in written.items()}  # both verify
        same = (Path(written["before"]) / WEIGHTS).read_bytes() == (Path(written["now"]) / WEIGHTS).read_bytes()
        same = same and manifests["before"].tensor_digests == manifests["now"].tensor_digests
        print(f"identical artifact check: weights file and tensor digests the same both ways: {same}")
        assert same, "both ways must write the same artifact"
        before, now = statistics.median(walls["before"]), statistics.median(walls["now"])
        for way in ("before", "now"):
            print(f"  {way}: rounds {', '.join(f'{w:.3f}' for w in walls[way])} s")
        print(f"finish, upstream hashed twice (before): {before:.3f} s (1.000 vs baseline)")
        print(f"finish, upstream digests from its manifest (now): {now:.3f} s ({before / now:.2f}x faster)")
        print(f"saved per finish: {before - now:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
