"""``Compressed3DStrategy(cuda_graphs=True)`` (lightning_3d/pipeline/graphs.py).

On CPU: the option's checks (each refused value with its message), and the graphs' bookkeeping through a real fit,
with an eager stand-in for the capture (which graph a micro-batch replays, which run eagerly and why, the warnings).
On a GPU (skipped without one; run on the device machines): fits with CUDA graphs equal the same fits without, with
gradient accumulation over micro-batches and batches, a last batch of other shapes, activation checkpointing,
compiled blocks and T5.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_3d import Compressed3DStrategy, MicroBatches
from lightning_3d.pipeline import Action
from lightning_3d.pipeline.graphs import StageGraphs
from lightning_3d.recipes import GPT, T5
from lightning_3d.recipes.data import SyntheticLMDataModule, SyntheticSeq2SeqDataModule

GPU = torch.cuda.is_available()


# ----- the option's checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(cuda_graphs="yes"), TypeError, r"`cuda_graphs='yes'` must be True or False"),
        (dict(pipeline_parallel_size=2), ValueError, r"cuda_graphs=True needs pipeline_parallel_size=1, got 2: a pipeline"
                                                     r" keeps several micro-batches in flight"),
        (dict(tensor_parallel_size=2), ValueError, r"needs tensor_parallel_size=1, got 2: its blocks run collectives"),
        (dict(context_parallel_size=2), ValueError, r"needs context_parallel_size=1, got 2"),
        (dict(schedule="gpipe", num_microbatches=2), ValueError,
         r"schedule='gpipe' and num_microbatches=2: GPipe runs every forward before the first backward.*Use"
         r" schedule='1f1b'"),
        (dict(gradient_accumulation_fusion=True), ValueError,
         r"gradient_accumulation_fusion=True: the fused op hands gradients over in host code"),
    ],
)
def test_cuda_graphs_refuses_what_it_cannot_replay(kwargs: dict, error: type, message: str) -> None:
    kwargs = {"cuda_graphs": True, **kwargs}
    with pytest.raises(error, match=message):
        Compressed3DStrategy(**kwargs)
    Compressed3DStrategy(schedule="gpipe", num_microbatches=1, cuda_graphs=True)  # one micro-batch: nothing in flight


def _trainer(strategy: Compressed3DStrategy, steps: int, callbacks=(), accumulate: int = 1) -> pl.Trainer:
    return pl.Trainer(accelerator="gpu" if GPU else "cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=list(callbacks), accumulate_grad_batches=accumulate,
                      precision="bf16-mixed" if GPU else "32-true", use_distributed_sampler=False)


def test_cuda_graphs_needs_cuda_devices_and_the_pipeline_protocol() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(cuda_graphs=True), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = SyntheticLMDataModule(vocab_size=256, seq_length=16, batch_size=2, num_samples=8)
    with pytest.raises(ValueError, match=r"cuda_graphs=True replays CUDA graphs, but this run trains on 'cpu' devices\."
                                         r" Train on GPUs \(accelerator='gpu'\), or set cuda_graphs=False"):
        trainer.fit(GPT("tiny", vocab_size=256, seq_length=16), datamodule=data)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(cuda_graphs=True), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(TypeError, match=r"cuda_graphs=True needs the `lightning_3d.Parallel3DModule` protocol, which"
                                        r" BoringModel does not implement; leave it False for plain modules"):
        trainer.fit(BoringModel())


# ----- the bookkeeping, with an eager stand-in for the capture (CPU) ------------------------------------------------
class EagerCapture:
    """Stands in for ``GraphedStage``: runs the stage eagerly on the live micro-batch, records what it was given, and
    keeps ``pending`` as the real one does (set by the forward, cleared when the output's gradient arrives)."""

    made: list[EagerCapture] = []

    def __init__(self, stage, received, microbatch, pool) -> None:
        self.stage, self.pending, self.calls = stage, False, []
        self.captured_shape = tuple(microbatch["input_ids"].shape)
        EagerCapture.made.append(self)

    def __call__(self, received, microbatch):
        self.calls.append(microbatch["input_ids"].clone())
        out = self.stage(*received, microbatch=microbatch)
        self.pending = True
        out.register_hook(lambda grad: setattr(self, "pending", False))
        return out


class Batches(pl.LightningDataModule):
    """GPT batches of the given sizes, in order (the recipes' loaders drop a last partial batch; this one keeps it)."""

    def __init__(self, sizes: list[int], seq_length: int = 16, vocab_size: int = 256) -> None:
        super().__init__()
        ids = torch.randint(0, vocab_size, (sum(sizes), seq_length), generator=torch.Generator().manual_seed(0))
        self.batches = [{"input_ids": part, "labels": part} for part in ids.split(sizes)]

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


class InstallStandIn(pl.Callback):
    def __init__(self) -> None:
        self.graphs = StageGraphs(capture=EagerCapture)

    def on_train_start(self, trainer, module) -> None:
        trainer.strategy.engine.runtime.graphs = self.graphs


@pytest.mark.skipif(GPU, reason="the stand-in is for CPU runs; GPUs run the real capture below")
def test_graphs_replay_the_captured_shape_and_run_other_shapes_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    EagerCapture.made = []
    data = Batches([4, 4, 2])  # two full batches (2 micro-batches of 2 each), then a last batch of 2 (1 + 1)
    install = InstallStandIn()
    trainer = _trainer(Compressed3DStrategy(num_microbatches=2), steps=3, callbacks=[install])
    with pytest.warns(UserWarning, match=r"cuda_graphs: stage 0 captured micro-batches of shapes \{input_ids=\[2, 16\],"
                                         r" labels=\[2, 16\]\} and got one of \{input_ids=\[1, 16\], labels=\[1, 16\]\};"
                                         r" such micro-batches run eagerly"):
        trainer.fit(GPT("tiny", vocab_size=256, seq_length=16), datamodule=data)
    (capture,) = EagerCapture.made  # one capture, of the first micro-batch's shapes
    assert capture.captured_shape == (2, 16)
    assert install.graphs.replays == 4 and install.graphs.eager == 2  # the full batches' four; the last batch's two
    assert [tuple(ids.shape) for ids in capture.calls] == [(2, 16)] * 4
    assert not capture.pending  # every replayed forward got its backward
    assert install.graphs.memory() == {"reserved": 0, "allocated": 0}  # the stand-in holds no CUDA pool


@pytest.mark.skipif(GPU, reason="the stand-in is for CPU runs")
def test_a_forward_while_the_graphed_one_awaits_its_backward_runs_eagerly() -> None:
    """An explicit order F0 F1 B0 B1 at pp = 1 (a MicroBatches batch): the second forward cannot use the graph's
    buffers, which hold the first micro-batch's activations until its backward."""
    EagerCapture.made = []

    class Orders(pl.LightningDataModule):
        def train_dataloader(self):
            ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
            mbs = [{"input_ids": ids[i:i + 2], "labels": ids[i:i + 2]} for i in (0, 2)]
            order = (Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1))
            # collate_fn keeps the MicroBatches (default_convert would make it a plain list, without its orders)
            return torch.utils.data.DataLoader([MicroBatches(mbs, orders=[order])] * 2, batch_size=None,
                                               collate_fn=lambda batch: batch)

    install = InstallStandIn()
    trainer = _trainer(Compressed3DStrategy(), steps=2, callbacks=[install])
    with pytest.warns(UserWarning, match=r"stage 0 got a forward while its graphed micro-batch still waits for its"
                                         r" backward .* run eagerly"):
        trainer.fit(GPT("tiny", vocab_size=256, seq_length=16), datamodule=Orders())
    assert install.graphs.replays == 2 and install.graphs.eager == 2  # per step: F0 replayed, F1 eager


