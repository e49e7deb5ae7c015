"""Async tensor parallelism (``L3D_TP_ASYNC``, docs/tensor_parallel.md) on CPU (gloo, world 2), where it cannot run: its
refusals, and the patterns inductor's micro-pipeline TP pass (its own matchers, ``compat.micro_pipeline_tp_matches``)
finds in the post-grad graphs of a compiled sequence-parallel GPT block (attention and MLP). The fusion itself needs NCCL
and symmetric memory; this checks that our graphs present what it fuses, so a torch upgrade that changes the matchers
fails here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from lightning_3d.tensor_parallel import TensorParallel, mappings
from lightning_3d.utils import compat
from tests.scenarios.common import parse_args, write_report


def refusals(mesh) -> dict[str, str]:
    result = {}
    for key, sp in (("no_sp", False), ("cpu", True)):
        try:
            TensorParallel(mesh, sp, async_tp=True)
            result[key] = ""
        except ValueError as e:
            result[key] = str(e)
    saved = os.environ.get(mappings.ASYNC_TP_VARIABLE)
    try:
        os.environ[mappings.ASYNC_TP_VARIABLE] = "on"
        try:
            TensorParallel(mesh, True)
            result["bad_value"] = ""
        except ValueError as e:
            result["bad_value"] = str(e)
        os.environ.pop(mappings.ASYNC_TP_VARIABLE)
        result["default_off"] = str(TensorParallel(mesh, True).async_tp)
    finally:
        if saved is not None:
            os.environ[mappings.ASYNC_TP_VARIABLE] = saved
    return result


def patterns(mesh) -> list[list[list]]:
    """The tiny GPT stage of tests/scenarios/tensor_parallel.py (2 blocks, SP) with ``L3D_TP_ASYNC=1``, its blocks
    compiled by inductor as the recipes compile them (its graph passes as they are; lowered to ATen kernels, below);
    async TP's own checks (which refuse gloo) and its switches are stubbed in this process, so the graphs take async
    TP's forms and the pass itself stays off."""
    import torch._inductor.config as inductor_config

    import lightning_3d.recipes.training as training
    from lightning_3d.recipes.training import summed_token_cross_entropy
    from tests.scenarios.tensor_parallel import gpt_stage

    graphs: list[list] = []
    saved = (mappings.check_async_tp, mappings.enable_async_tensor_parallel, training.COMPILE_BACKEND,
             os.environ.get(mappings.ASYNC_TP_VARIABLE))
    mappings.check_async_tp = lambda *args: None
    mappings.enable_async_tensor_parallel = lambda group: None
    training.COMPILE_BACKEND = "inductor"
    os.environ[mappings.ASYNC_TP_VARIABLE] = "1"
    torch._dynamo.reset()
    try:
        capture = lambda graph: graphs.append([list(m) for m in compat.micro_pipeline_tp_matches(graph)])  # noqa: E731
        # The patterns are read in inductor's post-grad passes, which run unchanged; what follows them, lowering, is
        # not what is checked: every op falls back to its ATen kernel (inductor's fallback_by_default), so no C++
        # kernel is generated and built (most of this scenario's time on CPU), and compilation stays in this process.
        with inductor_config.patch(post_grad_custom_post_pass=capture, fallback_by_default=True, compile_threads=1):
            _, stage = gpt_stage("local", mesh, True, compile_first=True)
            tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
            microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
            with loss_parallel():
                summed_token_cross_entropy(stage(microbatch=microbatch), microbatch["labels"]).backward()
    finally:
        mappings.check_async_tp, mappings.enable_async_tensor_parallel, training.COMPILE_BACKEND, env = saved
        os.environ.pop(mappings.ASYNC_TP_VARIABLE)
        if env is not None:
            os.environ[mappings.ASYNC_TP_VARIABLE] = env
        torch._dynamo.reset()
    return graphs


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    report = {"refusals": refusals(mesh), "patterns": patterns(mesh)}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    write_report(args.report, {"ranks": gathered})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
