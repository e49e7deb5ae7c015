"""The recipes' shared vocabulary-parallel head (lightning_3d/tensor_parallel/head.py) and the plan choice, in one
process (a 1-rank gloo mesh): the head against the recipes' LMHead, its refusals, and the implementation lookup.
Its sharded behaviour at tp=2 (GPT and T5, tied and untied) is checked against torch's plan and one process by
tests/test_tensor_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_3d.recipes.gpt.model import LMHead
from lightning_3d.tensor_parallel import TensorParallel, VocabParallelHead, tensor_parallel_implementation, vocab_parallel_head


@pytest.fixture
def tp(single_process):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", rank=0, world_size=1)
    return TensorParallel(init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))


def test_the_head_gives_lmhead_logits_as_a_vocabulary_sharded_dtensor_and_keeps_a_tied_weight(tp) -> None:
    torch.manual_seed(0)
    head = LMHead(8, 10, 12)  # two padded columns, masked to -inf
    x = torch.randn(2, 3, 8)
    reference = head(x)
    reference[..., :10].sum().backward()
    reference_grad, head.weight.grad = head.weight.grad, None
    old = head.weight
    tied = nn.Parameter(torch.distributed.tensor.distribute_tensor(old.data, tp.mesh, [Shard(0)]))
    vocab_parallel_head(head, tp, {id(old): tied}, LMHead)
    assert type(head) is VocabParallelHead and head.weight is tied  # the embedding's parameter, not a copy
    assert isinstance(head.padding_mask, DTensor) and head.padding_mask.placements == (Shard(0),)
    logits = head(x)
    assert isinstance(logits, DTensor) and logits.placements == (Shard(logits.ndim - 1),)
    # The same GEMM on the same values (one rank holds every column): bitwise equal, the masked columns included.
    assert torch.equal(logits.full_tensor(), reference.detach())
    logits.to_local()[..., :10].sum().backward()
    assert torch.equal(head.weight.grad.full_tensor(), reference_grad)  # the same GEMM backward


@pytest.mark.parametrize("autocast", [False, True])
def test_lmhead_adds_its_mask_in_the_gemm_with_the_bits_of_a_separate_add(autocast) -> None:
    """The mask is the GEMM's bias (one pass over the logits, not two): the same bits as the product, rounded to the
    output dtype, plus the mask; padded columns -inf, their weight rows without gradient."""
    torch.manual_seed(0)
    head = LMHead(16, 10, 12)
    x = torch.randn(3, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = head(x)
        product = torch.nn.functional.linear(x, head.weight)
    assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(logits, product + head.padding_mask.to(product.dtype))
    assert torch.isneginf(logits[..., 10:]).all() and torch.isfinite(logits[..., :10]).all()
    with torch.profiler.profile() as profile, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        head(x)
    ops = {event.name for event in profile.events()}
    assert "aten::addmm" in ops and "aten::add" not in ops  # the mask is the GEMM's bias, not an add of its own
    torch.log_softmax(logits.float(), -1)[..., :10].sum().backward()
    assert (head.weight.grad[10:] == 0).all() and head.weight.grad[:10].abs().sum() > 0


def test_a_head_without_a_padding_mask_and_an_untied_weight(tp) -> None:
    head = LMHead(8, 12, 12)  # no padding: no mask
    reference = head(torch.ones(1, 8))
    vocab_parallel_head(head, tp, {}, LMHead)
    assert head.padding_mask is None and isinstance(head.weight, DTensor) and head.weight.placements == (Shard(0),)
    assert torch.equal(head(torch.ones(1, 8)).full_tensor(), reference)
    plain = nn.Linear(8, 12, bias=False)  # a head class without the buffer at all
    vocab_parallel_head(plain, tp, {}, nn.Linear)
    assert plain.padding_mask is None and plain(torch.ones(1, 8)).shape == (1, 12)


def test_heads_it_cannot_shard_are_refused_before_anything_changes() -> None:
    two = SimpleNamespace(size=2)  # the refusals read only the size
    subclass = type("MyHead", (LMHead,), {})(8, 10, 12)
    with pytest.raises(TypeError, match=r"MyHead cannot be made vocabulary-parallel: only LMHead can \(a subclass's"
                                        r" own forward would be lost\)"):
        vocab_parallel_head(subclass, two, {}, LMHead)
    biased = nn.Linear(8, 12)
    with pytest.raises(TypeError, match="Linear has a bias: a vocabulary-parallel head is bias-free"):
        vocab_parallel_head(biased, two, {}, nn.Linear)
    odd = LMHead(8, 9, 9)
    with pytest.raises(ValueError, match=r"The head's vocabulary of 9 columns does not split over"
                                         r" tensor_parallel_size=2: pad it to a multiple"):
        vocab_parallel_head(odd, two, {}, LMHead)
    for head in (subclass, biased, odd):
        assert type(head) is not VocabParallelHead and not isinstance(head.weight, DTensor)


def test_the_implementation_is_the_argument_else_the_environment_else_local(monkeypatch) -> None:
    monkeypatch.delenv("L3D_TP_IMPLEMENTATION", raising=False)
    assert tensor_parallel_implementation(None) == "local"
    assert tensor_parallel_implementation("dtensor") == "dtensor"
    monkeypatch.setenv("L3D_TP_IMPLEMENTATION", "dtensor")
    assert tensor_parallel_implementation(None) == "dtensor"
    assert tensor_parallel_implementation("local") == "local"  # the argument wins
    for bad, where in (("fast", None), ("Local", "Local")):
        monkeypatch.setenv("L3D_TP_IMPLEMENTATION", bad)
        with pytest.raises(ValueError, match=rf"Tensor-parallel implementation '{bad}' \(argument or"
                                             r" L3D_TP_IMPLEMENTATION\) is not one of \('local', 'dtensor'\): use"
                                             r" 'local' \(the default\) or 'dtensor'."):
            tensor_parallel_implementation(where)
