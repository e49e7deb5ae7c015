"""``lightning-3d profile --config MODEL.yaml [--out FILE]``: measure, on the current GPU, each layer kind's forward
and backward time (CUDA events after warm-up, median of repeats) and its stored and peak activation memory
(``torch.cuda`` memory statistics) over a grid of micro-batch size × sequence length (× target length for T5),
with and without activation checkpointing; plus all-reduce, all-gather, reduce-scatter and point-to-point bandwidth
between the visible GPUs when there are several. Writes the versioned JSON profile ``ProfiledCostModel`` reads.

The layers are the recipe's own modules (``Block``; ``EncoderBlock``/``DecoderBlock``; the embedding; final norm,
output projection and loss, as the recipe registers them: ``lightning_3d.costs.RecipeCosts``), built one at a time at
full size on one GPU (tensor-parallel shards are derived from
the tp = 1 grid: ``ProfiledCostModel(derive_tp=True)``). On a machine without a GPU the command refuses;
``--device cpu`` profiles the CPU for tests (times of the CPU, memory not measured: 0).

This module is the command: ``profile_model`` puts the profile together from the modules that measure it, each one
job: ``planner.layers`` (the layers and the optimizer, on ``planner.timing``'s primitives), ``planner.overheads``
(the step's costs outside the layers, from tiny models trained in situ: ``planner.tiny_runs``) and
``planner.multi_gpu`` (collectives and tensor-parallel layers across the GPUs); ``profile_main`` is its CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from lightning_3d.distributed.wgrad_fusion import check_fusion_mode
from lightning_3d.planner.api import load_config
from lightning_3d.planner.layers import grid_lengths, precision_of, profile_layers, resolve_device
from lightning_3d.planner.multi_gpu import measure_collectives
from lightning_3d.planner.overheads import measure_overheads


def profile_model(config: str | Path | dict, *, device: str | torch.device | None = None, microbatch_sizes=(1, 2, 4, 8),
                  seq_lens=None, target_lens=None, recompute=(False, True), warmup: int = 2, repeats: int = 5,
                  collectives: bool = True, compile: bool | str = False, overheads: bool = True,
                  fuse_gradients: bool | str = "auto", compile_recompute=(False,), compile_microbatch_sizes=None,
                  eager: bool = True, tp_layers: bool = True, tp_recompute=(False,), in_situ_rounds: int | None = None,
                  sustained_seconds: float = 1.0, call_overhead: dict | None = None, log=print) -> dict:
    """The profile document of the config's model on ``device`` (default: the current GPU; CPU only if named).

    Per layer kind and grid point: forward and backward seconds of one layer as it runs inside a stage. A block is
    timed applied once and ``CHAIN`` times in a row, and its time is the difference per extra application: in a
    stage the host issues the next layer's kernels while the GPU runs this one's, and a call's fixed costs (the
    first launch on an idle GPU, the autograd engine's start) are paid once per micro-batch, not per layer. Those
    fixed costs (T(1) minus the per-layer time, median over the block grid) are taken off the embedding's and
    head's single timings too. ``host_forward``/``host_backward``: the host's seconds to issue the same (eager
    PyTorch launches every kernel from Python: a small layer is host-bound). ``compile``: also the blocks under
    ``torch.compile`` (grids marked ``compiled``). ``fuse_gradients``: the layers with the strategy's
    gradient-accumulation fusion as ``gradient_accumulation_fusion=fuse_gradients`` applies it (``"auto"``, the
    strategy's default: only weights of at least ``FUSION_MIN_ELEMENTS`` elements; True: every fusable layer; False:
    plain autograd); the document records the setting and how many weights of each layer kind were fused.
    ``eager=False`` with ``compile``: only the compiled grids (to add to an eager profile's layers later).
    ``overheads``: the per-micro-batch and per-step costs outside the layers, from a few steps of a tiny model of the
    same recipe under the strategy (``planner.overheads.measure_overheads``; ``in_situ_rounds``: how many times those
    fits repeat, their steps pooled; default three on a GPU).
    ``sustained_seconds``: on a GPU, each layer kind but the embedding is also held busy back to back this long at a
    few token counts, for its slow-down at the clock a busy GPU's power limit leaves (``planner.clocks``; the section
    ``sustained``, which ``ProfiledCostModel`` applies); 0 leaves it out.
    ``tp_layers``: with ``collectives`` on several GPUs, also the recipe's tensor-parallel layers at each degree of
    ``tp_degrees`` (``recompute`` settings ``tp_recompute``), measured across the GPUs with their collectives
    (``measure_tp_layers``); grids with ``"collectives": true`` that the planner reads instead of deriving.
    ``call_overhead``: a profile's per-call fixed cost (its ``call_overhead``) to take off the single timings instead of
    the median of this run's chains (``add_compiled`` passes the profile's, so its added grids follow the profile's
    rule; the document then records the one given).
    """
    check_fusion_mode(fuse_gradients, "fuse_gradients")
    if not (isinstance(sustained_seconds, (int, float)) and math.isfinite(sustained_seconds) and sustained_seconds >= 0):
        raise ValueError(f"sustained_seconds={sustained_seconds!r}: give the seconds each sustained-clock point runs"
                         " (default 1.0), or 0 to leave the measurement out.")
    device = resolve_device(device)
    cfg = load_config(config)
    started = time.perf_counter()
    doc = profile_layers(cfg, device, microbatch_sizes=microbatch_sizes, seq_lens=seq_lens, target_lens=target_lens,
                         recompute=recompute, warmup=warmup, repeats=repeats, compile=compile,
                         fuse_gradients=fuse_gradients, compile_recompute=compile_recompute,
                         compile_microbatch_sizes=compile_microbatch_sizes, eager=eager,
                         sustained_seconds=sustained_seconds if eager else 0.0, call_overhead=call_overhead, log=log)
    shape, seqs, _ = grid_lengths(cfg, seq_lens, target_lens)
    if overheads:
        try:
            doc["overheads"] = measure_overheads(cfg, shape, device, precision_of(cfg), fuse_gradients=fuse_gradients,
                                                 in_situ_rounds=in_situ_rounds, log=log)
        except Exception as err:  # noqa: BLE001  the layers' profile stands without it (the terms read as 0)
            log(f"overheads not measured: {type(err).__name__}: {err}")
            doc["overheads"] = {"microbatch_seconds": 0.0, "step_seconds": 0.0, "error": f"{type(err).__name__}: {err}"[:500]}
    if collectives and device.type == "cuda" and torch.cuda.device_count() > 1:
        tp = None
        if tp_layers and eager:
            tp = dict(config=cfg, microbatch_sizes=microbatch_sizes, seq_lens=seqs, recompute=tp_recompute,
                      warmup=warmup, repeats=repeats)
        _add_multi_gpu(doc, tp, log)
    doc["seconds"] = round(time.perf_counter() - started, 2)
    return doc


def add_compiled(doc: dict, config: str | Path | dict, *, microbatch_sizes, seq_lens, target_lens=None,
                 device: str | torch.device | None = None, warmup: int = 1, repeats: int = 2, log=print) -> dict:
    """``doc`` (a profile of ``config``'s model) with compiled grids of its layers measured now (``profile_model``
    with ``compile=True, eager=False`` over ``microbatch_sizes`` x ``seq_lens`` (x ``target_lens``): the blocks and the
    head as the recipes compile them), for plans of a model that compiles its blocks (``ProfiledCostModel(
    compiled=True)``, the data module's planner for ``compile=True``). The eager grids, overheads and sustained
    section stay; the single timings have ``doc``'s ``call_overhead`` taken off (the rule of its eager grids), where it
    has one; compiled grids ``doc`` already had are removed first; a compile that fails is recorded in
    ``compile_errors`` (those kinds then have no compiled grid, which the cost model names). Changes ``doc`` in place
    and returns it. Refuses a profile of another model than ``config``'s (the grids would mix two models)."""
    cfg = load_config(config)
    shape, _, _ = grid_lengths(cfg, seq_lens, target_lens)
    # Tied embeddings do not change a layer's cost; every other field (the vocabulary too: the head's grid) must match.
    measured = {k: v for k, v in (doc.get("model") or {}).items() if k != "tied_embeddings"}
    if measured != {k: v for k, v in dataclasses.asdict(shape).items() if k != "tied_embeddings"}:
        raise ValueError(f"the profile measured {doc.get('model')}, but the config's model is {shape}: add compiled"
                         " grids to a profile of the same model (or profile it whole with `lightning-3d profile"
                         " --compile`).")
    extra = profile_model(cfg, device=device, microbatch_sizes=microbatch_sizes, seq_lens=seq_lens,
                          target_lens=target_lens, recompute=(False,), warmup=warmup, repeats=repeats,
                          collectives=False, overheads=False, compile=True, compile_microbatch_sizes=microbatch_sizes,
                          eager=False, fuse_gradients=doc.get("gradient_accumulation_fusion", "auto"),
                          call_overhead=doc.get("call_overhead"), log=log)
    # Every kind's older compiled grids go, also where this compile failed (a grid of other code would stay behind).
    for kind in doc["layers"]:
        doc["layers"][kind] = [e for e in doc["layers"][kind] if not e.get("compiled")]
    for kind, entries in extra["layers"].items():
        doc["layers"].setdefault(kind, []).extend(e for e in entries if e.get("compiled"))
    doc.pop("compile_errors", None)
    if extra.get("compile_errors"):
        doc["compile_errors"] = extra["compile_errors"]
    return doc


def _add_multi_gpu(doc: dict, tp: dict | None, log) -> None:
    """The collectives' tables (with ``tp``: and the tensor-parallel layers, in the same processes) into ``doc``."""
    try:
        data = measure_collectives(torch.cuda.device_count(), tp_layers=tp)
    except Exception as err:  # noqa: BLE001
        if tp is None:
            raise
        # The tensor-parallel layers are a refinement: without them the planner derives tp from tp = 1 (as
        # before), and the collectives' tables are measured on their own.
        log(f"tensor-parallel layers not measured: {type(err).__name__}: {err}")
        doc["tp_layers_error"] = f"{type(err).__name__}: {err}"[:1000]
        tp = None
        data = measure_collectives(torch.cuda.device_count())
    for kind, entries in data.pop("tp_layers", {}).items():
        doc["layers"].setdefault(kind, []).extend(entries)
    doc["collectives"] = data
    log("collectives" + (" and tensor-parallel layers" if tp else "") + " measured")


def profile_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lightning-3d profile", description="measure per-layer time and memory on"
                                     " this GPU (and collectives between its GPUs); write a profile for `lightning-3d plan`")
    parser.add_argument("--config", required=True, help="training YAML (or packaged config name) whose model to profile")
    parser.add_argument("--out", default=None, help="profile file (default: <config name>.profile.json)")
    parser.add_argument("--device", default=None, help="default: the current GPU; 'cpu' only for tests")
    parser.add_argument("--microbatch-sizes", default="1,2,4,8")
    parser.add_argument("--seq-lens", default=None, help="comma-separated (default: up to the config's length)")
    parser.add_argument("--target-lens", default=None, help="T5 decoder lengths, comma-separated")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-recompute", action="store_true", help="skip the activation-checkpointing grid")
    parser.add_argument("--no-collectives", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also profile the blocks under torch.compile (for"
                        " plans of compiled models: ProfiledCostModel(compiled=True))")
    parser.add_argument("--no-overheads", action="store_true", help="skip the per-step / per-micro-batch overheads"
                        " (a few steps of a tiny model under the strategy)")
    parser.add_argument("--gradient-accumulation-fusion", default="auto", choices=("auto", "true", "false"),
                        help="the layers as RuntimeConfig(gradient_accumulation_fusion=...) trains them"
                        " (default: auto, the strategy's default)")
    parser.add_argument("--in-situ-rounds", type=int, default=None, help="times the tiny models' fits of the"
                        " overheads repeat, their steps pooled (default: 3 on a GPU, 1 on the CPU)")
    parser.add_argument("--sustained-seconds", type=float, default=1.0, help="seconds each layer kind is held busy"
                        " at a few token counts to measure its slow-down at the clock a busy GPU's power limit leaves"
                        " (default 1.0; 0: not measured, the grids' times stand)")
    ns = parser.parse_args(argv)
    if not (math.isfinite(ns.sustained_seconds) and ns.sustained_seconds >= 0):
        parser.error(f"--sustained-seconds={ns.sustained_seconds}: give non-negative seconds (default 1.0; 0 leaves the"
                     " measurement out)")
    if ns.in_situ_rounds is not None and ns.in_situ_rounds < 1:
        parser.error(f"--in-situ-rounds={ns.in_situ_rounds}: give a positive integer (default 3 on a GPU)")

    def ints(text):
        try:
            return [int(x) for x in text.split(",")] if text else None
        except ValueError:
            parser.error(f"expected comma-separated integers, got {text!r}")

    try:
        doc = profile_model(ns.config, device=ns.device, microbatch_sizes=ints(ns.microbatch_sizes), seq_lens=ints(ns.seq_lens),
                            target_lens=ints(ns.target_lens), recompute=(False,) if ns.no_recompute else (False, True),
                            warmup=ns.warmup, repeats=ns.repeats, collectives=not ns.no_collectives, compile=ns.compile,
                            overheads=not ns.no_overheads, in_situ_rounds=ns.in_situ_rounds,
                            sustained_seconds=ns.sustained_seconds,
                            fuse_gradients={"auto": "auto", "true": True, "false": False}[ns.gradient_accumulation_fusion])
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    out = Path(ns.out or f"{Path(str(ns.config)).stem}.profile.json")
    out.write_text(json.dumps(doc, allow_nan=False))
    print(f"wrote {out} ({doc['seconds']} s)")
    return 0
