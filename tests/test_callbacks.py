"""The callbacks of ``lightning_3d.callbacks``: single-process units, YAML instantiation, and one 4-process run."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_3d import MicroBatches
from lightning_3d.callbacks import (
    CommunicationMonitor,
    CompressionDiagnostics,
    CompressionStateMonitor,
    PipelineTimeline,
    ThroughputMFUMonitor,
)
from lightning_3d.callbacks.diagnostics import DiagnosticsRecorder, cosine
from lightning_3d.callbacks.plumbing import ObserverFanout, SpanRecorder, attach, detach
from lightning_3d.callbacks.throughput import peak_tflops_of
from lightning_3d.callbacks.timeline import chrome_trace, idle_gaps
from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig
from lightning_3d.pipeline.codec import BoundaryKey
from lightning_3d.recipes import GPT
from tests.launch import run_scenario

PNG = b"\x89PNG\r\n\x1a\n"


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.reshape(1, -1).double(), b.reshape(1, -1).double()).item()


@pytest.mark.parametrize("order", ["one_f_one_b", "gpipe"])
@pytest.mark.parametrize("tp", [1, 2])
def test_diagnostic_cosines_equal_a_direct_computation(order: str, tp: int) -> None:
    """Drive the codec with known gradients and activations; the recorder's means equal cosines computed here."""
    torch.manual_seed(0)
    codec = CompressedBackprop(CompressedBackpropConfig(rank=2, epilogue_only=False, min_compression_ratio=0.0,
                                                        lazy_error_propagation=True))
    codec.tp_size, codec.tp_rank = tp, tp - 1  # what split_over_tp gives the last tensor rank (encode needs no group)
    recorder = DiagnosticsRecorder(tp, tp - 1)
    codec.observer = recorder
    shapes = [(2, 8, 16), (2, 8, 16), (2, 8, 16), (1, 8, 16)]  # the last pair has different shapes: skipped
    acts = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    piece = (lambda t: t.chunk(tp, dim=1)[tp - 1]) if tp > 1 else (lambda t: t)
    errors, rebuilt = [], []

    def send(i: int) -> None:
        p, q = codec.encode(grads[i], BoundaryKey(1, i, False))
        rebuilt.append(p @ q.t())
        errors.append(codec.errors[(1, 0)][tuple(slice(0, d) for d in piece(grads[i]).shape)].clone())

    recorder.begin_step()
    if order == "gpipe":  # all activations arrive before the first gradient is sent
        for i, a in enumerate(acts):
            recorder.on_received(1, i, [a.requires_grad_(True), torch.zeros(2, dtype=torch.long)])
        for i in range(len(acts)):
            send(i)
    else:  # the last stage of 1F1B: F0 B0 F1 B1 ...
        for i, a in enumerate(acts):
            recorder.on_received(1, i, [a])
            send(i)
    exact, compressed = torch.randn(1000), torch.randn(1000)
    recorder.sc_observer(3, exact, compressed)
    metrics = recorder.end_step()

    pairs = [_cos(errors[i], piece(acts[i]) - piece(acts[i + 1])) for i in range(2)]
    fidelity = [_cos(rebuilt[i], piece(grads[i])) for i in range(4)]
    rel = [((rebuilt[i] - piece(grads[i]).reshape(-1, 16)).norm() / piece(grads[i]).norm()).item() for i in range(4)]
    expected = {
        "diag/cb/stage1/cos_error_vs_act_diff": sum(pairs) / 2,
        "diag/cb/stage1/abs_cos_error_vs_act_diff": sum(map(abs, pairs)) / 2,
        "diag/cb/stage1/cos_rebuilt_vs_grad": sum(fidelity) / 4,
        "diag/cb/stage1/rel_error": sum(rel) / 4,
        "diag/sc/bucket3/cos": _cos(compressed, exact),
        "diag/sc/bucket3/rel_error": ((compressed - exact).norm() / exact.norm()).item(),
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert not recorder._acts and not recorder._errors and not recorder.sampling  # nothing kept past the step
    assert cosine(torch.zeros(3), torch.ones(3)).item() == 0.0  # a zero error is orthogonal, not NaN
    recorder.on_received(1, 0, [acts[0]])  # unsampled steps record nothing
    assert recorder.end_step() == {}


class _Foreign:
    def __init__(self) -> None:
        self.seen = []

    def on_step(self, phase, train, num_microbatches) -> None:
        self.seen.append(phase)

    def span(self, name, stage, microbatch):
        self.seen.append(name)
        return contextlib.nullcontext()

    def on_received(self, stage, microbatch, tensors) -> None:
        self.seen.append("received")


def test_observer_fanout_shares_the_runtime_slot_and_gives_it_back() -> None:
    foreign = _Foreign()
    runtime = SimpleNamespace(observer=foreign)
    waits, everything = SpanRecorder(torch.device("cpu"), names=("wait",)), SpanRecorder(torch.device("cpu"))
    attach(runtime, waits)
    attach(runtime, everything)
    assert isinstance(runtime.observer, ObserverFanout)
    waits.arm()
    everything.arm()
    obs = runtime.observer
    obs.on_step("begin", True, 1)
    for name in ("wait", "forward", "backward"):
        with obs.span(name, 1, 0):
            pass
    obs.on_received(1, 0, [])
    obs.on_step("end", True, 1)
    assert [s[0] for s in waits.result()[0]] == ["wait"]
    spans, duration = everything.result()
    assert [s[0] for s in spans] == ["wait", "forward", "backward"] and all(0 <= s[3] <= s[4] <= duration for s in spans)
    assert foreign.seen == ["begin", "wait", "forward", "backward", "received", "end"]
    detach(runtime, waits)
    detach(runtime, everything)
    assert runtime.observer is foreign


def test_idle_gaps_and_trace_layout() -> None:
    spans = [("forward", 0, 0, 0.1, 0.2), ("wait", 0, 1, 0.15, 0.3)]
    assert idle_gaps(spans, 0.5) == [(0.0, 0.1), (0.3, 0.5)]
    rows = [{"rank": 3, "pp": 1, "dp": 1, "tp": 0, "tp_size": 1, "wall": 10.0, "duration": 0.5, "spans": spans}]
    events = [e for e in chrome_trace(rows)["traceEvents"] if e["ph"] == "X"]
    assert {(e["name"], e["pid"], e["tid"]) for e in events} == {("forward", 1, 1000), ("wait", 1, 1000), ("idle", 1, 1999)}
    forward = next(e for e in events if e["name"] == "forward")
    assert forward["ts"] == pytest.approx(1e5) and forward["dur"] == pytest.approx(1e5)


def test_throughput_for_a_known_flop_count(four_rank_trainer) -> None:
    """dp=2 of 4 devices; two steps 2 s apart; the second brings micro-batches of different shapes."""
    model = GPT("tiny", vocab_size=300, seq_length=16, num_layers=2, hidden_size=32, num_heads=4)
    trainer, logged = four_rank_trainer
    ids = lambda b, s: {"input_ids": torch.zeros(b, s, dtype=torch.long), "labels": torch.zeros(b, s, dtype=torch.long)}  # noqa: E731
    monitor = ThroughputMFUMonitor(peak_tflops=2.0, window_size=2)
    monitor.setup(trainer, model, "fit")
    monitor.on_train_start(trainer, model)
    monitor.on_train_batch_end(trainer, model, None, ids(4, 16), 0)
    monitor.on_train_batch_end(trainer, model, None, MicroBatches([ids(2, 8), ids(1, 16)]), 1)
    flops = 2 * (model.flops_per_token(8) * 16 + model.flops_per_token(16) * 16)  # both replicas, over 2 s
    m = logged[-1]
    assert m["train/samples"] == 2 * (4 + 3) and m["train/tokens"] == 2 * (64 + 32)
    assert m["train/samples_per_sec"] == pytest.approx(2 * 3 / 2) and m["train/device/samples_per_sec"] == pytest.approx(6 / 2 / 4)
    assert m["train/tokens_per_sec"] == pytest.approx(2 * 32 / 2) and m["train/device/tokens_per_sec"] == pytest.approx(64 / 2 / 4)
    assert m["train/tflops_per_sec"] == pytest.approx(flops / 2 / 1e12)
    assert m["train/device/tflops_per_sec"] == pytest.approx(flops / 2 / 4 / 1e12)
    assert m["train/device/mfu"] == pytest.approx(flops / 2 / 4 / 1e12 / 2.0)
    assert monitor.last_metrics == m


def test_every_callback_from_yaml(tmp_path, monkeypatch) -> None:
    from lightning_3d.cli import build_cli

    monkeypatch.setattr("sys.argv", ["lightning-3d"])
    config = tmp_path / "callbacks.yaml"
    config.write_text(f"""
trainer:
  callbacks:
    - class_path: lightning_3d.callbacks.CompressionStateMonitor
      init_args: {{log_every_n_steps: 10, reset_at_warmup_end: true}}
    - class_path: lightning_3d.callbacks.CompressionDiagnostics
      init_args: {{every_n_steps: 5, plot: false}}
    - class_path: lightning_3d.callbacks.CommunicationMonitor
      init_args: {{log_every_n_steps: 2}}
    - class_path: lightning_3d.callbacks.ThroughputMFUMonitor
      init_args: {{peak_tflops: 312.0, window_size: 4}}
    - class_path: lightning_3d.callbacks.PipelineTimeline
      init_args: {{step: 3, output_dir: {tmp_path / 'trace'}}}
""")
    boring = "lightning.pytorch.demos.boring_classes."
    cli = build_cli(["--config", str(config), f"--model={boring}BoringModel", f"--data={boring}BoringDataModule",
                     f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false"], run=False)
    found = {type(cb).__name__: cb for cb in cli.trainer.callbacks}
    assert found["CompressionStateMonitor"].log_every_n_steps == 10 and found["CompressionStateMonitor"].reset_at_warmup_end
    assert found["CompressionDiagnostics"].every_n_steps == 5 and not found["CompressionDiagnostics"].plot
    assert found["CommunicationMonitor"].log_every_n_steps == 2
    assert found["ThroughputMFUMonitor"].peak_tflops == 312.0 and found["ThroughputMFUMonitor"].window_size == 4
    assert found["PipelineTimeline"].step == 3 and found["PipelineTimeline"].output_dir == str(tmp_path / "trace")


def _boring_fit(tmp_path: Path, callback: pl.Callback) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[callback], default_root_dir=tmp_path, log_every_n_steps=1)
    trainer.fit(BoringModel())


@pytest.mark.parametrize("make", [CompressionStateMonitor, CompressionDiagnostics, CommunicationMonitor, PipelineTimeline])
def test_callbacks_refuse_other_strategies(tmp_path, make) -> None:
    with pytest.raises(TypeError, match=f"{make.__name__} .*Compressed3DStrategy.*strategy=Compressed3DStrategy"):
        _boring_fit(tmp_path, make())


def test_throughput_monitor_degrades_with_other_strategies(tmp_path) -> None:
    monitor = ThroughputMFUMonitor(window_size=2)
    with pytest.warns(UserWarning, match="counting every rank as a data-parallel replica"):
        _boring_fit(tmp_path, monitor)
    assert monitor.last_metrics["train/samples"] == 2 and "train/device/mfu" not in monitor.last_metrics  # CPU: no MFU


def test_all_callbacks_on_a_compressed_3d_run(tmp_path) -> None:
    """(2,2,1) with CB + LEP + SC, 6 steps, every callback attached (see tests/scenarios/callbacks.py)."""
    report = run_scenario(4, "callbacks", ["--world", "4"], tmp_path / "report.json", timeout=600)
    ranks, logged = report["ranks"], report["logged"]

    # CommunicationMonitor: each step's bytes are what the strategy closes as "last_step" one step later, they add up
    # to its totals, and rank 0 logs their sum over ranks.
    for r in ranks:
        assert r["monitored"] == r["strategy_last"], r["rank"]  # the strategy closes its counters at the optimizer step
        for kind, total in r["total"].items():
            assert {k: sum(step[kind][k] for step in r["monitored"]) for k in total} == total
        assert r["wait_s"] is not None and r["wait_s"] >= 0
    comm = [m for _, m in logged if "comm/step/bytes_after" in m]
    assert len(comm) == 6
    for step, metrics in enumerate(comm):
        for kind in ranks[0]["total"]:
            for b in ("bytes_before", "bytes_after"):
                assert metrics[f"comm/step/{kind}/{b}"] == sum(r["monitored"][step][kind][b] for r in ranks)
    assert comm[0]["comm/step/dp_gradients/bytes_after"] == comm[0]["comm/step/dp_gradients/bytes_before"]  # SC warm-up
    assert comm[-1]["comm/step/dp_gradients/bytes_after"] < comm[-1]["comm/step/dp_gradients/bytes_before"]
    assert comm[-1]["comm/step/compression_ratio"] > 1 and comm[-1]["comm/step/pipeline_wait_ms_max"] > 0

    # CompressionDiagnostics: finite cosines for the CB boundary (steps 0, 2, 4) and the SC bucket(s) (after warm-up).
    history = report["history"]
    for name in ("cos_error_vs_act_diff", "abs_cos_error_vs_act_diff", "cos_rebuilt_vs_grad", "rel_error"):
        series = history[f"diag/cb/stage1/{name}"]
        assert [s for s, _ in series] == [0, 2, 4] and all(math.isfinite(v) for _, v in series), name
        assert all(-1 <= v <= 1 for _, v in series) or name == "rel_error"
    sc = [name for name in history if name.startswith("diag/sc/pp0/bucket") and name.endswith("/cos")]
    assert sc and all([s for s, _ in history[n]] == [2, 4] and all(0 < v <= 1 for _, v in history[n]) for n in sc)
    assert any("diag/cb/stage1/cos_error_vs_act_diff" in m for _, m in logged)

    # PipelineTimeline: forward and backward of every stage on every replica, waits, idle gaps; PNGs.
    trace = json.loads(Path(report["trace"]).read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for dp in range(2):
        for stage in range(2):
            names = {e["name"] for e in events if e["pid"] == stage and e["tid"] == 1000 * dp + stage}
            assert {"forward", "backward"} <= names, (dp, stage, names)
    assert any(e["name"] == "wait" for e in events) and all(e["dur"] >= 0 for e in events)
    for png in (report["timeline_png"], report["diagnostics_png"]):
        assert Path(png).read_bytes()[:8] == PNG, png

    # ThroughputMFUMonitor: FLOP/s over tokens/s is the model's FLOPs per token; MFU against peak_tflops=1.
    t = report["throughput"]
    assert t["train/tflops_per_sec"] * 1e12 / t["train/tokens_per_sec"] == pytest.approx(report["flops_per_token"])
    assert t["train/device/tflops_per_sec"] == pytest.approx(t["train/tflops_per_sec"] / 4)
    assert t["train/device/mfu"] == pytest.approx(t["train/device/tflops_per_sec"])

    # CompressionStateMonitor: norms logged; the warm-up reset ran once; reset() zeroes every buffer, drops memories.
    assert report["state_metrics"]["ef/cb/stage1/lep_error_norm"] > 0 and report["state_metrics"]["ef/sc/pp0/error_norm"] > 0
    for r in ranks:
        key = "ef/cb/stage1/lep_error_norm" if r["pp"] == 1 else "ef/sc/pp0/error_norm"
        assert r["norms_before"][key] > 0 and r["norms_after"] == {key: 0.0}, r
        # stage 1: LEP's one boundary buffer; stage 0: SC's two buckets (fused linear weights, then the rest)
        assert r["buffers_zero"] and r["num_buffers"] == (1 if r["pp"] == 1 else 2) and r["memories_empty"], r
        assert r["resets"] == 2 and r["warmup_reset"] and r["observers_detached"]


def test_sc_anywhere_follows_the_measured_link_and_diagnostics_say_when_lep_is_off() -> None:
    """What the callbacks read: SC runs somewhere only on a link slower than sc_max_link_gbps (once measured), and
    CompressionDiagnostics says that its LEP cosine has nothing to pair when LEP is off (the default)."""
    from types import SimpleNamespace

    from lightning_3d import Compressed3DStrategy, ParallelDims
    from lightning_3d.compression.backprop import CompressedBackprop, CompressedBackpropConfig

    s = Compressed3DStrategy(data_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2,
                             parallel_devices=[torch.device("cpu")] * 4)
    s.dims, s.pp_rank, s.tp_rank = ParallelDims(2, 2, 1, 4), 1, 0
    assert not s.compresses_data_parallel_anywhere  # nothing measured yet
    s.compression_state.link_gbps = 212.0  # NVLink-class
    assert not s.compresses_data_parallel_anywhere
    s.compression_state.link_gbps = 25.0  # InfiniBand-class
    assert s.compresses_data_parallel_anywhere
    s.engine.runtime = SimpleNamespace(codec=CompressedBackprop(CompressedBackpropConfig()), observer=None)
    diagnostics = CompressionDiagnostics(every_n_steps=1, plot=False)
    diagnostics._strategy = s
    with pytest.warns(UserWarning, match=r"needs LEP errors and LEP is off \(cb_lazy_error_propagation=False"):
        diagnostics.on_fit_start(SimpleNamespace(strategy=s), None)
    assert s.compressed_backprop.observer is diagnostics.recorder  # the other diagnostics still run


@pytest.mark.parametrize(
    "name, precision, expected",
    [
        ("NVIDIA H200", "bf16-mixed", 989.4),  # dense, not Lightning's sparse "h200 sxm1" figure
        ("NVIDIA H200", "32-true", 66.9),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),  # from Lightning's table
        ("NVIDIA A100-SXM4-80GB", "bf16-true", 312.0),
        ("Some Future GPU", "bf16-mixed", None),  # unknown: no MFU rather than a wrong one
    ],
)
def test_peak_flops_come_from_lightnings_table_with_h200_dense(monkeypatch, name, precision, expected) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak_tflops_of(torch.device("cuda", 0), precision) == (pytest.approx(expected) if expected else None)
    assert peak_tflops_of(torch.device("cpu"), precision) is None
