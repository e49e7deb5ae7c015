"""The ``megatron@DP,PP,TP`` peer of benchmarks/speed/peers.py: Megatron-core as a user installs it from the registry.

``pip install megatron-core`` needs only torch, numpy and packaging; without TransformerEngine and apex a user gets:

- ``GPTModel`` with the *local* layer spec (``get_gpt_layer_local_spec``: Megatron's own column/row-parallel linears,
  torch's LayerNorm, ``DotProductAttention``: scores by ``baddbmm``, softmax in torch, no flash/SDPA kernel);
- bf16 through ``Float16Module`` (bf16 parameters, fp32 logits into Megatron's vocabulary-parallel cross-entropy);
- Megatron's ``DistributedDataParallel`` (contiguous grad buffers, gradients accumulated and reduced in fp32, the
  reduction after the last micro-batch: Megatron-LM's default ``overlap_grad_reduce=False``);
- ``get_megatron_optimizer``: fp32 main weights beside the bf16 ones and torch's AdamW (Megatron's fallback without
  apex; not the fused kernel), gradient clipping off as in our peers;
- ``get_forward_backward_func``: no pipelining for PP = 1, else Megatron's 1F1B, ``--num-microbatches`` micro-batches
  of ``--micro-batch-size`` sequences per replica and step; parallel groups from ``initialize_model_parallel``.

The shape is our GPT preset's: hidden size, layers, heads, FFN size, LayerNorm (eps), GELU (tanh approximation, as
ours), learned absolute positions, tied input/output embeddings, no dropout, init std 0.02 with the output layers
scaled by 1/sqrt(2 layers). The vocabulary is padded as Megatron pads it (to a multiple of 128·TP, the same size as
ours). What differs from our model, as far as Megatron's options reach:
- Megatron's QKV projection carries a key bias (ours has none: it cannot change the output) -- ``hidden`` more
  parameters per layer;
- the padded vocabulary rows take part in Megatron's softmax (ours masks them out of the logits);
- attention is the explicit score/softmax path above, ours calls SDPA;
- weight decay (0.1) on every matrix, the position embedding included (ours exempts it); the learning rate is fixed
  at the recipe's peak (ours warms up): neither changes a step's time;
- the weights are Megatron's own initialisation (same distributions, not the same values), so the first loss is
  near ln(vocabulary) but not the plain peer's.

What the missing TransformerEngine/apex rules out (``MISSING``): TE's fused attention (cuDNN/flash), TE's fused
LayerNorm+GEMM layers and FP8, apex's fused LayerNorm, fused Adam and multi-tensor kernels, gradient-accumulation
fusion (``fused_weight_gradient_mlp_cuda``). Megatron-core allocates on ``torch.cuda.current_device()`` throughout (its
attention's score buffer, DDP's grad buffers, the optimizer's scalars, pipeline messages): the peer runs on GPUs only.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import time
from importlib import metadata

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

MISSING = ("without TransformerEngine and apex: no TE/cuDNN fused attention (explicit baddbmm+softmax attention),"
           " no fused LayerNorm or LayerNorm+GEMM, no FP8, no fused Adam (torch AdamW), no gradient-accumulation"
           " fusion, no fused bias+GELU or masked-softmax kernels")
INSTALL = "pip install megatron-core (on the GPU machine: pip install --no-deps .whl/megatron_core-*.whl)"


def megatron_version() -> str:
    """The installed megatron-core's version; an ImportError naming the install command when it is absent."""
    # Found, not imported: the driver checks before any launch and stays free of Megatron's import-time work.
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError(f"the megatron peer needs megatron-core, which is not installed: {INSTALL}")
    return metadata.version("megatron-core")


def transformer_config(args: argparse.Namespace, system: dict, cpu_init: bool = False):
    """Megatron's ``TransformerConfig`` of our preset's shape (bf16, no dropout, no fusions that need TE/apex)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_3d.recipes.gpt.config import preset

    ours = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    recompute = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                 if system.get("ckpt") else {})
    return TransformerConfig(
        num_layers=ours.num_layers, hidden_size=ours.hidden_size, num_attention_heads=ours.num_heads,
        ffn_hidden_size=ours.ffn_size, kv_channels=ours.head_dim, layernorm_epsilon=ours.layer_norm_eps,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=ours.init_std,
        # our MLP's GELU; with bias_activation_fusion off (its kernel is not the tanh form) Megatron calls it as given
        activation_func=functools.partial(F.gelu, approximate="tanh"), bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False,
        tensor_model_parallel_size=system["tp"], pipeline_model_parallel_size=system["pp"], sequence_parallel=False,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=cpu_init,
        **recompute)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron-LM's padding (``make_vocab_size_divisible_by`` 128, times TP)."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


def build_gpt(args: argparse.Namespace, system: dict, config, pre_process: bool = True, post_process: bool = True):
    """Megatron's GPTModel (local spec) of one pipeline stage, in ``config.params_dtype``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
                    vocab_size=padded_vocab_size(args.vocab_size, system["tp"]), max_sequence_length=args.seq_length,
                    pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=True,
                    position_embedding_type="learned_absolute", parallel_output=True)


