"""The fit check (strategies/fit_check.py) and the memory model it shares with the planner (costs/memory.py).

The memory model is the planner's (the same numbers for a layout both can describe); what the strategy adds
(context and sequence parallelism, the sharded optimizer, the chunked loss, a tied head, the position table) changes
exactly the component it should. The check raises only beyond the margin, warns below it, and every rank of a job
raises the same message before any collective (the distributed scenario at the end).
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.costs import AnalyticCostModel, ClusterSpec, device_spec, layer_parameters
from lightning_3d.costs.memory import LOSS_CHUNK_ELEMENTS, TrainingState, layout_memory
from lightning_3d.planner.model import Candidate, predict
from lightning_3d.planner.model import Workload as PlannerWorkload
from lightning_3d.recipes import GPT, T5
from lightning_3d.recipes.kernels import CHUNK_ELEMENTS
from lightning_3d.strategies.fit_check import (
    CAPACITY_ENV,
    GIB,
    MARGIN,
    RESERVE,
    DoesNotFitError,
    FitReport,
    check_fit,
    device_capacity,
    read_workload,
    size,
)
from lightning_3d.strategies.options import resolve_options
from tests.launch import run_scenario

CPU = torch.device("cpu")


def options(pp: int = 1, **kw):
    base = dict(pipeline_parallel_size=pp, tensor_parallel_size=kw.pop("tp", 1), num_microbatches=kw.pop("m", None),
                schedule=kw.pop("schedule", "1f1b"), virtual_stages=None, sequence_parallel=kw.pop("sequence_parallel", False),
                pipeline_layer_split=kw.pop("split", None), stage_activation_checkpointing=kw.pop("ckpt", None),
                bucket_size_mb=25.0, gradient_accumulation_fusion=True, on_nonfinite="skip", max_consecutive_nonfinite=10,
                checkpoint_io=None, shard_optimizer_state=kw.pop("shard", False))
    assert not kw
    return resolve_options(**base)


def gpt_workload(seq=4096, batch=4, dp=1, pp=1, tp=1, cp=1, precision="bf16-mixed", model=None, **kw):
    model = model or dict(preset_name="350m", vocab_size=50257)
    module = GPT(seq_length=seq, **model)
    return read_workload(module, SimpleNamespace(hparams={"seq_length": seq, "batch_size": batch}), dp=dp, pp=pp, tp=tp,
                         cp=cp, precision=precision, options=options(pp, tp=tp, **kw))


def test_the_memory_model_is_the_planners() -> None:
    """A layout both describe (no positions, untied, fp32 state): the same bytes per pipeline rank as predict()."""
    w = gpt_workload(seq=2048, batch=8, pp=2, m=4, ckpt=(True, False))
    lay = replace(w.layout, position_parameters=0, tied_head=False)
    cost = AnalyticCostModel(w.shape, warn=False)
    cluster = ClusterSpec(1, 2, device_spec("h100"), 450e9, 450e9)
    planner = PlannerWorkload(w.shape, w.seq_len, 8, cost, cluster, memory_reserve=0.0)
    c = Candidate(1, 2, 1, lay.microbatch_size, lay.num_microbatches, "1f1b", 1, lay.layer_split, lay.stage_checkpointing, False)
    ours = [r.total for r in layout_memory(cost, w.shape, w.seq_len, lay)]
    assert lay.microbatch_size == 2 and lay.layer_split == (12, 12)
    assert ours == pytest.approx(predict(c, planner).stage_memory, rel=1e-12)


def test_the_chunk_size_is_the_kernels() -> None:
    assert LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS


def test_training_state_bytes_per_parameter() -> None:
    assert TrainingState.of("bf16-mixed").total == 16 and TrainingState.of("32-true").total == 16
    assert TrainingState.of("bf16-true").total == 8  # bf16 weights, gradients and moments (the planner's 8)
    assert TrainingState.of("bf16-mixed", dp=4, shard_optimizer_state=True) == TrainingState(4, 4, 2)
    assert TrainingState.of("bf16-true", dp=4, shard_optimizer_state=True) == TrainingState(2, 2, 3)  # fp32 masters too
    assert TrainingState.of("bf16-mixed", dp=1, shard_optimizer_state=True).optimizer == 8  # nothing to shard over


def test_each_option_changes_its_component() -> None:
    w = gpt_workload(seq=8192, batch=2)
    base = w.estimate()[0]
    h = w.shape.hidden_size
    # Parameters: 24 blocks, the embedding (tied: the head's copy counted once), the position table, final norm.
    params = 24 * layer_parameters(w.shape, "block") + layer_parameters(w.shape, "head") + 8192 * h
    assert base.weights == pytest.approx(4 * params) and base.optimizer == pytest.approx(8 * params)
    # Context parallelism: every layer runs half the tokens (the analytic memory is linear in them), weights stay.
    half = replace(w, layout=replace(w.layout, cp=2)).estimate()[0]
    assert half.weights == base.weights and half.activations == pytest.approx(base.activations / 2)
    assert half.transient == pytest.approx(base.transient / 2)
    # A micro-batch of one sequence instead of two: the same, from the other side.
    one = replace(w, layout=replace(w.layout, microbatch_size=1, num_microbatches=2)).estimate()[0]
    assert one.activations == pytest.approx(base.activations / 2)
    # Sharded optimizer over dp = 4: only the optimizer state shrinks, by 4.
    shard = replace(w, layout=replace(w.layout, dp=4, shard_optimizer_state=True)).estimate()[0]
    assert (shard.weights, shard.grads, shard.activations) == (base.weights, base.grads, base.activations)
    assert shard.optimizer == pytest.approx(base.optimizer / 4)
    # ... over the dp x cp replicas: context-parallel ranks hold the same parameters.
    both = replace(w, layout=replace(w.layout, dp=2, cp=2, shard_optimizer_state=True)).estimate()[0]
    assert both.optimizer == pytest.approx(base.optimizer / 4) and both.weights == base.weights
    # Checkpointing: a block keeps only its input (b·s·h bf16) and recomputes one block at a time.
    ckpt = replace(w, layout=replace(w.layout, stage_checkpointing=(True,))).estimate()[0]
    cost = AnalyticCostModel(w.shape, warn=False)
    head_stored = float(cost.layer_memory("head", 2, 8192)[0])
    assert ckpt.activations == pytest.approx(24 * 2 * 2 * 8192 * h + head_stored)
    # The chunked loss: no full-vocabulary logits; the hidden states' gradient and the fp32 weight gradient remain.
    chunked = replace(w, layout=replace(w.layout, chunked_loss=True)).estimate()[0]
    assert base.activations - chunked.activations == pytest.approx(head_stored - (2 * 2 * 16384 * h + 4 * 50304 * h))
    chunk = LOSS_CHUNK_ELEMENTS // 50304
    assert chunked.transient == pytest.approx(max(sum(map(float, cost.layer_memory("head", 1, chunk))),
                                                  float(cost.layer_memory("block", 2, 8192)[1])))
    assert chunked.transient < base.transient / 2


def test_sequence_parallelism_splits_every_stored_tensor_of_a_block() -> None:
    tp = gpt_workload(seq=4096, batch=1, tp=2)
    sp = replace(tp, layout=replace(tp.layout, sequence_parallel=True))
    cost = AnalyticCostModel(tp.shape, warn=False)
    block_tp = float(cost.layer_memory("block", 1, 4096, tp=2)[0])
    block_sp = float(cost.layer_memory("block", 1, 2048, tp=1)[0])
    assert block_sp < block_tp
    assert tp.estimate()[0].activations - sp.estimate()[0].activations == pytest.approx(24 * (block_tp - block_sp))


def test_read_workload_knows_the_recipes_only() -> None:
    w = gpt_workload(seq=1024, batch=8, pp=2, m=4, ckpt=(True, False))
    assert (w.name, w.seq_len, w.layout.microbatch_size, w.layout.num_microbatches) == ("GPT", 1024, 2, 4)
    assert w.layout.stage_checkpointing == (True, False) and w.layout.layer_split == (12, 12)
    assert w.layout.position_parameters == 1024 * 1024 and w.layout.tied_head
    # The model's own settings where the strategy gives none; an unknown batch counts as one sequence.
    module = GPT("tiny", activation_checkpointing=True, fused_head_loss=True)
    w = read_workload(module, None, dp=1, pp=1, tp=1, cp=1, precision="32-true", options=options())
    assert w.layout.stage_checkpointing == (True,) and w.layout.chunked_loss and w.layout.microbatch_size == 1
    assert w.seq_len == module.config.seq_length and w.shape.bytes_per_element == 4

    # T5: encoder and decoder blocks cut into stages, the target length from the data module.
    t5 = read_workload(T5("tiny"), SimpleNamespace(hparams={"input_length": 64, "target_length": 16, "batch_size": 4}),
                       dp=1, pp=2, tp=1, cp=1, precision="32-true", options=options(2, m=2))
    assert (t5.name, t5.seq_len, t5.target_len, t5.layout.layer_split, t5.layout.microbatch_size) == ("T5", 64, 16, (2, 2), 2)
    assert not t5.layout.chunked_loss and t5.layout.position_parameters == 0 and len(t5.estimate()) == 2

    class Own(torch.nn.Module):
        config = module.config

    assert read_workload(Own(), None, dp=1, pp=1, tp=1, cp=1, precision="32-true", options=options()) is None


def test_verdicts_and_modes(monkeypatch) -> None:
    w = gpt_workload(seq=4096, batch=4)
    peak = max(r.total for r in w.estimate())

    def capacity_for(ratio: float) -> float:  # the card for which the peak is ``ratio`` x the usable memory
        return (peak / ratio + RESERVE) / GIB

    warned = []
    for ratio, verdict in ((0.9, "fits"), (1 + MARGIN / 2, "may not fit"), (1 + 2 * MARGIN, "does not fit")):
        monkeypatch.setenv(CAPACITY_ENV, str(capacity_for(ratio)))
        report = FitReport(w, w.estimate(), device_capacity(CPU))
        assert report.verdict() == verdict
        for mode in ("error", "warn"):
            warned.clear()
            if verdict == "does not fit" and mode == "error":
                with pytest.raises(DoesNotFitError, match="this configuration does not fit in GPU memory") as err:
                    check_fit(mode, lambda: w, CPU, warned.append)
                assert str(err.value) == report.message()
            else:
                assert check_fit(mode, lambda: w, CPU, warned.append).peak == peak
                assert warned == ([] if verdict == "fits" else [report.message()])
        assert check_fit("off", lambda: w, CPU, warned.append) is None
    monkeypatch.delenv(CAPACITY_ENV)
    assert check_fit("error", lambda: w, CPU, warned.append) is None  # no card on CPU: skipped
    monkeypatch.setenv(CAPACITY_ENV, "eighty")
    with pytest.raises(ValueError, match=f"{CAPACITY_ENV}='eighty' must be a positive number of GiB"):
        device_capacity(CPU)


def test_the_message_names_components_card_and_fixes_with_their_estimates() -> None:
    w = gpt_workload(seq=32768, batch=1, model=dict(preset_name="1.3b", vocab_size=50257))
    report = FitReport(w, w.estimate(), 80 * GIB)
    text = report.message()
    r = report.ranks[0]
    assert f"the estimate is {r.total / GIB:.1f} GiB per GPU, the card has 80.0 GiB (78.5 GiB usable" in text
    for name, value in r.components().items():
        assert f"{name} {size(value)}" in text
    fixes = dict(report.fixes())
    ckpt = replace(w.layout, stage_checkpointing=(True,))
    assert fixes[next(n for n in fixes if n.startswith("activation checkpointing"))] == max(
        x.total for x in layout_memory(AnalyticCostModel(w.shape, warn=False), w.shape, w.seq_len, ckpt))
    assert fixes["the chunked loss (the model's fused_head_loss=True)"] < r.total
    assert any(n.startswith("context_parallel_size=2") for n in fixes)
    assert any(n.startswith("tensor_parallel_size=2") for n in fixes)
    assert "shard_optimizer_state" not in text  # nothing to shard over at dp = 1
    for name, value in fixes.items():
        assert f"{'fits' if value <= report.usable else 'over':>4}  {size(value):>10}  {name}" in text
    sharded = FitReport(replace(w, layout=replace(w.layout, dp=2)), w.estimate(), 80 * GIB)
    assert "shard_optimizer_state=True" in dict(sharded.fixes())


def test_sizes_read_in_gib_or_mib() -> None:
    assert (size(80 * GIB), size(1.5 * GIB), size(3 * 2**20)) == ("80.0 GiB", "1.5 GiB", "3.0 MiB")


def test_the_option_is_validated() -> None:
    with pytest.raises(ValueError, match="`memory_check='maybe'` must be one of 'error', 'warn', 'off'"):
        Compressed3DStrategy(memory_check="maybe")
    assert Compressed3DStrategy(memory_check="warn").memory_check == "warn"


def test_every_rank_stops_with_the_same_message(tmp_path) -> None:
    report = tmp_path / "report.json"
    run_scenario(2, "fit_check", ["--world", "2"], report, timeout=600)
    ranks = [json.loads(report.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]
    for seen in ranks:
        assert seen["too_small"]["error"].startswith("DoesNotFitError: Compressed3DStrategy: this configuration does"
                                                     " not fit in GPU memory")
        assert "pipeline rank 0, the largest" in seen["too_small"]["error"]
        assert seen["too_small_warn"]["error"] is None and seen["too_small_warn"]["estimate"]
        assert seen["too_small_off"] == {"error": None, "warnings": [], "estimate": False}
        assert seen["large"] == {"error": None, "warnings": [], "estimate": True}
        assert seen["own_model"] == {"error": None, "warnings": [], "estimate": False}  # not a model it knows
        assert seen["validate"] == {"estimate": False}
        assert len(seen["healthy_losses"]) == 5
        # gc_interval=2: full collections before steps 2 and 4 on every rank, automatic collection off, all given back.
        assert seen["gc"] == {"steps": [2, 4], "enabled_in_batches": [False] * 5, "enabled_after": True,
                              "frozen_after": 0}
    assert ranks[0]["too_small"]["error"] == ranks[1]["too_small"]["error"]
    # "warn": the same message as a warning, once (on rank 0).
    assert ranks[0]["too_small_warn"]["warnings"] == [ranks[0]["too_small"]["error"].removeprefix("DoesNotFitError: ")]


def config_workload(name: str, **strategy_overrides):
    """The fit check's workload of a packaged config, as the strategy would read it on its GPUs."""
    from importlib import resources

    import yaml

    from lightning_3d.strategies.config import flatten_options, nest_options

    cfg = yaml.safe_load(resources.files("lightning_3d.recipes").joinpath("configs", f"{name}.yaml").read_text())
    init = {**flatten_options(cfg["trainer"]["strategy"]["init_args"]), **strategy_overrides}
    strategy = Compressed3DStrategy(**nest_options(init))
    data = cfg["data"]["init_args"]
    module = GPT(**{**cfg["model"]["init_args"], "vocab_size": data["tokenizer_vocab_size"], "seq_length": data["seq_length"]})
    cp, world = init.get("context_parallel_size", 1), cfg["trainer"]["devices"]
    return read_workload(module, SimpleNamespace(hparams=data), dp=world // cp, pp=1, tp=1, cp=cp,
                         precision=cfg["trainer"]["precision"], options=strategy.options), cfg


