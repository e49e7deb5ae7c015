"""A language model of your own under 3D parallelism: the complete ``Parallel3DModule`` protocol on a model that is
not one of the recipes (RMSNorm, SwiGLU feed-forward, no biases, an output head tied to the embedding).

The same ``TinyLM`` trains with a plain ``pl.Trainer()`` (one device, DDP, ...) and with
``Compressed3DStrategy(parallelism=ParallelismConfig(pipeline_parallel_size=..., tensor_parallel_size=...))``, and every
layout equals one process
(tests/test_examples.py checks (1, 2, 2) and (2, 2, 1) against the single-process run). What each piece is for:

- ``configure_model`` builds on the meta device (no memory until the strategy knows what this rank keeps). Under
  any other strategy nothing materialises a meta model, so the module does it itself (``to_empty`` + ``init_weights``).
- ``init_weights`` runs after pruning and tensor-parallel sharding: a parameter may be this rank's DTensor shard.
  ``init_full_`` fills the full tensor from a generator seeded by the parameter's name and copies this rank's part,
  so every layout starts from the same weights as one process.
- ``training_step`` / ``validation_step``: Lightning requires a ``training_step`` even though under the pipeline the
  strategy runs forward and backward itself and never calls it; here it is the one-device path, written with the
  protocol's own ``pipeline_loss`` / ``pipeline_loss_terms`` so both paths compute the same loss.
- ``pipeline_loss`` returns the SUM over the micro-batch's tokens; under tp > 1 the logits are a vocabulary-sharded
  DTensor (``loss_parallel``) and the loss a DTensor, which the pipeline accepts.

Run it: ``python examples/own_model.py`` (one process; ``--devices 4 --pp 2 --tp 2`` for a 3D layout on CPU).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_3d import Compressed3DStrategy, CompressionConfig, ParallelismConfig, PipelineConfig, read_on_host
from lightning_3d.recipes.training import init_full_
from lightning_3d.utils.tensors import materialize_


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        # -1: under tensor parallelism q/k/v are column-sharded and this rank holds heads / tp of the heads.
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden,
                                                                                      bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = RMSNorm(dim), Attention(dim, heads), RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Embedding, blocks in an ``nn.ModuleDict`` keyed "0", "1", ... (names survive pruning), norm, tied head."""

    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(layers)})
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def prune(self, keep: list[int], first: bool, last: bool) -> None:
        for name in [n for n in self.blocks if int(n) not in keep]:
            del self.blocks[name]
        if last and not first:  # the head keeps its own copy; the strategy sums the two copies' gradients
            self.head.weight = nn.Parameter(self.head.weight.detach().clone())
        if not first:
            self.embed = None
        if not last:
            self.norm = self.head = None

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x))


