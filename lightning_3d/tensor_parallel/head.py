"""The vocabulary-parallel output head both recipes end in, and the choice between the recipes' two tensor-parallel
plans (local tensors, or torch's DTensor modules).

GPT and T5 share their head (``recipes/gpt/model.py``'s ``LMHead``: a bias-free projection onto the padded
vocabulary whose padded columns are masked to -inf by an additive ``padding_mask`` buffer), so its tensor-parallel
form is one class here rather than a copy in each recipe's plan; the recipes name the head class this replaces
(this package sits below the recipes and cannot import it).
"""

from __future__ import annotations

import os

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_3d.tensor_parallel.layers import distribute_parameters, local_view
from lightning_3d.tensor_parallel.mappings import TensorParallel, column_parallel_linear

# "local": the layers of this package (explicit collectives on local tensors); "dtensor": torch's parallelize_module,
# same sharding and results, kept to compare the two (benchmarks/parallel/tp_host_time.py, L3D_TP_IMPLEMENTATION in a GPU run).
IMPLEMENTATIONS = ("local", "dtensor")

# The environment variable that picks the plan when the recipe's call names none.
IMPLEMENTATION_VARIABLE = "L3D_TP_IMPLEMENTATION"


def tensor_parallel_implementation(implementation: str | None) -> str:
    """The plan a recipe's ``parallelize_*`` applies: ``implementation`` if given, else the environment variable
    ``L3D_TP_IMPLEMENTATION`` if set, else "local". ValueError naming the value and both choices otherwise."""
    if implementation is None:
        implementation = os.environ.get(IMPLEMENTATION_VARIABLE, "local")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"Tensor-parallel implementation {implementation!r} (argument or {IMPLEMENTATION_VARIABLE})"
                         f" is not one of {IMPLEMENTATIONS}: use 'local' (the default) or 'dtensor'.")
    return implementation


class VocabParallelHead(nn.Linear):
    """This rank's vocabulary columns of the logits, handed on as a ``Shard(-1)`` DTensor.

    Why it exists: the loss is torch's ``loss_parallel`` cross-entropy, which takes logits sharded over the vocabulary,
    so no rank ever holds the full vocabulary of logits (the largest activation of a small-hidden, large-vocabulary
    model). The weight is ``Shard(0)`` (this rank's vocabulary rows) and read through :func:`local_view`, so the GEMM
    runs on plain tensors like every other local-tensor layer; only its output is wrapped, once per micro-batch. The
    padding mask (0 or -inf per padded-vocabulary column), the GEMM's bias, is sharded like the logits: it stays
    local."""

    tensor_parallel: TensorParallel
    padding_mask: Tensor | None

    def forward(self, x: Tensor) -> Tensor:
        tp = self.tensor_parallel
        weight = local_view(self.weight)
        # The mask as the GEMM's bias, as LMHead adds it (recipes/gpt/model.py says why).
        mask = None if self.padding_mask is None else self.padding_mask.to_local().to(weight.dtype)
        logits = column_parallel_linear(x, weight, mask, tp)
        return DTensor.from_local(logits, tp.mesh, [Shard(-1)], run_check=False)


def vocab_parallel_head(head: nn.Linear, tp: TensorParallel, memo: dict[int, nn.Parameter], head_class: type) -> None:
    """Turn ``head`` (exactly a ``head_class``: a bias-free ``nn.Linear`` onto the padded vocabulary whose forward adds
    its ``padding_mask`` buffer, if any, to the logits) into a :class:`VocabParallelHead` in place: weight and mask
    ``Shard(0)`` over the vocabulary. ``memo`` keeps a head tied to the (already vocabulary-parallel) embedding one
    parameter. TypeError for another class (its own forward would be lost), ValueError for a vocabulary that does not
    split evenly over the ranks; both before anything changes."""
    if type(head) is not head_class:
        raise TypeError(f"{type(head).__name__} cannot be made vocabulary-parallel: only {head_class.__name__} can"
                        " (a subclass's own forward would be lost).")
    if head.bias is not None:
        raise TypeError(f"{type(head).__name__} has a bias: a vocabulary-parallel head is bias-free (a bias over the"
                        " vocabulary would be sharded like the logits, which this head does not do).")
    if head.out_features % tp.size:
        raise ValueError(f"The head's vocabulary of {head.out_features} columns does not split over"
                         f" tensor_parallel_size={tp.size}: pad it to a multiple (GPTConfig.padded_vocab_size).")
    distribute_parameters(head, {"weight": Shard(0)}, tp, memo)
    mask = getattr(head, "padding_mask", None)
    if mask is not None and not isinstance(mask, DTensor):
        head.padding_mask = distribute_tensor(mask, tp.mesh, [Shard(0)])
    elif mask is None and not hasattr(head, "padding_mask"):  # a head class without one: nothing to add
        head.register_buffer("padding_mask", None, persistent=False)
    head.__class__ = VocabParallelHead
    head.tensor_parallel = tp
