"""Per-micro-batch recomputation (``lightning_3d.dynamic.RECOMPUTE_KEY``) and the plan digest that the strategy
compares across ranks (its distributed check: tests/scenarios/dynamic.py).

A plan that recomputes reaches the model through the micro-batch: the GPT and T5 stages then run every block's
forward twice for that micro-batch (once in the forward, once in the backward's recomputation; counted on the
blocks' ``forward``, which checkpoint's recomputation calls again without firing hooks), and the losses and
gradients are bitwise those of the run without recomputation (non-reentrant checkpointing replays the same
operations on the same inputs with the same RNG state, so nothing may differ, not even rounding)."""

from __future__ import annotations

import pytest
import torch

from lightning_3d.dynamic import RECOMPUTE_KEY, DynamicMicroBatcher, plan_digest
from lightning_3d.pipeline.schedules import build_schedule
from lightning_3d.recipes import GPT, T5
from lightning_3d.strategies.protocol import StageLayout
from tests.test_dynamic import TINY, TOY

GPT_MODEL = dict(vocab_size=64, seq_length=16, num_layers=2, hidden_size=16, num_heads=2)
T5_MODEL = dict(vocab_size=64, num_layers=2, num_decoder_layers=2, hidden_size=16, num_heads=2, head_dim=8)


def _gpt_case(default: bool | None):
    torch.manual_seed(0)
    module = GPT("tiny", **GPT_MODEL)
    module.configure_model()
    [stage] = module.build_pipeline_stages([StageLayout(0, 1, range(2), default)])
    g = torch.Generator().manual_seed(1)
    mb = {"input_ids": torch.randint(0, 64, (3, 16), generator=g), "labels": torch.randint(0, 64, (3, 16), generator=g)}
    return module, stage, list(stage.layers.values()), mb


def _t5_case(default: bool | None):
    torch.manual_seed(0)
    module = T5("tiny", **T5_MODEL)
    module.configure_model()
    [stage] = module.build_pipeline_stages([StageLayout(0, 1, range(4), default)])
    g = torch.Generator().manual_seed(1)
    mb = {"input_ids": torch.randint(1, 64, (3, 12), generator=g), "attention_mask": torch.ones(3, 12, dtype=torch.long),
          "decoder_input_ids": torch.randint(1, 64, (3, 8), generator=g),
          "labels": torch.randint(1, 64, (3, 8), generator=g)}
    return module, stage, [*stage.encoder.values(), *stage.decoder.values()], mb


def _run(case, default: bool | None, flag: bool | None) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
    """Forward and backward of one micro-batch; the forward calls per block, the loss and the gradients."""
    module, stage, blocks, mb = case(default)
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        def counted(*args, _i=i, _forward=block.forward, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)
        block.forward = counted
    if flag is not None:
        mb = {**mb, RECOMPUTE_KEY: flag}
    loss = module.pipeline_loss(stage(microbatch=mb), mb)
    loss.backward()
    return calls, loss.detach(), [p.grad.clone() for p in stage.parameters() if p.grad is not None]


@pytest.mark.parametrize("case", [_gpt_case, _t5_case], ids=["gpt", "t5"])
def test_microbatch_flag_recomputes_exactly_over_the_stage_default(case) -> None:
    base_calls, base_loss, base_grads = _run(case, None, None)
    assert base_calls == [1] * len(base_calls)  # the model's default: no recomputation
    for default, flag, per_block in ((None, True, 2), (False, True, 2), (True, False, 1), (True, None, 2)):
        calls, loss, grads = _run(case, default, flag)
        assert calls == [per_block] * len(calls), (default, flag)
        assert torch.equal(loss, base_loss) and len(grads) == len(base_grads) > 0
        assert all(torch.equal(a, b) for a, b in zip(grads, base_grads)), (default, flag)
    module, stage, _, mb = case(False)
    stage(microbatch={**mb, RECOMPUTE_KEY: True})
    assert stage.activation_checkpointing is False  # the stage's own setting is restored after the micro-batch


def _pad(samples: list, seq_len: int, target_len: int | None = None) -> dict:
    ids = torch.zeros(len(samples), seq_len, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = torch.as_tensor(s)
    return {"input_ids": ids, "labels": ids.clone()}


def test_batcher_marks_the_microbatches_of_a_recomputing_plan_only() -> None:
    samples = [[1] * 256] * 8
    common = dict(shape=TINY, dp=1, pp=4, dp_rank=0, cost_model=TOY, max_seq_len=256)
    tight = DynamicMicroBatcher(_pad, memory_budget=7e5, **common)(samples)  # needs recomputation (test_dynamic.py)
    assert tight.plan.recompute and all(mb[RECOMPUTE_KEY] is True for mb in tight)
    loose = DynamicMicroBatcher(_pad, memory_budget=1e9, **common)(samples)
    assert not loose.plan.recompute and all(RECOMPUTE_KEY not in mb for mb in loose)
    as_tuple = DynamicMicroBatcher(lambda s, n, t: tuple(_pad(s, n).values()), memory_budget=7e5, **common)
    with pytest.raises(TypeError, match=f"micro-batch key '{RECOMPUTE_KEY}', but collate returned a tuple"):
        as_tuple(samples)


def test_plan_digest_sees_orders_shapes_and_flags_only() -> None:
    orders = tuple(build_schedule("1f1b", 2, 1, 2, r) for r in range(2))
    mbs = [{"input_ids": torch.zeros(2, 8, dtype=torch.long)}, {"input_ids": torch.ones(1, 16, dtype=torch.long)}]
    digest = plan_digest(orders, mbs)
    assert 0 <= digest < 2**62
    assert plan_digest(orders, [{"input_ids": torch.ones(2, 8, dtype=torch.long)}, mbs[1]]) == digest  # values: no
    assert plan_digest(orders, mbs[::-1]) != digest  # shapes in running order
    swapped = tuple(tuple(type(a)(a.kind, a.stage, 1 - a.microbatch) for a in o) for o in orders)
    assert plan_digest(swapped, mbs) != digest
    assert plan_digest(orders, [{**mbs[0], RECOMPUTE_KEY: True}, mbs[1]]) != digest
    # A golden value: the digest must not depend on the process (Python's hash of strings is salted per process).
    assert digest == 0xE8571A5A0AE3CC1
