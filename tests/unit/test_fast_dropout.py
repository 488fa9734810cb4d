"""models/dropout.py: the cheaper CPU dropout keeps nn.Dropout's contract."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cascade_ray.models.dropout import Dropout, fast_dropout, use_fast_dropout
from cascade_ray.models.mlp import mlp
from cascade_ray.models.transformer import transformer


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_drop_rate_and_scale(p):
    torch.manual_seed(0)
    y = fast_dropout(torch.ones(2_000_000), p)
    kept = y > 0
    # binomial sd on 2M draws is < 0.00036; 5 sd
    assert abs(kept.float().mean().item() - (1 - p)) < 0.0018
    assert torch.all(y[kept] == torch.tensor(1.0 / (1.0 - p)))
    assert torch.all(y[~kept] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_mask_is_the_documented_lane_rule_in_the_input_dtype(dtype):
    """Keep an element when its 15-bit lane of the generator's 64-bit words is >= round(p * 32768),
    scaled by 1/(1-p) in the input's dtype: the rule the module docstring states, whatever path
    the mask's cast takes (it goes through a uint8 view of the bools, which casts faster)."""
    p, shape = 0.3, (7, 13, 5)  # 455 elements: not a multiple of the 4 lanes of a word
    torch.manual_seed(3)
    words = torch.empty((455 + 3) // 4, dtype=torch.int64).random_()
    lanes = words.view(torch.int16)[:455].view(shape)
    keep = (lanes.int() & 0x7FFF) >= round(p * 32768)
    torch.manual_seed(3)
    y = fast_dropout(torch.ones(shape, dtype=dtype), p)
    assert y.dtype == dtype
    assert torch.equal(y != 0, keep)
    assert torch.all(y[keep] == torch.tensor(1.0 / (1.0 - p), dtype=dtype))


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 49, 32, requires_grad=True)
    y = Dropout(0.3).train()(x)
    y.sum().backward()
    kept = y != 0
    assert torch.all(x.grad[kept] == torch.tensor(1 / 0.7)) and torch.all(x.grad[~kept] == 0)
    assert torch.allclose(y[kept], x.detach()[kept] / 0.7)


def test_eval_is_identity_and_seeded_runs_repeat():
    x = torch.randn(8, 100)
    assert Dropout(0.5).eval()(x) is x
    torch.manual_seed(3)
    a = Dropout(0.5).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.5).train()(x)
    assert torch.equal(a, b) and not torch.equal(a, x)


def test_inplace_and_integer_inputs_use_torch_dropout():
    torch.manual_seed(0)
    x = torch.ones(1000)
    out = Dropout(0.5, inplace=True).train()(x)
    assert out.data_ptr() == x.data_ptr()  # nn.Dropout's in-place path
    assert Dropout(0.5).train()(torch.ones(10, dtype=torch.float64)).dtype == torch.float64


def test_builtin_models_use_it_and_stay_nn_dropout():
    m = mlp(in_features=8, hidden=[16], dropout=0.1)
    t = transformer(in_channels=8, d_model=16, depth=2, heads=2, dropout=0.1)
    for model, count in ((m, 1), (t, 6)):
        found = [mod for mod in model.modules() if isinstance(mod, nn.Dropout)]
        assert len(found) == count and all(type(mod) is Dropout for mod in found)


def test_use_fast_dropout_keeps_p_and_inplace():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.25, inplace=True)))
    use_fast_dropout(seq)
    inner = seq[1][0]
    assert type(inner) is Dropout and inner.p == 0.25 and inner.inplace


def _draws(seed: int, ps: list[float]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A replica's dropout outputs, one per p, drawn in order from `seed`, and the generator after."""
    torch.manual_seed(seed)
    x = torch.randn(16, 49, 8, generator=torch.Generator().manual_seed(99))
    return [fast_dropout(x, p) for p in ps], torch.get_rng_state()


def test_shared_masks_give_each_replica_its_own_draws_to_the_bit():
    from cascade_ray.models.dropout import shared_masks

    cases = [(0, [0.1, 0.2]), (0, [0.1, 0.2]), (7, [0.1, 0.2]), (0, [0.3, 0.2])]  # a seed, then a p, differ
    alone = [_draws(seed, ps) for seed, ps in cases]
    with shared_masks():
        shared = [_draws(seed, ps) for seed, ps in cases]
    for (outs, state), (want, want_state) in zip(shared, alone, strict=True):
        assert torch.equal(state, want_state)  # the generator ends where drawing alone leaves it
        assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    assert torch.equal(shared[0][0][0], shared[1][0][0]) and not torch.equal(shared[0][0][0], shared[2][0][0])
    assert not torch.equal(shared[0][0][0], shared[3][0][0])  # p 0.3 vs 0.1 from one state: another mask


def test_shared_masks_reuse_a_draw_instead_of_drawing_again(monkeypatch):
    from cascade_ray.models import dropout

    calls = []
    real = dropout._mask
    monkeypatch.setattr(dropout, "_mask", lambda x, p: calls.append(p) or real(x, p))
    with dropout.shared_masks():
        for _ in range(4):  # four replicas with one seed
            _draws(0, [0.1, 0.2])
    assert calls == [0.1, 0.2]  # drawn once, by the first
    _draws(0, [0.1])
    assert calls == [0.1, 0.2, 0.1]  # outside the block every draw is fresh