def test_a_microbatch_that_is_not_a_flat_mapping_always_runs_eagerly() -> None:
    graphs = StageGraphs(capture=EagerCapture)
    stage = torch.nn.Linear(2, 2)

    class Stage(torch.nn.Module):
        def forward(self, *received, microbatch):
            return stage(microbatch[0])

    with pytest.warns(UserWarning, match="got a micro-batch of type list that is not a flat mapping"):
        out = graphs.forward(0, Stage(), [], [torch.ones(1, 2)])
    assert out.shape == (1, 2) and graphs.eager == 1 and graphs.replays == 0 and not graphs.graphs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per stage
        graphs.forward(0, Stage(), [], [torch.ones(1, 2)])


def test_a_stage_that_cannot_be_captured_stops_with_what_failed() -> None:
    def refuse(stage, received, microbatch, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StageGraphs(capture=refuse)
    with pytest.raises(RuntimeError, match=r"cuda_graphs: capturing stage 3 \(Linear\) on micro-batch shapes"
                                           r" \{x=\[2, 4\]\} failed: RuntimeError: operation not permitted when stream"
                                           r" is capturing\. A captured stage may not synchronise with the host"):
        graphs.forward(3, torch.nn.Linear(4, 4), [], {"x": torch.ones(2, 4)})


# ----- the real capture (GPU) -----------------------------------------------------------------------------------------
def _gpu_fit(recipe: str, cuda_graphs: bool, steps: int = 4, accumulate: int = 1, data=None, **kwargs):
    losses: list[float] = []
    pool: dict[str, int] = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer, module) -> None:  # before the strategy's teardown frees the graphs
            graphs = trainer.strategy.pipeline_runtime.graphs
            pool.update(graphs.memory() if graphs is not None else {})

    torch.manual_seed(0)
    if recipe == "gpt":
        module = GPT("tiny", vocab_size=512, seq_length=64, dropout=0.0, **kwargs)
        data = data or SyntheticLMDataModule(vocab_size=512, seq_length=64, batch_size=8, num_samples=64)
    else:
        module = T5("tiny", vocab_size=512, dropout=0.0, **kwargs)
        data = SyntheticSeq2SeqDataModule(vocab_size=512, input_length=32, target_length=16, batch_size=8,
                                          num_samples=64)
    strategy = Compressed3DStrategy(num_microbatches=2, cuda_graphs=cuda_graphs, compression=False)
    trainer = _trainer(strategy, steps, callbacks=[Record()], accumulate=accumulate)
    trainer.fit(module, datamodule=data)
    graphs = strategy.engine.runtime.graphs
    counts = (graphs.replays, graphs.eager) if graphs is not None else None
    if graphs is not None:
        assert graphs.memory() == {"reserved": 0, "allocated": 0}  # released at teardown
        counts += (pool,)
    return losses, [p.detach().float().cpu() for p in module.parameters()], counts


