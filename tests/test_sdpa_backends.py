"""The recipes' ``sdpa_backends`` option (recipes/attention.py): which SDPA backends GPT's and T5's attention may run.

The default, ``"auto"``, is resolved once, in ``configure_model`` before the model exists: ``"no_cudnn"`` when the
training data declares changing micro-batch shapes (MultiTaskDataModule's padding, token budget and dynamic
micro-batching), ``"torch"`` for fixed shapes (packing, the fixed-length data modules, no declaration, no Trainer);
real single-process fits check it from the flags at every SDPA call, the first forward's included.

A resolved value, ``"no_cudnn"``, must hold in every place a kernel is chosen: the eager forward, activation
checkpointing's recomputation (which must pick the kernel the forward picked, or torch's checkpoint refuses the
recomputed tensors) and compiled graphs (where the choice is made once, at trace time, and baked into the graph). CPU
has no cuDNN, so what the tests observe is the backend flags SDPA sees when it is called (eager and recomputation) and,
in compiled graphs, the kernel traced into the graph with the selection narrowed to math alone (on CPU the default
selection and torch's pick the same flash kernel, so only a narrower selection shows in a graph). Results: on CPU both
values run the same kernel on the same inputs, so loss and gradients are bitwise equal. Which kernel a GPU picks is
measured by benchmarks/speed/peers.py (+torchsdpa, +nocudnn) and benchmarks/dynamic/multitask_microbatching.py (--sdpa),
docs/dynamic.md.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT, T5, attention
from lightning_3d.recipes.data import SyntheticLMDataModule
from lightning_3d.recipes.data.multitask import MultiTaskDataModule
from lightning_3d.recipes.gpt.config import GPTConfig
from lightning_3d.recipes.gpt.config import preset as gpt_preset
from lightning_3d.recipes.gpt.model import GPTModel
from lightning_3d.recipes.t5.config import T5Config
from lightning_3d.recipes.t5.config import preset as t5_preset
from lightning_3d.recipes.t5.model import T5Model, run_stage

ALL_ON = {"flash": True, "efficient": True, "cudnn": True, "math": True}
NO_CUDNN = {"flash": True, "efficient": True, "cudnn": False, "math": True}


def flags() -> dict[str, bool]:
    return {"flash": torch.backends.cuda.flash_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(), "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled()}


@pytest.fixture
def recorded(monkeypatch):
    """The backend flags in force at every eager SDPA call (then the real call)."""
    seen: list[dict[str, bool]] = []
    real = F.scaled_dot_product_attention

    def record(*args, **kwargs):
        seen.append(flags())
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    assert flags() == ALL_ON  # torch's default: the "torch" rows below compare against it
    return seen


def gpt(sdpa_backends: str, checkpointing: bool = False) -> GPTModel:
    config = gpt_preset("tiny", vocab_size=97, seq_length=32, num_layers=2, sdpa_backends=sdpa_backends)
    model = GPTModel(config, activation_checkpointing=checkpointing)
    model.init_weights(1234)
    return model


def t5(sdpa_backends: str, checkpointing: bool = False) -> T5Model:
    config = t5_preset("tiny", vocab_size=97, num_layers=2, num_decoder_layers=2, hidden_size=32, num_heads=4,
                       head_dim=8, ffn_hidden_size=64, sdpa_backends=sdpa_backends)
    model = T5Model(config, activation_checkpointing=checkpointing, attention="sdpa")
    model.init_weights(1)
    return model


def gpt_loss(model: GPTModel) -> torch.Tensor:
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(3))
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1)[:, :97], ids[:, 1:].flatten())


def t5_loss(model: T5Model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 97, (3, 12), generator=g),
             "decoder_input_ids": torch.randint(0, 97, (3, 6), generator=g),
             "attention_mask": torch.ones(3, 12, dtype=torch.long)}
    batch["attention_mask"][1, 8:] = 0  # a padding mask: SDPA gets an additive mask, as T5 always gives it
    labels = torch.randint(0, 97, (3, 6), generator=g)
    return F.cross_entropy(run_stage(model, (), batch)[..., :97].flatten(0, 1), labels.flatten())


def test_default_is_auto_and_no_cudnn_excludes_only_cudnn():
    assert GPTConfig().sdpa_backends == T5Config().sdpa_backends == attention.DEFAULT_SDPA_BACKENDS == "auto"
    assert attention.SDPA_BACKENDS_CHOICES == ("auto", "no_cudnn", "torch")
    assert set(attention.SDPA_BACKENDS["no_cudnn"]) == {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                       SDPBackend.MATH}
    assert attention.SDPA_BACKENDS["torch"] is None


@pytest.mark.parametrize("build, loss_of, calls", [(gpt, gpt_loss, 2), (t5, t5_loss, 6)], ids=["gpt", "t5"])
@pytest.mark.parametrize("value", ["no_cudnn", "torch"])
def test_selection_holds_in_forward_and_in_recomputation(recorded, build, loss_of, calls, value):
    """Two blocks per stack, checkpointed: GPT's 2 attentions, T5's 2 encoder self, 2 decoder self and 2 cross; each
    runs once in the forward and once more when the backward recomputes its block, under the same flags."""
    loss = loss_of(build(value, checkpointing=True))
    assert len(recorded) == calls
    loss.backward()
    assert len(recorded) == 2 * calls  # the recomputation's calls
    assert recorded == [NO_CUDNN if value == "no_cudnn" else ALL_ON] * (2 * calls)
    assert flags() == ALL_ON  # restored after each call


def test_compiled_graphs_trace_the_selection(monkeypatch):
    """A checkpointed GPT compiled whole with fullgraph=True (a graph break would raise): the forward and backward
    graphs hold the kernel the selection allows. The selection narrowed to math alone: torch's choice traces CPU's
    flash kernel, math alone its decomposition (no flash op) in the forward, and in the backward, which recomputes
    the checkpointed attention from the same trace."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setitem(attention.SDPA_BACKENDS, "no_cudnn", [SDPBackend.MATH])
    flash_ops = {}
    for value in ("no_cudnn", "torch"):
        graphs: list[str] = []

        def capture(gm, example_inputs):
            graphs.append(gm.code)
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        model = gpt(value, checkpointing=True)
        compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
        gpt_loss(compiled).backward()
        assert len(graphs) == 2  # one forward, one backward: no break
        flash_ops[value] = [g.count("_scaled_dot_product_flash_attention_for_cpu") for g in graphs]
    torch._dynamo.reset()
    assert flash_ops["no_cudnn"] == [0, 0]
    assert flash_ops["torch"][0] >= 2 and flash_ops["torch"][1] >= 2  # 2 blocks: forward ops, backward ops


