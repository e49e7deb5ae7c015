"""The planned variants of ``multitask_microbatching.py``'s direct engine (``dynamic``, ``packed_dynamic``, ``auto``):
their ``DynamicMicroBatcher`` on one GPU, the packed attention the planner prices, and the speed-up lines printed
under the table.
"""

from __future__ import annotations

import torch

from lightning_3d.recipes.data.multitask_batching import PLANNED, StepCollator, sample_input_length, sample_target_length
from lightning_3d.recipes.gpt.model import resolve_packed_attention


def profile_config(model: str, preset: str, vocab_size: int, seq_length: int, target_length: int | None,
                   precision: str) -> dict:
    """The training config ``lightning-3d profile`` reads for the multi-task recipe's model (``model``: "gpt" or
    "t5"; T5 takes the decoder's ``target_length``): what ``--profile measure`` profiles and what
    ``benchmarks/tools/compiled_grids.py`` adds compiled grids for, one config so that the two agree."""
    init = {"preset_name": preset, "vocab_size": vocab_size}
    data = {"seq_length": seq_length}
    if model == "gpt":
        init["seq_length"] = seq_length
    else:
        data["target_length"] = target_length
    return {"model": {"class_path": f"lightning_3d.recipes.{model.upper()}", "init_args": init},
            "data": {"init_args": data}, "trainer": {"precision": precision}}


def packed_cost_attention(args, module, device: str) -> str:
    """How the planner prices GPT's packed rows: what the recipe's ``packed_attention="auto"`` runs on ``device``
    ("flex" or the dense SDPA mask); T5's packed rows use dense masks."""
    if args.model == "t5":
        return "dense"
    config = module.config
    resolved = resolve_packed_attention("auto", torch.device(device), config.dropout, config.head_dim)
    return "flex" if resolved == "flex" else "dense"


def planned_batcher(args, text: str, collator: StepCollator, shape, budget: float, cost_model, packed: str):
    """The ``DynamicMicroBatcher`` of a planned variant (one GPU: dp = pp = 1), installed as ``collator``'s planner:
    ``dynamic`` plans DynaPipe's partition, ``packed_dynamic`` the partition of packed rows, ``auto`` chooses per step
    among ``--auto-candidates`` (default: ``lightning_3d.dynamic.choice.default_candidates``). For packing@N and
    token_budget@N (not installed) it only predicts: ``choose(batch).predicted`` with the variant as sole candidate."""
    from lightning_3d.dynamic import DynamicMicroBatcher
    from lightning_3d.dynamic.choice import default_candidates

    name = text.partition(":")[0].partition("@")[0]
    t5 = args.model == "t5"
    longest = args.seq_length + (args.target_length if t5 else 0)
    candidates = {"dynamic": None, "packed_dynamic": ("packed_dynamic",),
                  "auto": tuple(args.auto_candidates or default_candidates(longest))}.get(name, (text.partition(":")[0],))
    batcher = DynamicMicroBatcher(
        collator.collate, shape=shape, dp=1, pp=1, dp_rank=0, memory_budget=budget, cost_model=cost_model,
        max_seq_len=args.seq_length, max_target_len=args.target_length if t5 else None,
        input_length=sample_input_length, target_length=sample_target_length if t5 else None, candidates=candidates,
        collate_packed=collator.collate_packed, packed_attention=packed,
        packed_row_length="full" if getattr(args, "compile", False) else "fill")  # as the data module plans
    if name in PLANNED:
        collator.dynamic, collator.microbatching = batcher, name
    return batcher


def speedups(rows: list[dict]) -> list[str]:
    """auto, packed_dynamic and dynamic against the best tuned fixed baseline of each kind (useful tokens/s, per
    --sdpa value): what "never worse than the fixed batchings" is checked on."""
    out = []
    for sdpa in dict.fromkeys(r.get("sdpa") for r in rows):
        speed = {r["variant"]: r.get("useful_tokens_per_s") for r in rows if r.get("sdpa") == sdpa and not r["error"]}
        out += [f"{line} (sdpa {sdpa})" for line in against_best(speed)]
    return out


def against_best(speed: dict[str, float | None]) -> list[str]:
    """Each planned variant's useful tokens/s (``speed``: variant -> tokens/s, None where it has none) over the best
    of each fixed batching's settings, naming that setting."""
    out = []
    for planned in (k for k in speed if k.partition("@")[0] in PLANNED and speed[k]):
        for base in ("packing", "token_budget", "padding"):
            best = max(((v, k) for k, v in speed.items() if k.startswith(base) and v), default=None)
            if best:
                out.append(f"{planned} / best {base} ({best[1]}) = {speed[planned] / best[0]:.2f}")
    return out