# What may differ between a replayed graph and the eager step: nothing in the arithmetic (the graph replays the kernels
# the eager call launched during capture, on the same buffers' values), so the runs agree to rounding at most: one bf16
# ulp of a loss (2**-8 relative) bounds a different kernel choice for one GEMM under capture; parameters after a few
# AdamW steps move by at most about lr per step each, so they agree to 2 x lr x steps.
LOSS_RTOL = 2**-8


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "recipe, kwargs, accumulate",
    [
        ("gpt", {}, 1),
        ("gpt", {}, 2),  # accumulation over two batches of two micro-batches each
        ("gpt", {"activation_checkpointing": True}, 1),
        ("gpt", {"compile": True}, 2),
        ("t5", {}, 1),
        ("t5", {"compile": True}, 1),
    ],
)
def test_graphed_fits_equal_eager_fits(recipe: str, kwargs: dict, accumulate: int) -> None:
    eager_losses, eager_params, _ = _gpu_fit(recipe, False, accumulate=accumulate, **kwargs)
    graphed_losses, graphed_params, (replays, eager, pool) = _gpu_fit(recipe, True, accumulate=accumulate, **kwargs)
    assert replays == 4 * accumulate * 2 and eager == 0  # every micro-batch replays (the first after its capture)
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(eager_losses), rtol=LOSS_RTOL, atol=0)
    for a, b in zip(graphed_params, eager_params):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * 3e-4 * 4)  # the recipes' learning rate, 4 steps
    # The pool holds the backward graph's gradient buffers, counted as allocated (fp32 parameters: 4 bytes each), and
    # the activations kept between the two graphs, which the allocator counts as free (StageGraphs.memory).
    gradient_bytes = sum(4 * p.numel() for p in graphed_params)
    assert pool["allocated"] >= gradient_bytes and pool["reserved"] > pool["allocated"], (pool, gradient_bytes)
    print(f"{recipe} {kwargs} accumulate={accumulate}: bitwise equal losses: {graphed_losses == eager_losses};"
          f" graph pool {pool}")


@pytest.mark.skipif(not GPU, reason="CUDA graphs need a GPU")
def test_a_last_batch_of_other_shapes_runs_eagerly_on_the_gpu() -> None:
    with pytest.warns(UserWarning, match="such micro-batches run eagerly"):
        graphed_losses, graphed_params, (replays, eager, _) = _gpu_fit("gpt", True, steps=3, data=Batches([8, 8, 4], 64, 512))
    eager_losses, eager_params, _ = _gpu_fit("gpt", False, steps=3, data=Batches([8, 8, 4], 64, 512))
    assert (replays, eager) == (4, 2)  # batches of 8, 8, 4: four micro-batches of 4 replayed, two of 2 eager
    torch.testing.assert_close(torch.tensor(graphed_losses), torch.tensor(eager_losses), rtol=LOSS_RTOL, atol=0)
