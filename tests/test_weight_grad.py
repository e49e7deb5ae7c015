"""Split backwards (pipeline/weight_grad.py): B with the weight gradients deferred, then W, gives bitwise the
gradients of the whole backward, for plain split layers, fused ones (wgrad_fusion) and checkpointed blocks; the
weights' post-accumulate-grad hooks fire when W accumulates (the data-parallel buckets' signal)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_3d.distributed import wgrad_fusion
from lightning_3d.pipeline import weight_grad


class Block(nn.Module):
    def __init__(self, width: int, recompute: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width, bias=False)
        self.recompute = recompute

    def _body(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False) if self.recompute else self._body(x)


def _model(recompute: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(8, recompute), Block(8, recompute))


def _grads(model, x, dy, split: bool, microbatches: int = 2):
    x = x.clone().requires_grad_(True)
    work = []
    for i in range(microbatches):
        y = model(x[i])
        if split:
            mine = []
            with weight_grad.deferring(mine):
                y.backward(dy[i])
            work.append(mine)
        else:
            y.backward(dy[i])
    input_grad = x.grad.clone()
    hooks_before_w = dict(model.calls) if hasattr(model, "calls") else {}
    for mine in work:
        weight_grad.run_deferred(mine)
    assert not any(p.grad.requires_grad for p in model.parameters())  # W ran without building a graph
    return input_grad, {n: p.grad.clone() for n, p in model.named_parameters()}, hooks_before_w


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_split_backward_equals_the_whole_backward_bitwise(recompute: bool, fused: bool) -> None:
    x, dy = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    results = []
    for split in (False, True):
        model = _model(recompute)
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        if fused:
            weights = wgrad_fusion.fuse_gradient_accumulation(linears)
            for w in weights:  # a slot of its own, as the synchronizer would give it
                wgrad_fusion.register_slot(w, torch.zeros_like(w), None)
        else:
            weight_grad.split_linears(linears)
        model.calls = {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: model.calls.__setitem__(name, model.calls.get(name, 0) + (p.grad is not None)))
        results.append(_grads(model, x, dy, split))
        if fused:
            wgrad_fusion.unfuse_gradient_accumulation(weights)
    (gx, grads, _), (gx_split, grads_split, hooks_before_w) = results
    assert torch.equal(gx, gx_split)
    assert grads.keys() == grads_split.keys() and all(torch.equal(grads[n], grads_split[n]) for n in grads)
    # Before W: only norms and biases had gradients; the linear weights' came in W.
    linear_weights = {n for n in grads if n.endswith(("up.weight", "down.weight"))}
    if not fused:  # fused weights report through their op, not autograd's hook
        assert {n for n, c in hooks_before_w.items() if c} == set(grads) - linear_weights


def test_split_layers_match_nn_linear_and_undo() -> None:
    torch.manual_seed(1)
    plain = nn.Linear(6, 4)
    split = nn.Linear(6, 4)
    split.load_state_dict(plain.state_dict())
    assert weight_grad.splittable_linears(nn.Sequential(split)) == [split]
    weight_grad.split_linears([split])
    x = torch.randn(3, 6)
    torch.testing.assert_close(split(x), plain(x), rtol=0, atol=0)
    split(x).square().sum().backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(split.weight.grad, plain.weight.grad)
    torch.testing.assert_close(split.bias.grad, plain.bias.grad)
    weight_grad.unsplit_linears([split])
    assert type(split) is nn.Linear
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight  # two uses: stays whole
    assert weight_grad.splittable_linears(tied) == []


def test_deferring_outside_a_backward_and_nested() -> None:
    assert weight_grad.defer(lambda: None) is False
    outer, inner = [], []
    with weight_grad.deferring(outer):
        with weight_grad.deferring(inner):
            assert weight_grad.defer(print)
        assert weight_grad.defer(len)
    assert inner == [print] and outer == [len] and weight_grad.defer(print) is False