class Stage(nn.Module):
    """One pipeline stage: references to the pruned model's own modules under the same names (so the tensor-parallel
    plan addresses a stage as it would the model). Called as ``stage(*received, microbatch=mb)``."""

    def __init__(self, net: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = net.embed if first else None
        self.blocks = nn.ModuleDict({str(i): net.blocks[str(i)] for i in layers})
        self.norm, self.head = (net.norm, net.head) if last else (None, None)

    def forward(self, *received: Tensor, microbatch: dict[str, Tensor]) -> Tensor:
        x = self.embed(microbatch["input_ids"]) if self.embed is not None else received[0]
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


class TinyLM(pl.LightningModule):
    def __init__(self, vocab_size: int = 256, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 4,
                 lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: Transformer | None = None

    # ----- building -------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.net is not None:
            return
        hp = self.hparams
        with torch.device("meta"):
            self.net = Transformer(hp.vocab_size, hp.dim, hp.heads, hp.hidden, hp.layers)
        if not (self._trainer and isinstance(self.trainer.strategy, Compressed3DStrategy)):
            # No other strategy materialises a meta model: do it here (materialize_ keeps the head tied).
            materialize_(self.net, self.trainer.strategy.root_device if self._trainer else torch.device("cpu"))
            self.init_weights()

    def init_weights(self) -> None:
        for name, param in self.named_parameters():
            key = "net.embed.weight" if name == "net.head.weight" else name  # a tied copy starts equal
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "net.norm.weight":
                init_full_(param, lambda t, g: t.fill_(1.0), self.hparams.seed, key)
            else:
                init_full_(param, lambda t, g: t.normal_(0.0, 0.02, generator=g), self.hparams.seed, key)

    # ----- one device (Lightning requires training_step; the pipeline never calls it) -------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self.net(batch["input_ids"]), batch) / self.pipeline_loss_terms(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss = self.pipeline_loss(self.net(batch["input_ids"]), batch) / self.pipeline_loss_terms(batch)
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, eps=1e-6)

    # ----- the Parallel3DModule protocol ----------------------------------------------------------------------------
    def num_pipeline_layers(self) -> int:
        return len(self.net.blocks)

    def build_pipeline_stages(self, layouts) -> list[nn.Module]:
        keep = [i for layout in layouts for i in layout.layers]
        self.net.prune(keep, any(l.is_first for l in layouts), any(l.is_last for l in layouts))
        return [Stage(self.net, l.layers, l.is_first, l.is_last) for l in layouts]

    def parallelize_stage(self, stage: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
        if self.hparams.heads % tp_mesh.size() or self.hparams.vocab_size % tp_mesh.size():
            raise ValueError(f"heads={self.hparams.heads} and vocab_size={self.hparams.vocab_size} must be divisible by"
                             f" tensor_parallel_size={tp_mesh.size()}.")
        plan: dict = {}
        if stage.embed is not None:  # vocabulary-parallel embedding
            plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for name in stage.blocks:
            p = f"blocks.{name}"
            plan.update({f"{p}.attn.q": ColwiseParallel(), f"{p}.attn.k": ColwiseParallel(),
                         f"{p}.attn.v": ColwiseParallel(), f"{p}.attn.o": RowwiseParallel(),
                         f"{p}.mlp.gate": ColwiseParallel(), f"{p}.mlp.up": ColwiseParallel(),
                         f"{p}.mlp.down": RowwiseParallel()})
        if stage.head is not None:  # logits stay sharded over the vocabulary, for loss_parallel
            plan["head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
        tied = stage.embed is not None and stage.head is not None
        parallelize_module(stage, tp_mesh, plan)
        if tied:  # parallelize_module gave each module its own new parameter: tie them again
            stage.head.weight = stage.embed.weight

    def pipeline_loss(self, output: Tensor, microbatch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(output.flatten(0, 1), microbatch["labels"].flatten(), reduction="sum")

    def pipeline_loss_terms(self, microbatch: dict[str, Tensor]) -> Tensor:
        return (microbatch["labels"] != -100).sum()

    def check_pipeline_batch(self, microbatch: dict[str, Tensor]) -> None:
        def verdict(largest: int) -> None:
            if largest >= self.hparams.vocab_size:
                raise ValueError(f"input_ids holds id {largest} >= vocab_size={self.hparams.vocab_size}.")

        # Deferred by the strategy: a step's micro-batches are checked under one host synchronisation.
        read_on_host(microbatch["input_ids"].max(), verdict)

    def pipeline_tied_parameters(self) -> dict[str, str]:
        return {"net.embed.weight": "net.head.weight"}


def random_tokens(n: int = 64, seq: int = 16, vocab: int = 256, seed: int = 0) -> list[dict[str, Tensor]]:
    """``n`` samples of next-token prediction on random ids (shifted labels)."""
    ids = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    strategy = Compressed3DStrategy(
        parallelism=ParallelismConfig(pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp),
        pipeline=PipelineConfig(num_microbatches=max(2, args.pp)), compression=CompressionConfig(enabled=False))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                         logger=False, enable_checkpointing=False)
    data = torch.utils.data.DataLoader(random_tokens(), batch_size=8)
    trainer.fit(TinyLM(), train_dataloaders=data)


if __name__ == "__main__":
    main()
