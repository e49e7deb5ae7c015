"""Compressed3DStrategy's context-parallel options on one process: validation before any process group, the
("dp", "pp", "cp", "tp") rank arithmetic, and the per-step slicing of micro-batches. The distributed checks (layouts
against one process, resume across cp sizes, SC over dp x cp) run in tests/scenarios/context.py (test_context.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.context import ContextParallelConfig
from lightning_3d.distributed.parallel_dims import ParallelDims, resolve_sizes
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.strategies.context_parallel import shard_microbatches


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(context_parallel_size=0), r"`context_parallel_size=0` must be a positive integer"),
    (dict(context_parallel_size=True), r"`context_parallel_size=True` must be a positive integer"),
    (dict(context_parallel_size=2, context_parallel_layout="striped"),
     r"`context_parallel_layout='striped'` must be one of \('contiguous', 'zigzag'\)"),
    (dict(context_parallel_size=2, context_parallel_attention="flash"),
     r"`context_parallel_attention='flash'` must be one of \('ring', 'ulysses'\)"),
])
def test_bad_context_options_are_refused_at_construction(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Compressed3DStrategy(**kwargs)


def test_options_are_kept() -> None:
    s = Compressed3DStrategy(context_parallel_size=4, context_parallel_layout="contiguous",
                             context_parallel_attention="ulysses")
    assert s.options.context_parallel == ContextParallelConfig(4, "contiguous", "ulysses")


def test_sizes_include_cp() -> None:
    assert resolve_sizes(8, "auto", 2, 1, 2) == (2, 2, 1)
    assert resolve_sizes(4, 1, 1, 2, 2) == (1, 1, 2)
    with pytest.raises(ValueError, match=r"data_parallel_size \* context_parallel_size \* pipeline_parallel_size \*"
                                         r" tensor_parallel_size = 2 \* 2 \* 1 \* 2 = 8, but the job has 4 processes"):
        resolve_sizes(4, 2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by context_parallel_size \* pipeline_parallel_size"):
        resolve_sizes(6, "auto", 1, 1, 4)
    with pytest.raises(ValueError, match=r"`context_parallel_size=0` must be a positive integer"):
        resolve_sizes(4, "auto", 1, 1, 0)


def test_rank_arithmetic_puts_cp_between_pp_and_tp() -> None:
    dims = ParallelDims(2, 2, 2, 16, cp=2)  # rank = ((d * pp + p) * cp + c) * tp + t
    assert dims.replicas == 4
    for rank in range(16):
        d, p, t = dims.coordinates(rank)
        c = dims.cp_rank(rank)
        assert rank == ((d * 2 + p) * 2 + c) * 2 + t == dims.rank_of(d, p, t, c)
    assert dims.pipeline_ranks(1, 1, 1) == [11, 15]
    # cp = 1 keeps the (dp, pp, tp) ranks of before
    plain = ParallelDims(2, 2, 2, 8)
    assert [plain.coordinates(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert plain.replicas == 2 and plain.cp_rank(7) == 0


def test_microbatches_get_their_slice_and_global_positions() -> None:
    ids = torch.arange(16).repeat(2, 1)
    mbs = MicroBatches([{"input_ids": ids, "labels": ids + 100, "other": torch.ones(2)}], orders=[["x"]])
    out = shard_microbatches(mbs, ContextParallelConfig(2, "zigzag"), 1, ("input_ids", "labels"))
    assert isinstance(out, MicroBatches) and out.orders == mbs.orders
    expected = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]).repeat(2, 1)  # chunks 1 and 2 of 4
    assert torch.equal(out[0]["input_ids"], expected) and torch.equal(out[0]["labels"], expected + 100)
    assert torch.equal(out[0]["position_ids"], expected) and torch.equal(out[0]["other"], torch.ones(2))
    assert shard_microbatches(mbs, ContextParallelConfig(1), 0, ("input_ids",)) is mbs


def test_microbatch_errors_name_the_value_and_the_fix() -> None:
    cfg = ContextParallelConfig(2, "zigzag")
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"already holds `position_ids`.*global positions"):
        shard_microbatches([{"input_ids": ids, "labels": ids, "position_ids": ids}], cfg, 0, ("input_ids", "labels"))
    with pytest.raises(ValueError, match=r"slices `labels` of every micro-batch along dim 1.*context_parallel_keys"):
        shard_microbatches([{"input_ids": ids, "labels": torch.zeros(2)}], cfg, 0, ("input_ids", "labels"))
    with pytest.raises(ValueError, match=r"Sequence length 6 cannot be split over context_parallel_size=2"):
        shard_microbatches([{"input_ids": ids[:, :6], "labels": ids[:, :6]}], cfg, 0, ("input_ids", "labels"))


def test_predict_is_refused_with_context_parallelism() -> None:
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    strategy = Compressed3DStrategy(context_parallel_size=2)
    strategy.dims = ParallelDims(1, 1, 1, 2, cp=2)
    with pytest.raises(RuntimeError, match=r"predict is not available with context_parallel_size=2.*context_parallel_size=1"):
        strategy.setup(SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.PREDICTING)))


def test_long_sequence_config_parses(capsys) -> None:
    from lightning_3d.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "gpt_long_tiny", "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    for line in ("context_parallel_size: 2", "context_parallel_layout: zigzag", "context_parallel_attention: ring",
                 "seq_length: 2048", "activation_checkpointing: true"):
        assert line in printed, line
