"""Bad configuration is rejected with a message naming the value and the fix, before any process group exists."""

import lightning.pytorch as pl
import pytest
import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.distributed.parallel_dims import ParallelDims, resolve_sizes
from lightning_3d.pipeline.microbatch import MicroBatches, split_batch
from lightning_3d.recipes import GPT
from lightning_3d.strategies.protocol import split_layers


def test_sizes_must_multiply_to_the_world() -> None:
    assert resolve_sizes(8, "auto", 2, 2) == (2, 2, 2)
    assert resolve_sizes(4, 1, 2, 2) == (1, 2, 2)
    with pytest.raises(ValueError, match=r"2 \* 2 \* 2 = 8, but the job has 4 processes"):
        resolve_sizes(4, 2, 2, 2)
    with pytest.raises(ValueError, match="world size 6 is not divisible by .* = 4"):
        resolve_sizes(6, "auto", 2, 2)
    with pytest.raises(ValueError, match="`tensor_parallel_size=0` must be a positive integer"):
        resolve_sizes(4, "auto", 1, 0)


def test_mesh_coordinates_put_tensor_parallel_innermost() -> None:
    dims = ParallelDims(2, 2, 2, 8)
    assert [dims.coordinates(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert dims.pipeline_ranks(1, 1) == [5, 7]
    assert all(dims.rank_of(*dims.coordinates(r)) == r for r in range(8))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(schedule="zero_bubble"), "Unknown schedule 'zero_bubble'"),
        (dict(pipeline_parallel_size=4, num_microbatches=2),
         r"1F1B schedule with num_microbatches=2 < 4 at pipeline_parallel_size=4: fewer leave stages idle"),
        (dict(pipeline_parallel_size=2, num_microbatches=3, schedule="interleaved_1f1b"), r"num_microbatches \(3\) to be a multiple"),
        (dict(pipeline_parallel_size=1, schedule="interleaved_1f1b"), "needs pipeline_parallel_size >= 2"),
        (dict(pipeline_parallel_size=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=1), "virtual_stages >= 2"),
        (dict(virtual_stages=2), "virtual_stages=2 only applies"),
        (dict(num_microbatches=0), "`num_microbatches=0` must be a positive integer"),
        (dict(sequence_parallel=True), "sequence_parallel=True shards the sequence .* but tensor_parallel_size=1"),
        (dict(on_nonfinite="warn"), "`on_nonfinite='warn'` must be 'skip', 'raise' or 'ignore'"),
        (dict(max_consecutive_nonfinite=0), "`max_consecutive_nonfinite=0` must be a positive integer"),
        (dict(bucket_size_mb=0), r"`bucket_size_mb=0` must be a size in MiB > 0 .*the default is 25"),
        (dict(bucket_size_mb=-5), r"`bucket_size_mb=-5` must be a size in MiB > 0"),
    ],
)
def test_strategy_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Compressed3DStrategy(**kwargs)