def test_the_long_config_parses_and_fits_an_h100(capsys) -> None:
    from lightning_3d.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", "gpt_1.3b_long", "--print_config"])
    assert exc.value.code in (0, None)
    printed = capsys.readouterr().out
    for line in ("context_parallel_size: 2", "shard_optimizer_state: true", "memory_check: error", "seq_length: 262144",
                 "activation_checkpointing: true", "fused_head_loss: true", "preset_name: 1.3b"):
        assert line in printed, line
    w, cfg = config_workload("gpt_1.3b_long")
    assert (w.layout.dp, w.layout.cp, w.seq_len, w.layout.microbatch_size) == (4, 2, 262144, 1)
    h100 = FitReport(w, w.estimate(), 80 * GIB)
    assert h100.verdict() == "fits" and h100.peak < 0.8 * h100.usable  # room for the model's error
    # Without context parallelism and the sharded optimizer the same sequences are over one H100; the message offers
    # both changes, each of which fits.
    alone, _ = config_workload("gpt_1.3b_long", context_parallel_size=1, shard_optimizer_state=False)
    report = FitReport(alone, alone.estimate(), 80 * GIB)
    assert report.peak > report.usable and report.verdict() != "fits"
    fixes = dict(report.fixes())
    assert fixes["context_parallel_size=2 (2x the GPUs, or data_parallel_size=4)"] <= report.usable
    assert fixes["shard_optimizer_state=True"] <= report.usable