@pytest.mark.parametrize("build, loss_of", [(gpt, gpt_loss), (t5, t5_loss)], ids=["gpt", "t5"])
def test_loss_and_gradients_equal_torchs_choice(build, loss_of):
    """CPU has no cuDNN: both selections run the same CPU kernel on the same inputs, so bitwise equal."""
    results = []
    for value in ("no_cudnn", "torch"):
        model = build(value, checkpointing=True)
        loss = loss_of(model)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)


def test_bad_value_names_it_and_the_choices():
    message = r"sdpa_backends='cudnn' is not supported; choose one of \['auto', 'no_cudnn', 'torch'\]"
    for make in (lambda: GPTConfig(sdpa_backends="cudnn"), lambda: T5Config(sdpa_backends="cudnn"),
                 lambda: GPT(sdpa_backends="cudnn"), lambda: T5(sdpa_backends="cudnn")):
        with pytest.raises(ValueError, match=message):
            make()
    # The modules pass the option to the config (the YAML/CLI path, tests/test_cli.py); None keeps the default.
    assert GPT(sdpa_backends="torch").config.sdpa_backends == "torch" and GPT().config.sdpa_backends == "auto"
    assert T5(sdpa_backends="torch").config.sdpa_backends == "torch" and T5().config.sdpa_backends == "auto"
    with pytest.raises(ValueError, match=message):
        attention.resolve_sdpa_backends("cudnn", varies_microbatch_shapes=True)


def test_auto_resolves_by_the_declared_shapes_and_explicit_values_stay():
    resolve = attention.resolve_sdpa_backends
    assert [resolve("auto", True), resolve("auto", False)] == ["no_cudnn", "torch"]
    assert [resolve(v, s) for v in ("no_cudnn", "torch") for s in (True, False)] == ["no_cudnn"] * 2 + ["torch"] * 2

    class Declares:
        def __init__(self, varies):
            self.varies_microbatch_shapes = varies

    class Loader:  # a loader answers through its collate_fn, then its dataset
        def __init__(self, collate_fn=None, dataset=None):
            self.collate_fn, self.dataset = collate_fn, dataset

    varies = attention.data_varies_microbatch_shapes
    assert varies() is False and varies(None, object()) is False  # nothing declared: fixed shapes
    assert varies(None, Declares(True)) is True and varies(Declares(False), Declares(True)) is False  # the first says
    assert varies(Loader(collate_fn=Declares(True))) is True and varies(Loader(dataset=Declares(True))) is True
    assert varies(Loader(collate_fn=Declares(False), dataset=Declares(True))) is False


