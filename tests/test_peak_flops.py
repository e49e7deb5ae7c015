"""The one dense peak-FLOPs table (lightning_3d/utils/peak_flops.py): every consumer reads it, it agrees with
Lightning's table where both know a GPU, and a bad name or dtype is refused with the known ones listed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightning_3d.callbacks.throughput import peak_tflops_of
from lightning_3d.costs import device_spec
from lightning_3d.costs.analytic import DEFAULT_DEVICE
from lightning_3d.utils.peak_flops import DENSE_PEAK_FLOPS, dense_peak_flops

ROOT = Path(__file__).resolve().parent.parent


def test_every_consumer_reads_the_one_table(monkeypatch) -> None:
    for gpu in ("h100", "h200", "a100"):
        assert device_spec(gpu).peak_flops == DENSE_PEAK_FLOPS[gpu]["bf16"]
    assert DEFAULT_DEVICE.peak_flops == DENSE_PEAK_FLOPS["h100"]["bf16"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak_tflops_of(torch.device("cuda", 0), "bf16-mixed") == DENSE_PEAK_FLOPS["h200"]["bf16"] / 1e12
    assert peak_tflops_of(torch.device("cuda", 0), "32-true") == DENSE_PEAK_FLOPS["h200"]["tf32"] / 1e12
    # The benchmarks' MFU denominator (benchmarks/CONVENTIONS.md), shared by peers.py through train_throughput.
    sys.path.insert(0, str(ROOT))
    from benchmarks.parallel.train_throughput import PEAK_TFLOPS
    assert PEAK_TFLOPS == DENSE_PEAK_FLOPS["h200"]["bf16"] / 1e12 == DENSE_PEAK_FLOPS["h100"]["bf16"] / 1e12


@pytest.mark.parametrize("name, gpu", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100")])
def test_the_table_agrees_with_lightnings_dense_figures(monkeypatch, name, gpu) -> None:
    # Other GPUs' MFU comes from Lightning's table (peak_tflops_of): where both know a GPU they must agree.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")  # fp32 as IEEE, not TF32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for precision, dtype in (("bf16-mixed", "bf16"), ("16-mixed", "fp16"), ("32-true", "fp32")):
        assert peak_tflops_of(torch.device("cuda", 0), precision) == pytest.approx(dense_peak_flops(gpu, dtype) / 1e12)


def test_bad_gpu_or_dtype_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'; known are \['a100', 'h100', 'h200'\]"):
        dense_peak_flops("v100")
    with pytest.raises(ValueError, match=r"no peak for dtype 'int8'; use one of \['bf16', 'fp16', 'fp32', 'tf32'\]"):
        dense_peak_flops("h200", "int8")
    assert dense_peak_flops("h200", torch.bfloat16) == dense_peak_flops("h200") == 989.4e12