def test_layer_split() -> None:
    assert split_layers(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert split_layers(6, 2, [4, 2]) == [range(0, 4), range(4, 6)]
    with pytest.raises(ValueError, match=r"sums to 5 but the model has 6 layers"):
        split_layers(6, 2, [3, 2])
    with pytest.raises(ValueError, match="must list 3 positive layer counts"):
        split_layers(6, 3, [3, 3])


def test_batches_must_split_evenly() -> None:
    batch = {"input_ids": torch.zeros(6, 4, dtype=torch.long), "labels": torch.zeros(6, 4, dtype=torch.long)}
    assert [mb["input_ids"].shape[0] for mb in split_batch(batch, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match=r"batch of 6 samples cannot be split into num_microbatches=4"):
        split_batch(batch, 4)
    ragged = MicroBatches([{"input_ids": torch.zeros(2, 3)}, {"input_ids": torch.zeros(1, 5)}])
    assert split_batch(ragged, 4) == list(ragged)


def test_evaluation_splits_a_partial_batch_unevenly() -> None:
    """The last validation batch of a data set rarely divides: evaluation splits it into near-equal parts."""
    batch = {"input_ids": torch.arange(5).repeat_interleave(2).view(5, 2), "labels": torch.zeros(5, 2, dtype=torch.long)}
    parts = split_batch(batch, 4, uneven=True)
    assert [mb["input_ids"].shape[0] for mb in parts] == [1, 1, 1, 2]
    assert torch.equal(torch.cat([mb["input_ids"] for mb in parts]), batch["input_ids"])  # all rows, in order
    assert [mb["input_ids"].shape[0] for mb in split_batch(batch, 8, uneven=True)] == [1] * 5  # fewer rows than parts
    assert [mb["input_ids"].shape[0] for mb in split_batch(batch, 5, uneven=True)] == [1] * 5


@pytest.mark.parametrize("precision", ["64-true", "16-true"])  # 16-mixed becomes bf16-mixed on CPU
def test_unsupported_precision_is_rejected_before_any_process_group(precision: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(), precision=precision,
                         max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=f"does not support precision='{precision}'; use one of 32-true, bf16-mixed, bf16-true"):
        trainer.fit(GPT("tiny"))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("trainer_kwargs,strategy_kwargs,message", [
    (dict(gradient_clip_val=-1.0), {}, r"Trainer\(gradient_clip_val=-1\.0\) must be a number >= 0 .* Pass e\.g\."
     r" gradient_clip_val=1\.0"),
    ({}, dict(process_group_backend="nccl"), r"process_group_backend='nccl' needs CUDA devices, but .*Use"
     r" process_group_backend='gloo' on CPU, or leave it unset"),
])
def test_run_settings_are_refused_before_any_process_group(trainer_kwargs, strategy_kwargs, message) -> None:
    """Settings the strategy reads from the Trainer and the machine: a negative clipping norm (Lightning accepts it,
    and it would flip the gradients) and NCCL without CUDA (torch's error from inside init_process_group)."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(**strategy_kwargs), max_steps=1,
                         logger=False, enable_checkpointing=False, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(GPT("tiny"))
    assert not torch.distributed.is_initialized()


def test_a_backend_per_device_type_is_not_mistaken_for_nccl() -> None:
    from lightning_3d.strategies.run_checks import check_backend

    check_backend("cpu:gloo,cuda:nccl", torch.device("cpu"))  # gloo for the CPU tensors: fine
    check_backend("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="process_group_backend='NCCL' needs CUDA devices"):
        check_backend("NCCL", torch.device("cpu"))


def test_fp16_loss_scaling_is_refused_with_the_fix() -> None:
    """On a GPU, Lightning hands the strategy precision "16-mixed" (a GradScaler): refused, naming bf16-mixed. (On a
    CPU Lightning turns it into bf16 before the strategy sees it; the CLI refuses it there: tests/test_cli.py.)"""
    from lightning_3d.strategies.run_checks import check_precision

    with pytest.raises(ValueError, match=r"does not support precision='16-mixed' \(fp16 with loss scaling.*Use"
                       r" precision='bf16-mixed'"):
        check_precision("16-mixed")
    check_precision("bf16-mixed")


@pytest.mark.parametrize("recipe,kwargs,message", [
    ("gpt", dict(vocab_multiple=-128), r"`vocab_multiple=-128` must be a positive integer, e\.g\. 128"),
    ("gpt", dict(vocab_multiple=0), r"`vocab_multiple=0` must be a positive integer"),
    ("t5", dict(vocab_multiple=2.5), r"`vocab_multiple=2\.5` must be a positive integer"),
    ("gpt", dict(vocab_size=0), r"`vocab_size=0` must be a positive integer, e\.g\. the tokenizer's"),
])
def test_a_vocabulary_tensor_parallelism_cannot_split_is_refused(recipe, kwargs, message) -> None:
    """The recipes pad the vocabulary to vocab_multiple x tp for even shards: a multiple that is not a positive integer
    gave an empty (negative multiple) or fractional padded vocabulary, or a division by zero when the model was built."""
    from lightning_3d.recipes.gpt.config import GPTConfig
    from lightning_3d.recipes.t5.config import T5Config

    with pytest.raises(ValueError, match=message):
        (GPTConfig if recipe == "gpt" else T5Config)(**kwargs)


def test_gpt_rejects_heads_that_do_not_divide_hidden() -> None:
    with pytest.raises(ValueError, match="hidden_size=100 is not divisible by num_heads=3"):
        GPT("tiny", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="Unknown GPT preset 'huge'"):
        GPT("huge")


def test_checkpoint_io_is_refused() -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    with pytest.raises(ValueError, match="checkpoint_io=TorchCheckpointIO.*sharded torch.distributed.checkpoint directories"):
        Compressed3DStrategy(checkpoint_io=TorchCheckpointIO())


def test_the_data_checks_of_a_step_read_the_device_once(monkeypatch) -> None:
    """The strategy checks a step's micro-batches (ids in the vocabulary, positions within the model's) before any
    collective, with every value they read brought to the host in one copy (docs/speed.md): the first bad value in
    micro-batch order raises its usual message after that one read; a shape error raises before any read; a hook
    called outside the strategy reads at once. The count of ``_to_host`` calls is the number of host synchronisations
    a CUDA batch would cost."""
    from lightning_3d.recipes import T5
    from lightning_3d.strategies import protocol
    from lightning_3d.strategies.pipeline_engine import check_batch

    reads: list[int] = []
    real = protocol._to_host
    monkeypatch.setattr(protocol, "_to_host", lambda values: reads.append(values.numel()) or real(values))
    gpt = GPT("tiny", vocab_size=64, seq_length=32)  # the checks read the config only
    generator = torch.Generator().manual_seed(0)
    microbatches = [{"input_ids": torch.randint(0, 64, (2, 16), generator=generator),
                     "labels": torch.randint(0, 64, (2, 16), generator=generator),
                     "position_ids": torch.arange(16).repeat(2, 1)} for _ in range(4)]
    check_batch(gpt, microbatches)
    assert reads == [4 * (2 * 2 + 2)]  # one read: min and max of ids and labels, and of the positions, per micro-batch

    bad = [{k: v.clone() for k, v in mb.items()} for mb in microbatches]
    bad[2]["labels"][1, 3] = 64
    bad[3]["position_ids"][0, 0] = 40
    bad[1]["labels"][0, 0] = -100  # ignored labels pass
    reads.clear()
    with pytest.raises(ValueError, match="labels holds token id 64, outside the model's vocabulary of 64 ids"):
        check_batch(gpt, bad)
    assert len(reads) == 1
    reads.clear()
    with pytest.raises(ValueError, match="position_ids hold 40, outside the model's 32 positions"):
        check_batch(gpt, [microbatches[0], bad[3]])
    with pytest.raises(ValueError, match="position_ids hold 40"):
        gpt.check_pipeline_batch(bad[3])  # outside the strategy: read at once, not through the step's copy
    assert len(reads) == 1
    reads.clear()
    with pytest.raises(ValueError, match=r"labels have shape \(2, 15\) but input_ids \(2, 16\)"):
        check_batch(gpt, [bad[2], {**microbatches[1], "labels": microbatches[1]["labels"][:, 1:]}])
    assert reads == []  # the shape error of micro-batch 1 raised before the step's read (micro-batch 0's id is bad too)

    t5 = T5("tiny", vocab_size=50)
    pairs = [{"input_ids": torch.randint(0, 50, (2, 8), generator=generator),
              "decoder_input_ids": torch.randint(0, 50, (2, 4), generator=generator),
              "labels": torch.randint(0, 50, (2, 4), generator=generator)} for _ in range(3)]
    check_batch(t5, pairs)
    assert reads == [3 * 3 * 2]
    pairs[1]["decoder_input_ids"][0, 0] = -1
    with pytest.raises(ValueError, match="decoder_input_ids holds token id -1"):
        check_batch(t5, pairs)