@pytest.mark.parametrize("build", [gpt, t5], ids=["gpt", "t5"])
def test_auto_outside_a_trainer_is_torchs_choice(recorded, build):
    """A model built from a config without a Trainer (a plain loop, the benchmarks' direct engine): no data says
    that shapes vary, so torch's own choice, as the recipes' modules resolve it without a trainer."""
    model = build("auto")
    assert {m.sdpa_backends for m in model.modules() if hasattr(m, "sdpa_backends")} == {"torch"}
    (gpt_loss if build is gpt else t5_loss)(model)
    assert recorded and recorded == [ALL_ON] * len(recorded)
    module = GPT("tiny", vocab_size=97, seq_length=32, num_layers=1)
    module.configure_model()
    assert module.model.config.sdpa_backends == "torch" and module.config.sdpa_backends == "auto"


FLAN = Path(__file__).parent / "data" / "multitask" / "flan_tiny.jsonl"


@pytest.fixture(scope="module")
def multitask_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("multitask_cache"))


def multitask(cache: str, model_type: str, microbatching: str) -> MultiTaskDataModule:
    extra = {"memory_budget_gb": 0.02} if microbatching == "dynamic" else {}
    return MultiTaskDataModule(model_type=model_type, data_files=str(FLAN), tokenizer="bytes", seq_length=64,
                               target_length=32, global_batch_size=4, microbatching=microbatching, micro_batch_size=2,
                               token_budget=128, val_fraction=0.0, cache_dir=cache, **extra)


def fit_recording(module: pl.LightningModule, recorded: list, **data) -> None:
    """One training step of ``module`` under Compressed3DStrategy (one CPU process), SDPA's flags recorded at every
    call. ``module.model is None`` before the fit: its configure_model builds it, resolving "auto" first."""
    assert module.model is None
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Compressed3DStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, **data)
    assert recorded


CASES = [("padding", "auto", NO_CUDNN), ("token_budget", "auto", NO_CUDNN), ("dynamic", "auto", NO_CUDNN),
         ("packing", "auto", ALL_ON), ("dynamic", "torch", ALL_ON), ("packing", "no_cudnn", NO_CUDNN)]


@pytest.mark.parametrize("microbatching, value, expected", CASES, ids=[f"{m}-{v}" for m, v, _ in CASES])
def test_auto_in_a_fit_follows_the_multitask_microbatching(recorded, multitask_cache, microbatching, value,
                                                           expected):
    """GPT on the multi-task data: every SDPA call of the step, from the first forward on, runs under the value
    resolved from the data module (explicit values kept whatever the data)."""
    dm = multitask(multitask_cache, "gpt", microbatching)
    module = GPT("tiny", vocab_size=dm.vocab_size, seq_length=64, num_layers=1, hidden_size=32, num_heads=2,
                 sdpa_backends=value, packed_attention="sdpa")
    fit_recording(module, recorded, datamodule=dm)
    assert recorded == [expected] * len(recorded)
    assert module.model.config.sdpa_backends == ("no_cudnn" if expected == NO_CUDNN else "torch")
    assert module.config.sdpa_backends == value  # the module keeps what was asked for
    assert dm.varies_microbatch_shapes is (microbatching != "packing")


def test_auto_in_fits_of_fixed_shapes_t5_and_a_loader_without_its_module(recorded, multitask_cache):
    """The fixed-length data module (torch's choice); T5 with attention="sdpa" on padded multi-task pairs (no cuDNN);
    a multi-task loader handed to fit without its data module (its collate function declares the shapes)."""
    module = GPT("tiny", vocab_size=97, seq_length=32, num_layers=1, hidden_size=32, num_heads=2)
    fit_recording(module, recorded, datamodule=SyntheticLMDataModule(vocab_size=97, seq_length=32, batch_size=2,
                                                                     num_samples=8))
    assert recorded == [ALL_ON] * len(recorded) and module.model.config.sdpa_backends == "torch"
    recorded.clear()

    dm = multitask(multitask_cache, "t5", "padding")
    module = T5("tiny", vocab_size=dm.vocab_size, pad_token_id=dm.pad_token_id, eos_token_id=dm.eos_token_id,
                decoder_start_token_id=dm.pad_token_id, num_layers=1, num_decoder_layers=1, attention="sdpa")
    fit_recording(module, recorded, datamodule=dm)
    assert recorded == [NO_CUDNN] * len(recorded) and module.model.config.sdpa_backends == "no_cudnn"
    recorded.clear()

    dm = multitask(multitask_cache, "gpt", "token_budget")
    dm.setup("fit")
    module = GPT("tiny", vocab_size=dm.vocab_size, seq_length=64, num_layers=1, hidden_size=32, num_heads=2)
    fit_recording(module, recorded, train_dataloaders=dm.train_dataloader())
    assert recorded == [NO_CUDNN] * len(recorded) and module.model.config.sdpa_backends == "no_cudnn"
