"""The ``user`` peer of benchmarks/speed/peers.py: a GPT-2-layout decoder written plainly, as a user would write one.

Not our recipe's model and nothing imported from it: pre-LayerNorm blocks, separate biased q/k/v/o projections, SDPA
causal attention, a tanh-GELU MLP of 4h, learned positions, a head tied to the token embedding over a vocabulary
rounded up to a multiple of 64 (50,257 -> 50,304, every row a real row: no padding mask), ``F.cross_entropy`` over
fp32 logits, fp32 parameters under bf16 autocast (the residual stream stays fp32), nanoGPT's initialisation, fused
AdamW with weight decay on the matrices. ``+whole`` compiles the model with its loss as one ``torch.compile`` graph
(``model = torch.compile(model)`` with the loss inside ``forward``).

``+ourinit`` copies the recipe's initial weights in instead (its padded vocabulary rows are zero, the key bias zero);
``+torchinit`` keeps PyTorch's default initialisation (no init code: embeddings N(0, 1), linear layers
Kaiming-uniform), as a user who writes none gets. Same model code, other starting values: a speed difference between
such rows is one of data alone (the GPU's clock under its power cap follows the operands' bits, docs/speed.md).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class UserAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class UserBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = UserAttention(hidden, heads)
        self.fc, self.proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class UserGPT(nn.Module):
    """Token ids and labels in, the summed fp32 token cross-entropy out (the loop divides by the token count)."""

    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int, nanogpt_init: bool = True) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(UserBlock(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters() if nanogpt_init else ():  # nanoGPT's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("attn.o.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def user_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to a multiple of 64, as nanoGPT rounds GPT-2's."""
    return -(-vocab_size // 64) * 64


def recipe_state_for_user(state: dict[str, Tensor], layers: int, vocab: int) -> dict[str, Tensor]:
    """The recipe's state dict (``GPTModel``) under the user model's names, its vocabulary rows cut or zero-padded to
    ``vocab`` and a zero key bias where the recipe has none."""
    out = {"wte.weight": state["embed.wte.weight"], "wpe.weight": state["embed.wpe.weight"],
           "ln_f.weight": state["norm.weight"], "ln_f.bias": state["norm.bias"]}
    rows = out["wte.weight"]
    if rows.shape[0] != vocab:
        out["wte.weight"] = torch.cat([rows, rows.new_zeros(max(vocab - rows.shape[0], 0), rows.shape[1])])[:vocab]
    out["head.weight"] = out["wte.weight"]
    names = {"ln1": "ln1", "ln2": "ln2", "attn.q": "attn.q", "attn.k": "attn.k", "attn.v": "attn.v",
             "attn.o": "attn.proj", "fc": "mlp.fc", "proj": "mlp.proj"}
    for i in range(layers):
        for mine, theirs in names.items():
            weight = state[f"layers.{i}.{theirs}.weight"]
            out[f"blocks.{i}.{mine}.weight"] = weight
            out[f"blocks.{i}.{mine}.bias"] = state.get(f"layers.{i}.{theirs}.bias", weight.new_zeros(weight.shape[0]))
    return out


def user_peer(args: argparse.Namespace, system: dict, device: torch.device) -> tuple[Callable[[dict], Tensor],
                                                                                     torch.optim.Optimizer]:
    """(summed loss of a micro-batch, fused AdamW) of a ``user`` system."""
    from lightning_3d.recipes.gpt.config import preset

    config = preset(args.preset, vocab_size=args.vocab_size, seq_length=args.seq_length)
    vocab = user_vocab(config.vocab_size)
    with torch.device(device):
        model = UserGPT(vocab, config.seq_length, config.num_layers, config.hidden_size, config.num_heads,
                        nanogpt_init=not system.get("torchinit"))
    if system.get("ourinit"):
        from benchmarks.speed.hf_peers import build_recipe_model

        recipe = build_recipe_model(args, {**system, "ckpt": False, "fusedce": False}, device, compile=False)
        state = {k: v for k, v in recipe.model.state_dict().items() if not k.endswith("padding_mask")}
        model.load_state_dict(recipe_state_for_user(state, config.num_layers, vocab), strict=True)
        del recipe
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), fused=True)

    def step_loss(batch: dict[str, Tensor]) -> Tensor:
        return compiled(batch["input_ids"], batch["labels"])

    compiled = torch.compile(model) if system.get("whole") else model
    return step_loss, optimizer
