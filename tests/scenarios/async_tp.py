"""Async tensor parallelism (``L3D_TP_ASYNC``, docs/tensor_parallel.md) on CPU (gloo, world 2), where it cannot run: its
refusals, and the patterns inductor's micro-pipeline TP pass (its own matchers, ``compat.micro_pipeline_tp_matches``)
finds in the post-grad graphs of a compiled sequence-parallel block: a column-parallel GEMM with a bias, GELU, a
row-parallel GEMM and the sequence reduce-scatter, as GPT's MLP. The fusion itself needs NCCL and symmetric memory; this
checks that our graphs present what it fuses, so a torch upgrade that changes the matchers fails here."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_3d.tensor_parallel import TensorParallel, column_parallel_linear, mappings
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


def patterns(mesh, world: int) -> list[list[list]]:
    tp = TensorParallel(mesh, True, async_tp=False)
    # The graph async_tp gives (its checks refuse gloo, so set on a built one): the bias added apart from the GEMM.
    object.__setattr__(tp, "async_tp", True)
    graphs: list[list] = []

    def capture(graph: torch.fx.Graph) -> None:
        graphs.append([list(m) for m in compat.micro_pipeline_tp_matches(graph)])

    B, S, H = 2, 8, 32
    torch.manual_seed(0)
    w1, b1 = torch.randn(4 * H // world, H).requires_grad_(), torch.randn(4 * H // world).requires_grad_()
    w2 = torch.randn(H, 4 * H // world).requires_grad_()

    def mlp(x):
        return tp.exit(F.linear(F.gelu(column_parallel_linear(x, w1, b1, tp)), w2))

    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=capture):
        out = torch.compile(mlp, backend="inductor", fullgraph=True)(torch.randn(B, S // world, H).requires_grad_())
        out.sum().backward()
    torch._dynamo.reset()
    return graphs


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    report = {"refusals": refusals(mesh), "patterns": patterns(mesh, world)}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    write_report(args.report, {"ranks": gathered})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
