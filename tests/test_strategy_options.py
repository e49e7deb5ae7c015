"""Options of Compressed3DStrategy that shape the pipeline: the derived micro-batch count and per-stage activation
checkpointing (validated before any process group exists, carried by the stage layouts, honoured by the recipes).
The distributed half (the runtime runs the derived count; only the asked stage recomputes, exactly like one
process) is the ``stage_ac`` case of tests/scenarios/layouts.py."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_3d import Compressed3DStrategy, StageLayout
from lightning_3d.recipes import GPT, T5
from lightning_3d.strategies.stage_builder import plan_pipeline


@pytest.mark.parametrize(
    "kwargs, microbatches, virtual",
    [
        (dict(), 1, 1),
        (dict(pipeline_parallel_size=2), 2, 1),  # 1F1B needs at least pp micro-batches
        (dict(pipeline_parallel_size=4), 4, 1),
        (dict(pipeline_parallel_size=2, schedule="interleaved_1f1b"), 2, 2),  # a multiple of pp
        (dict(pipeline_parallel_size=3, schedule="gpipe"), 3, 1),
        (dict(pipeline_parallel_size=2, num_microbatches=6, schedule="gpipe"), 6, 1),  # explicit values unchanged
        (dict(num_microbatches=3), 3, 1),
    ],
)
def test_num_microbatches_defaults_to_one_per_pipeline_rank(kwargs: dict, microbatches: int, virtual: int) -> None:
    strategy = Compressed3DStrategy(**kwargs)
    assert strategy.num_microbatches == microbatches and strategy.virtual_stages == virtual
    assert strategy.engine.num_microbatches == microbatches  # what the engine splits every batch into


@pytest.mark.parametrize(
    "value, message",
    [
        ([True], r"`stage_activation_checkpointing=\[True\]` must list 2 booleans, one per pipeline stage"
                 r" \(pipeline_parallel_size=2 x virtual_stages=1\)"),
        ([1, 0], r"`stage_activation_checkpointing=\[1, 0\]` must list 2 booleans"),
        ("TF", r"`stage_activation_checkpointing='TF'` must list 2 booleans"),
        (True, r"`stage_activation_checkpointing=True` must list 2 booleans"),
    ],
)
def test_stage_activation_checkpointing_is_validated(value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Compressed3DStrategy(pipeline_parallel_size=2, stage_activation_checkpointing=value)


def test_stage_activation_checkpointing_counts_virtual_stages() -> None:
    strategy = Compressed3DStrategy(pipeline_parallel_size=2, schedule="interleaved_1f1b",
                                    stage_activation_checkpointing=[True, False, False, True])
    assert strategy.stage_activation_checkpointing == (True, False, False, True)
    with pytest.raises(ValueError, match="must list 4 booleans, one per pipeline stage"):
        Compressed3DStrategy(pipeline_parallel_size=2, schedule="interleaved_1f1b", stage_activation_checkpointing=[True, False])


def test_plain_module_refuses_stage_activation_checkpointing() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(stage_activation_checkpointing=[True]),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(TypeError, match=r"stage_activation_checkpointing=\[True\] needs the `lightning_3d.Parallel3DModule`"
                                        r" protocol, which BoringModel does not implement"):
        trainer.fit(BoringModel())


def _block_calls(stage: torch.nn.Module, blocks, run) -> int:
    """Calls of the ``forward`` of the stage's first block during one forward and backward (counted on the method:
    checkpoint's recomputation does not run forward hooks)."""
    block, calls = next(iter(blocks)), []
    forward = block.forward
    block.forward = lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs)
    try:
        run(stage).float().sum().backward()
    finally:
        del block.forward
    return len(calls)


@pytest.mark.parametrize("model_setting", [False, True])
def test_gpt_stages_honour_the_layouts_setting(model_setting: bool) -> None:
    module = GPT("tiny", vocab_size=64, seq_length=8, num_layers=2, hidden_size=16, num_heads=2,
                 activation_checkpointing=model_setting)
    module.configure_model()
    plan = plan_pipeline(module, 2, 0, 1, "1f1b", None, [not model_setting, model_setting])
    assert [layout.activation_checkpointing for layout in plan.layouts] == [not model_setting, model_setting]
    ids = torch.randint(0, 64, (2, 8))
    stages = module.build_pipeline_stages(plan.layouts)  # both stages here: one process holds the whole model
    first, last = stages
    assert first.activation_checkpointing is (not model_setting) and last.activation_checkpointing is model_setting
    # A recomputing stage runs its blocks twice (forward, then again in the backward).
    hidden = first(microbatch={"input_ids": ids})
    assert _block_calls(first, first.layers.values(), lambda s: s(microbatch={"input_ids": ids})) == (1 if model_setting else 2)
    assert _block_calls(last, last.layers.values(),
                        lambda s: s(hidden.detach().requires_grad_(), microbatch={})) == (2 if model_setting else 1)
    # None leaves the model's own setting.
    assert GPT.build_pipeline_stages(module, [StageLayout(0, 1, range(0, 2))])[0].activation_checkpointing is model_setting


def test_t5_stages_honour_the_layouts_setting() -> None:
    module = T5("tiny", vocab_size=64, num_layers=1, num_decoder_layers=1, hidden_size=16, num_heads=2, head_dim=8,
                ffn_hidden_size=32, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    module.configure_model()
    layouts = [StageLayout(0, 2, range(0, 1), True), StageLayout(1, 2, range(1, 2), None)]
    first, last = module.build_pipeline_stages(layouts)
    assert first.activation_checkpointing is True and last.activation_checkpointing is False  # None: the model's
