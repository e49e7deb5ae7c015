"""T5 tensor parallelism on local tensors (world 2, gloo), run inside tests/scenarios/tensor_parallel.py's process
group: the T5 stage under the local layers equals it under torch's DTensor plan (loss and every gradient, with and
without sequence parallelism, v1.0 tied + ReLU and v1.1 untied + gated-GELU, padded inputs and targets) and the model in
one process, also split
into an encoder stage and a decoder stage (recomputing their blocks) whose boundary carries the encoder output and the decoder's bias-table
slice; the parameters keep their names and placements; ``L3D_TP_IMPLEMENTATION`` selects the plan and a bad value is
refused by name; compiled blocks (aot_eager) equal eager ones, one unbroken graph per block kind, with their
gradients handed over through the local leaves.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tests.tolerance import scaled_error, t5_tolerance

ENC, DEC, BLOCKS, VOCAB = 8, 4, 2, 50
V11 = dict(feed_forward="gated-gelu", tie_embeddings=False)


def t5_config(v11: bool, **overrides):
    from lightning_3d.recipes.t5.config import T5Config

    shape = dict(vocab_size=VOCAB, num_layers=BLOCKS, num_decoder_layers=BLOCKS, hidden_size=16, num_heads=4,
                 head_dim=4, ffn_hidden_size=32, relative_attention_num_buckets=8, relative_attention_max_distance=16)
    return T5Config(**{**shape, **(V11 if v11 else {}), **overrides})


def t5_stages(implementation: str | None, mesh, sequence_parallel: bool, v11: bool, split: bool = False,
              compile: bool = False, **overrides):
    """The tiny T5 as one stage (or an encoder stage and a decoder stage), parallelized, materialised and initialised
    as the strategy does (stage_builder); the same weights on every rank and under every plan (seeded by name).
    ``split`` also checkpoints the blocks' activations. ``compile``: its blocks compiled as the recipe compiles them,
    before the plan is applied (build_pipeline_stages
    runs before the strategy's parallelize_stage)."""
    from lightning_3d.recipes.gpt.model import copy_full_into
    from lightning_3d.recipes.t5.model import T5Model
    from lightning_3d.recipes.t5.parallelize import T5Stage, parallelize_t5
    from lightning_3d.recipes.training import compile_blocks
    from lightning_3d.strategies.stage_builder import replicate_plain_parameters
    from lightning_3d.utils.tensors import materialize_

    config = t5_config(v11, **overrides)
    with torch.device("meta"):
        model = T5Model(config, config.padded_vocab_size(mesh.size()))
    compile_blocks([*model.encoder.values(), *model.decoder.values()], compile)
    ranges = [range(BLOCKS), range(BLOCKS, 2 * BLOCKS)] if split else [range(2 * BLOCKS)]
    # Split stages also recompute their blocks (activation checkpointing): the collectives and the local leaves run
    # again in the backward.
    stages = [T5Stage(model, r, first=i == 0, last=i == len(ranges) - 1, activation_checkpointing=split)
              for i, r in enumerate(ranges)]
    for stage in stages:
        parallelize_t5(stage, mesh, sequence_parallel, implementation=implementation)
        replicate_plain_parameters(stage, mesh)
    materialize_(model, torch.device("cpu"))
    model.init_weights(7)
    mask = torch.zeros(model.lm_head.out_features)
    mask[config.vocab_size:] = float("-inf")
    copy_full_into(model.lm_head.padding_mask, mask)
    return model, stages


def microbatches(count: int = 1) -> list[dict[str, torch.Tensor]]:
    """Padded inputs (attention mask) and targets with ignored labels, lengths divisible by tp = 2."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (2, ENC), generator=g)
        mask = torch.ones(2, ENC, dtype=torch.long)
        mask[1, 5:] = 0
        labels = torch.randint(1, VOCAB, (2, DEC), generator=g)
        labels[1, 3:] = -100
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def run(stages, microbatch, boundaries: list | None = None) -> torch.Tensor:
    """The summed loss of one micro-batch through the stages (backward included); ``boundaries`` collects the
    shapes of what each stage hands to the next."""
    from lightning_3d.recipes.training import summed_token_cross_entropy

    with loss_parallel():
        received: tuple = ()
        for stage in stages:
            out = stage(*received, microbatch=microbatch)
            received = out if isinstance(out, tuple) else (out,)
            if boundaries is not None and stage is not stages[-1]:
                boundaries.append([tuple(t.shape) for t in received])
        loss = summed_token_cross_entropy(received[0], microbatch["labels"])
        loss.backward()
    return loss.detach()


def reference(v11: bool, world: int, microbatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same model (same padded vocabulary, same seeded weights) in this process alone."""
    from lightning_3d.recipes.t5.model import T5Model
    from lightning_3d.recipes.training import summed_token_cross_entropy

    config = t5_config(v11)
    model = T5Model(config, config.padded_vocab_size(world))
    model.init_weights(7)
    logits = model(microbatch["input_ids"], attention_mask=microbatch["attention_mask"], labels=microbatch["labels"])
    loss = summed_token_cross_entropy(logits, microbatch["labels"])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def full_grads(model) -> dict[str, torch.Tensor]:
    # Partial (norms under sequence parallelism) -> the parameter's placement, then the whole tensor.
    return {n: p.grad.redistribute(p.device_mesh, p.placements).full_tensor() for n, p in model.named_parameters()}


def check_t5_plans(world: int) -> dict[str, float | bool | str]:
    """Local layers against torch's DTensor plan, one stage and two, both T5 variants, SP off and on."""
    from lightning_3d.recipes.t5.model import T5Model
    from lightning_3d.tensor_parallel import ColumnParallelLinear, ReplicatedNorm

    mesh = init_device_mesh("cpu", (world,))
    (microbatch,) = microbatches()
    # Two summation orders of the forward chain (t5_tolerance) and, for the gradients, of the backward chain through
    # the same reductions again: twice as many; the widest reduction is the padded vocabulary's 128 (the head's
    # log-sum-exp), wider than the feed-forward's 32.
    result: dict[str, float | bool | str] = {"tolerance": 2 * t5_tolerance(BLOCKS, BLOCKS, 128)}
    with torch.device("meta"):
        names = set(T5Model(t5_config(False), t5_config(False).padded_vocab_size(world)).state_dict())
    for v11 in (False, True):
        for sp in (False, True):
            key = f"v11{v11}_sp{sp}"
            runs = {}
            # Split only untied: a tied head on another stage is its own copy, kept equal by the strategy's tied sync.
            plans = (("local", False), ("dtensor", False)) + ((("local", True),) if v11 else ())
            for implementation, split in plans:
                os.environ["L3D_TP_IMPLEMENTATION"] = implementation  # the environment's choice, with no argument
                model, stages = t5_stages(None, mesh, sp, v11, split)
                boundaries: list = []
                loss = run(stages, microbatch, boundaries)
                block = stages[-1].decoder["0"]
                local = all(isinstance(m, ColumnParallelLinear) for m in (block.cross_attn.q, block.cross_attn.k))
                local = local and isinstance(block.ff_norm, ReplicatedNorm) and block.cross_attn.tensor_parallel is not None
                placements = {n: p.placements for n, p in model.named_parameters()}
                runs[(implementation, split)] = (loss, full_grads(model), local, placements, set(model.state_dict()))
                if split:
                    # (decoder embeddings, encoder output, decoder bias table): this rank's sequence chunk under SP,
                    # and this rank's heads of the table (buckets x heads / tp).
                    chunk = world if sp else 1
                    want = [[(2, DEC // chunk, 16), (2, ENC // chunk, 16), (8, 4 // world)]]
                    result[f"{key}_split{split}_boundary_ok"] = boundaries == want
            ref = runs[("dtensor", False)]
            single_loss, single_grads = reference(v11, world, microbatch)
            for (implementation, split), (loss, grads, local, placements, keys) in runs.items():
                if implementation == "dtensor":
                    result[f"{key}_dtensor_selected"] = not local
                    continue
                tag = f"{key}_split{split}"
                result[f"{tag}_loss"] = abs(loss - ref[0]).item() / abs(ref[0]).item()
                errors = {n: scaled_error(grads[n], ref[1][n]) for n in ref[1]}
                result[f"{tag}_grads"] = max(errors.values())
                result[f"{tag}_worst"] = max(errors, key=errors.get)
                result[f"{tag}_reference_loss"] = abs(loss - single_loss).item() / abs(single_loss).item()
                result[f"{tag}_reference_grads"] = max(scaled_error(grads[n], single_grads[n]) for n in single_grads)
                result[f"{tag}_selected"] = local
                result[f"{tag}_same_placements"] = placements == ref[3]
                # v1.1 has no tied head: the same names, its own lm_head.weight; v1.0 stores the tied one once.
                result[f"{tag}_same_state_dict_keys"] = keys == ref[4] and (v11 or keys == names)
    os.environ["L3D_TP_IMPLEMENTATION"] = "fast"
    try:
        t5_stages(None, mesh, False, False)
        result["bad_value_error"] = ""
    except ValueError as e:
        result["bad_value_error"] = str(e)
    del os.environ["L3D_TP_IMPLEMENTATION"]
    try:
        t5_stages("local", mesh, False, False, num_heads=3)
        result["bad_heads_error"] = ""
    except ValueError as e:
        result["bad_heads_error"] = str(e)
    return result


def check_t5_compiled(world: int) -> dict[str, float | bool | int]:
    """T5 blocks compiled as the recipe compiles them (``compile_blocks``, backend aot_eager, before the plan swaps
    the tensor-parallel layers in) equal the eager stage over two accumulated micro-batches, SP off and on: one graph
    per block kind (encoder, decoder), no graph break, and every gradient handed to its DTensor parameter by the
    local leaves, as eagerly (a graph reading the DTensor parameters instead would hand over only the 12 outside
    the blocks)."""
    from torch._dynamo.utils import counters

    import lightning_3d.recipes.training as training
    from lightning_3d.tensor_parallel import layers as tp_layers

    mesh = init_device_mesh("cpu", (world,))
    batches = microbatches(2)
    handed = [0]
    hand_over = tp_layers._LocalLeaf._hand_over

    def counting(self, tensor):
        handed[0] += 1
        return hand_over(self, tensor)

    tp_layers._LocalLeaf._hand_over = counting
    backend, training.COMPILE_BACKEND = training.COMPILE_BACKEND, "aot_eager"
    # As check_t5_plans: two summation orders of the forward and backward chains at most (aot_eager runs the same
    # kernels, so the two agree to the bit in practice; the bound is what the test may rely on).
    result: dict[str, float | bool | int] = {"tolerance": 2 * t5_tolerance(BLOCKS, BLOCKS, 128)}
    try:
        for sp in (False, True):
            runs = {}
            for compiled in (False, True):
                torch._dynamo.reset()
                counters.clear()
                handed[0] = 0
                model, stages = t5_stages("local", mesh, sp, v11=True, compile=compiled)
                losses = torch.stack([run(stages, mb) for mb in batches])
                grads = full_grads(model)
                runs[compiled] = (losses, grads, handed[0])
                if compiled:
                    result[f"sp{sp}_graphs"] = int(counters["stats"]["unique_graphs"])
                    result[f"sp{sp}_graph_breaks"] = int(sum(counters["graph_break"].values()))
                    result[f"sp{sp}_dtensor_grads"] = all(isinstance(p.grad, DTensor) for p in model.parameters())
            (loss_e, grads_e, handed_e), (loss_c, grads_c, handed_c) = runs[False], runs[True]
            result[f"sp{sp}_loss"] = ((loss_c - loss_e).abs() / loss_e.abs()).max().item()
            result[f"sp{sp}_grads"] = max(scaled_error(grads_c[n], grads_e[n]) for n in grads_e)
            result[f"sp{sp}_handed_eager"], result[f"sp{sp}_handed_compiled"] = handed_e, handed_c
    finally:
        tp_layers._LocalLeaf._hand_over = hand_over
        training.COMPILE_BACKEND = backend
        torch._dynamo.reset()
    return result
