"""Two Ray workers on one node that load the same frozen stage hold one copy of it: the object store's.

Each actor runs ``setup_stage`` (what a Train worker runs) on ``ray.get`` of the same hand-off and
reports, for every frozen tensor, the mapping its memory lies in (``/proc/self/maps``) and the file
offset there. Both must name the same shared (``s``) mapping of the plasma file at the same offset:
the same physical pages, not two copies.
"""

from __future__ import annotations

import numpy as np
import pytest
from paths import CONFIGS

pytestmark = pytest.mark.slow

# stage 0 widened so the hand-off (~1.6 MB) goes to the shared object store: Ray keeps objects
# under 100 KiB inline in the owner, and a debug-sized stage (21 KB) would be copied to each reader
OVERRIDES = ["stages[0].model.widths=[64, 128]", "stages[1].model.in_channels=128"]


def _make_actor(ray):
    @ray.remote(num_cpus=0.5)
    class Consumer:
        def load(self, wrapped: list, config: str, overrides: list[str]) -> dict:
            import torch

            def mapping_of(address: int) -> tuple[str, str, int]:
                """(path, permissions, file offset) of the mapping holding `address` in this process."""
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        fields = line.split()
                        lo, hi = (int(x, 16) for x in fields[0].split("-"))
                        if lo <= address < hi:
                            return (fields[5] if len(fields) > 5 else ""), fields[1], int(fields[2], 16) + address - lo
                raise LookupError(hex(address))

            from cascade_ray.checks import load_config
            from cascade_ray.data import load_digits
            from cascade_ray.stage.setup import setup_stage

            upstream = ray.get(wrapped[0])
            cfg = load_config(config, overrides)
            data = load_digits(train_size=None, val_fraction=0.2, seed=0)
            self.setup = setup_stage(cfg, 1, data, upstream, torch.device("cpu"))  # held while the other loads
            state = self.setup.model.state_dict()
            out = {"frozen": {}, "refused_write": False, "type": type(upstream).__name__}
            for key in self.setup.plan.frozen_keys:
                tensor = state[key]
                out["frozen"][key] = (
                    mapping_of(tensor.data_ptr()),
                    bool(np.shares_memory(tensor.numpy(), upstream[key])),
                )
            try:
                upstream[self.setup.plan.frozen_keys[0]][...] = 0
            except ValueError:
                out["refused_write"] = True
            return out

    return Consumer


@pytest.mark.parametrize("form", ["read-from-its-file", "dict-of-arrays"])
def test_two_workers_on_one_node_share_the_frozen_stage(ray_session, digits, tmp_path, form):
    """`form`: the state as the driver hands it on (read from the stage's safetensors file: one
    block of views, models/packed.py), and as a plain dict of arrays (an imported stage's)."""
    ray = ray_session
    from cascade_ray.checks import load_config
    from cascade_ray.models.packed import PackedState
    from cascade_ray.models.weights import load_safetensors, save_safetensors, to_numpy_state
    from cascade_ray.stage.setup import build_stage_model

    config = str(CONFIGS / "debug.yaml")
    stage0, _ = build_stage_model(load_config(config, OVERRIDES), 0, digits, None)
    state = to_numpy_state(stage0.state_dict())
    if form == "read-from-its-file":
        save_safetensors(state, tmp_path / "weights.safetensors")
        state = load_safetensors(tmp_path / "weights.safetensors")
        assert isinstance(state, PackedState)
    assert sum(a.nbytes for a in state.values()) > 1_000_000
    ref = ray.put(state)
    Consumer = _make_actor(ray)
    actors = [Consumer.remote() for _ in range(2)]
    first, second = ray.get([a.load.remote([ref], config, OVERRIDES) for a in actors])
    assert first["frozen"].keys() == second["frozen"].keys() and first["frozen"]
    for key, ((path, perms, offset), shares) in first["frozen"].items():
        assert shares, f"{key}: not a view of the ray.get array"
        assert "plasma" in path and perms.endswith("s"), f"{key}: in {path!r} ({perms}), not the shared object store"
        assert second["frozen"][key] == ((path, perms, offset), True), f"{key}: the second worker holds another copy"
    assert first["refused_write"] and second["refused_write"]
    # the block travels as a block: each reader gets the same PackedState back
    assert first["type"] == second["type"] == ("PackedState" if form == "read-from-its-file" else "dict")
    for actor in actors:
        ray.kill(actor)