def megatron_loop(args: argparse.Namespace, system: dict) -> dict:
    """Megatron-core's training step, timed as the other peers' (peer_workers): GPU-synchronised step ends, a step
    from its start to the next one's, the slowest rank's time."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from benchmarks.speed.hf_peers import recipe_module, synthetic_data
    from benchmarks.speed.peer_workers import StepProfiler, _result, _sync, timed, timing, total_steps
    from lightning_3d.recipes.data.loader import worker_options
    from lightning_3d.recipes.training import IGNORE_INDEX

    version = megatron_version()
    if args.accelerator != "gpu" or not torch.cuda.is_available():
        raise RuntimeError("megatron-core allocates on torch.cuda.current_device(): the megatron peer needs GPUs")
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=system["tp"],
                                             pipeline_model_parallel_size=system["pp"])
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()

    config = transformer_config(args, system)
    gpt = build_gpt(args, system, config, pre_process=first, post_process=last).cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    hp = recipe_module(args, system, compile=False).hparams
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=hp.learning_rate, min_lr=hp.min_learning_rate, weight_decay=hp.weight_decay,
        adam_beta1=hp.betas[0], adam_beta2=hp.betas[1], adam_eps=hp.adam_eps, bf16=True,
        use_distributed_optimizer=False, clip_grad=0.0), [model])
    config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce, tied-embedding sync between stages
    config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's training loop sets it (1.0 in bf16)
    forward_backward = get_forward_backward_func()

    # Replica r reads samples r, r + DP, ... in micro-batches, as Lightning's DistributedSampler gives the others.
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    data = synthetic_data(args)
    batches = iter(DataLoader(Subset(data, range(dp_rank, len(data), dp)), batch_size=args.micro_batch_size,
                              shuffle=False, num_workers=args.num_workers, **worker_options(args.num_workers)))
    positions = torch.arange(args.seq_length, device=device).expand(args.micro_batch_size, -1)

    def loss_func(mask: torch.Tensor, output: torch.Tensor):
        loss = (output.float() * mask).sum() / mask.sum()  # the schedule divides by the micro-batch count
        # a copy: the schedule divides the returned loss in place by the micro-batch count (legacy averaging)
        return loss, {"loss": loss.detach().clone()}

    def forward_step(iterator, model):
        if first or last:  # middle stages read no tokens: their input comes from the previous stage
            batch = {k: v.to(device, non_blocking=True) for k, v in next(iterator).items()}
            mask = (batch["labels"] != IGNORE_INDEX).float()
            labels = batch["labels"].masked_fill(batch["labels"] == IGNORE_INDEX, 0)
        else:
            batch, mask, labels = {"input_ids": None}, None, None
        output = model(batch["input_ids"] if first else None, positions if first else None, None,
                       labels=labels if last else None)
        return output, functools.partial(loss_func, mask)

    rank = dist.get_rank()
    step_s, losses, start = [], [], 0.0
    profiler = StepProfiler(args)
    for step in range(total_steps(args)):
        _sync(device)
        if timed(args, step - 1):
            step_s.append(time.perf_counter() - start)
        profiler.at_step(step, rank)
        timing(timed(args, step))
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=batches, model=[model],
                               num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                               micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                               forward_only=False)
        optimizer.step()
        # the step's mean loss on the last stage (0 elsewhere); read every step, as the plain loop does
        losses.append(float(sum(o["loss"] for o in out) / args.num_microbatches) if last and out else 0.0)
        _sync(device)
    profiler.finish()
    # One value per step on every rank: the last stage's losses averaged over its DP x TP ranks.
    reduced = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(reduced)
    reduced /= dp * system["tp"]
    times = torch.tensor(step_s, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    result = _result(times.tolist(), reduced.tolist(), device, reduce=True)
    parallel_state.destroy_model_parallel()
    return {**result, "megatron_core": version, "megatron_missing": MISSING}
