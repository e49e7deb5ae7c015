"""Packed rows under FlexAttention's block mask train like unpacked ones through tensor, sequence and pipeline
parallelism (2 ranks, CPU).

GPT with ``packed_attention="flex"`` at tp=2 with sequence parallelism (eager and compiled blocks) and at pp=2 with
activation checkpointing,
against plain single-process training on the same global batches, padded (tests/scenarios/multitask.py's reference).
CPU has no FlexAttention backward in torch; as in tests/test_flex_packing.py, tests/flex_cpu.py lifts the one check
that refuses it and compiles flex (and the compiled blocks) with "aot_eager" (torch's reference math kernels, the
same capture as on the GPU).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_3d import Compressed3DStrategy
from lightning_3d.recipes import GPT
from tests.flex_cpu import allow_flex_backward_on_cpu, count_flex_calls
from tests.scenarios.common import LossRecorder, parse_args, trainer, write_report
from tests.scenarios.multitask import OPTIM, SEQ, STEPS, compare, data, full_parameters, reference


def fit(cache: Path, pp: int, tp: int, sequence_parallel: bool, activation_checkpointing: bool,
        compile: bool = False) -> tuple:
    dm = data("gpt", "packing", cache)
    module = GPT("tiny", vocab_size=dm.vocab_size, seq_length=SEQ, num_layers=2, hidden_size=32, num_heads=4,
                 packed_attention="flex", activation_checkpointing=activation_checkpointing, compile=compile, **OPTIM)
    strategy = Compressed3DStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_microbatches=2,
                                    sequence_parallel=sequence_parallel, compression=False)
    recorder = LossRecorder()
    trainer(strategy, STEPS, [recorder]).fit(module, datamodule=dm)
    return recorder.losses, full_parameters(module)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    allow_flex_backward_on_cpu()
    calls = count_flex_calls()
    cache = args.report.with_suffix(".cache")
    ref = reference(cache)
    results: dict = {
        "gpt_tp2_sp_flex": compare(fit(cache, 1, 2, True, False), ref),
        "gpt_tp2_sp_compiled_flex": compare(fit(cache, 1, 2, True, False, compile=True), ref),
        "gpt_pp2_ac_flex": compare(fit(cache, 2, 1, False, True), ref),
    }
    results["calls"] = calls[0]
    write_report(args.report, results)


if __name__ == "__main__":
    main()
