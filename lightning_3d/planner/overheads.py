"""The step's costs outside the layers, measured in situ: ``measure_overheads``.

A tiny model of the recipe (``RecipeCosts.tiny``) trains under the strategy (``planner.tiny_runs``, by default in a
fresh interpreter as `lightning-3d fit` runs) and its own layers are timed like the real model's
(``planner.layers.profile_layers``); the differences give the per-micro-batch and per-step seconds, the host's
in-situ seconds per layer and the per-step seconds' growth with depth (docs/planner.md, "in-situ host times").
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch

from lightning_3d.costs import ModelShape, recipe_costs
from lightning_3d.costs.host import in_situ_host_layers, microbatch_overhead_from
from lightning_3d.planner.layers import profile_layers
from lightning_3d.planner.tiny_runs import IN_SITU_ROUNDS, IN_SITU_STEPS, tiny_runs


def measure_overheads(cfg: dict, shape: ModelShape, device: torch.device, precision: str, *, microbatches: int = 4,
                      warmup: int = 3, steps: int = IN_SITU_STEPS, in_situ: bool = True, fuse_gradients: bool | str = "auto",
                      fresh_process: bool = True, in_situ_rounds: int | None = None, log=print) -> dict:
    """The per-micro-batch and per-step seconds a step spends outside the layers and the optimizer's kernels: a
    one-layer model of the same recipe (``RecipeCosts.tiny``) trains under ``Compressed3DStrategy`` (one GPU, exact: no
    compression) with 1 and then ``microbatches`` micro-batches of one sample; step(m) = step_s + optimizer_tiny
    + m (microbatch_s + layers_tiny), with the tiny model's layers profiled like the real one's. What it holds:
    Lightning's loop and hooks, the strategy's batch checks and engine, the loss's bookkeeping, each micro-batch's
    forward and backward calls. A few seconds.

    ``in_situ``: also the host's seconds per layer *inside* the training loop (``host_layers``). The same tiny widths
    at the real model's depth train the same way, without and with activation checkpointing: their layers are
    host-bound on a GPU, so each micro-batch's seconds are the host's, and the depth's extra layers cost
    ``(c_depth - c_1)`` per micro-batch. That is more than the same layers' isolated host times (a block timed alone,
    in a tight loop of three), by a factor ``host_scale`` that the isolated timing cannot see (the loop's other
    Python state, the gradient-slot callbacks and hooks of every parameter, an autograd graph the model's depth
    deep); each layer kind's in-situ host time is its tiny isolated host time times that factor (checkpointed
    blocks: their own factor, from the checkpointed run). It depends on the kernels a layer launches, not on its
    widths, so the planner takes it as a floor of the real layers' times at every micro-batch size.

    ``fuse_gradients``: the gradient-accumulation fusion the tiny models train and are profiled with, the profile's
    own (``profile_model`` passes it): a fused layer adds a custom op per linear per micro-batch to the backward, host
    time that the in-situ floor must hold when the step it predicts runs it (and not when it does not).

    ``fresh_process``: the tiny models train in a new Python interpreter (the state of a `lightning-3d fit` run), not
    in this one (False: in this process, a few seconds faster).

    ``in_situ_rounds``: how many times the tiny models' fits run, interleaved, their timed steps pooled
    (``tiny_runs``); None: ``IN_SITU_ROUNDS`` on a GPU, one on a CPU (profiles there are for tests)."""
    class_path = (cfg.get("model") or {}).get("class_path", "lightning_3d.recipes.GPT")
    recipe = recipe_costs(class_path)
    tiny = recipe.tiny
    if tiny is None:
        return {}
    deep_args = tiny.at_depth(dict(tiny.model_args), shape)
    adamw = recipe.optimizer(deep_args, device) if recipe.optimizer else None
    rounds = in_situ_rounds if in_situ_rounds is not None else (IN_SITU_ROUNDS if device.type == "cuda" else 1)
    args = (tiny, deep_args, device, precision, microbatches, warmup, steps, in_situ, fuse_gradients, adamw, rounds)
    if fresh_process:
        # The loop's host seconds are what the planner predicts for `lightning-3d fit`, a fresh process. Timed inside
        # the profiler's own process, after it has built and timed every layer (its allocator's state, the objects
        # the collector walks), the same tiny models measured above a fresh process's seconds per micro-batch on the
        # same machine (docs/planner.md, "in-situ host times").
        step_s, deep, tails = _tiny_runs_in_fresh_interpreter(args)
    else:
        step_s, deep, tails = tiny_runs(*args)
    one, many = statistics.median(step_s[1]), statistics.median(step_s[microbatches])
    per_mb = max(0.0, (many - one) / (microbatches - 1))
    # The tiny model's own layers and optimizer, measured as the real model's are, come off those times.
    tiny_cfg = {"trainer": {"precision": precision},
                "model": {"class_path": class_path, "init_args": dict(tiny.model_args)},
                "data": {"init_args": dict(tiny.data_args)}}
    tiny_doc = profile_layers(tiny_cfg, device, microbatch_sizes=[1], seq_lens=None,
                          recompute=(False, True) if in_situ else (False,), warmup=2, repeats=5,
                          fuse_gradients=fuse_gradients, log=lambda *a: None)
    tiny_shape = ModelShape(**tiny_doc["model"])
    host = _tiny_cells(tiny_doc, ("host_forward", "host_backward"))
    device_cells = _tiny_cells(tiny_doc, ("forward", "backward"))
    out = {"step_seconds": 0.0, "measured_step_seconds": [one, many], "microbatches": [1, microbatches],
           "model": class_path, "gradient_accumulation_fusion": fuse_gradients, "in_situ_rounds": rounds,
           "tiny_fused_weights": tiny_doc["fused_weights"]}
    if in_situ:
        out.update(host_layers_in_situ(host, tiny_shape, shape, per_mb, {rc: _per_microbatch(d, microbatches)
                                                                          for rc, d in deep.items()}))
        log(f"in-situ host: scale {out['host_scale']}, per micro-batch {out['host_microbatch_seconds']}")
    # The tiny model's own layers, priced as the planner prices a stage's pass (max of the device's and the host's
    # sums per pass, the blocks' host at its in-situ time), come off its measured micro-batch: what is left is the
    # per-micro-batch cost outside the layers, which the planner adds on top of that max (costs.host).
    tiny_layers = {}
    for kind in tiny_shape.layer_kinds():
        (f, b), (hf, hb) = device_cells[(kind, False)], host[(kind, False)]
        situ = out.get("host_layers", {}).get(kind)
        if situ is not None:
            hf, hb = situ["forward"], situ["backward"]
        tiny_layers[kind] = {"forward": f, "backward": b, "host_forward": hf, "host_backward": hb}
    microbatch_s = microbatch_overhead_from(per_mb, [tiny_layers[k] for k in tiny_shape.layer_kinds()])
    step_only = max(0.0, one - per_mb - tiny_doc["optimizer"]["step_seconds"])
    if in_situ:
        out.update(step_seconds_at_depth(step_only, tiny_shape, shape, tails, tiny_doc["optimizer"]["step_seconds"]))
    log(f"overheads: {microbatch_s * 1e3:.2f} ms per micro-batch, {step_only * 1e3:.2f} ms per step"
        + (f" + {out['step_seconds_per_block'] * 1e3:.3f} ms per block beyond {out['step_blocks']}" if in_situ else ""))
    out.update({"microbatch_seconds": microbatch_s, "step_seconds": step_only, "tiny_layers": tiny_layers,
                "tiny_layers_seconds": sum(tiny_layers[k]["forward"] + tiny_layers[k]["backward"]
                                           for k in tiny_shape.layer_kinds())})
    return out


#: seconds the fresh process of ``measure_overheads`` may take (three short fits of tiny models)
FRESH_PROCESS_TIMEOUT_S = 600


def _tiny_runs_in_fresh_interpreter(args: tuple) -> tuple[dict[int, list[float]], dict[bool, dict[int, list[float]]],
                                                           dict]:
    """``tiny_runs(*args)`` in a new Python interpreter, killed past ``FRESH_PROCESS_TIMEOUT_S``
    (``subprocess.TimeoutExpired``).

    A new interpreter (``python -c``) rather than a multiprocessing "spawn" worker: spawn re-imports the caller's main
    module in the worker, so a user's script that calls the profiler without an ``if __name__ == "__main__":`` guard
    would run again, profile included, inside it. The caller's ``sys.path`` is handed over (``PYTHONPATH``), so the
    worker imports the same ``lightning_3d`` and recipes. The arguments travel pickled: the recipe's ``TinyModel``
    by reference to its module, whose import in the worker registers the recipe there as here (no class is looked up
    by name); the result comes back as JSON in a file."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="l3d_tiny_") as tmp:
        request, result = Path(tmp) / "request.pkl", Path(tmp) / "result.json"
        request.write_bytes(pickle.dumps(tuple(args)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = f"from lightning_3d.planner.overheads import tiny_main; tiny_main({str(request)!r}, {str(result)!r})"
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=FRESH_PROCESS_TIMEOUT_S)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"the tiny models' process exited with {proc.returncode}: {proc.stderr[-1500:]}")
        step_s, deep, tails = json.loads(result.read_text())
    # JSON keys are strings: the micro-batch counts and the checkpointing flags come back as their types.
    return ({int(k): v for k, v in step_s.items()},
            {k == "true": {int(m): v for m, v in runs.items()} for k, runs in deep.items()}, tails)


def tiny_main(request: str, result: str) -> None:
    """The fresh interpreter's side of ``_tiny_runs_in_fresh_interpreter`` (the request is the caller's own file)."""
    args = pickle.loads(Path(request).read_bytes())
    step_s, deep, tails = tiny_runs(*args)
    Path(result).write_text(json.dumps([step_s, {"true" if k else "false": v for k, v in deep.items()}, tails]))



def step_seconds_at_depth(step_1: float, tiny: ModelShape, shape: ModelShape, tails: dict,
                          tiny_optimizer: float) -> dict:
    """How the per-step seconds outside the micro-batches and the optimizer's step grow with a rank's blocks.

    After the last backward a step walks every parameter tensor: the non-finite check's norm over all gradients, the
    optimizer step's launches, the strategy's per-parameter bookkeeping. The tails of the tiny models' steps (the
    host's return from the last backward to the step's end, ``train_tiny``) time that part directly: the one-layer
    model's (``tail_seconds``) and those of the tiny widths at the real depth (``deep_tail_seconds``, as many tensors
    as the real model). Each less its own model's optimizer step, their medians' difference per block beyond the tiny
    model's (``step_blocks``) is ``step_seconds_per_block``; the planner charges a rank ``step_seconds + per_block
    * (its blocks - step_blocks)`` (docs/planner.md, "The step's own seconds grow with depth"). A direct timing, not
    the difference of a one-micro-batch step and the per-micro-batch seconds: those are tens of milliseconds each at
    depth and move by more than this term from one run to the next."""
    blocks = sum(1 for k in shape.layer_kinds() if k not in ("embedding", "head"))
    tiny_blocks = sum(1 for k in tiny.layer_kinds() if k not in ("embedding", "head"))
    out = {"step_seconds_per_block": 0.0, "step_blocks": tiny_blocks, **tails, "tiny_optimizer_seconds": tiny_optimizer}
    if blocks > tiny_blocks and tails.get("tail_seconds") and tails.get("deep_tail_seconds"):
        one = statistics.median(tails["tail_seconds"]) - tiny_optimizer
        deep = statistics.median(tails["deep_tail_seconds"]) - (tails.get("deep_optimizer_seconds") or 0.0)
        out["step_seconds_per_block"] = max(0.0, (deep - one) / (blocks - tiny_blocks))
    out["step_seconds_depth"] = step_1 + out["step_seconds_per_block"] * max(0, blocks - tiny_blocks)
    return out


def _tiny_cells(doc: dict, quantities: tuple[str, str]) -> dict[tuple[str, bool], tuple[float, float]]:
    """(kind, recompute) -> the two quantities at the tiny profile's single grid point."""
    out = {}
    for kind, entries in doc["layers"].items():
        for e in entries:
            cells = []
            for q in quantities:
                v = e[q][0][-1]
                cells.append(float(v[-1] if isinstance(v, list) else v))
            out[(kind, bool(e["recompute"]))] = tuple(cells)
    return out


def _per_microbatch(step_s: dict[int, list[float]], microbatches: int) -> float:
    return max(0.0, (statistics.median(step_s[microbatches]) - statistics.median(step_s[1])) / (microbatches - 1))


def host_layers_in_situ(host: dict[tuple[str, bool], tuple[float, float]], tiny: ModelShape, shape: ModelShape,
                        c_1: float, c_deep: dict[bool, float]) -> dict:
    """Each layer kind's host seconds inside the training loop, from the isolated host times of the tiny model's
    layers (``host``: (kind, recompute) -> (forward, backward)) and the per-micro-batch seconds of the tiny model
    at depth 1 (``c_1``) and at the real model's depth (``c_deep[recompute]``): ``costs.host.in_situ_host_layers``
    solves the depth equations (the scales taken as measured). The isolated times and the block counts are stored
    too (``host_layers_isolated``, ``host_tiny_blocks``), so that a reader re-derives the terms from the seconds."""
    deep = Counter(k for k in shape.layer_kinds() if k not in ("embedding", "head"))
    one = Counter(k for k in tiny.layer_kinds() if k not in ("embedding", "head"))
    isolated = {k: {"forward": host[(k, False)][0], "backward": host[(k, False)][1],
                    "recompute_forward": host[(k, True)][0], "recompute_backward": host[(k, True)][1]} for k in deep}
    layers, scales = in_situ_host_layers(isolated, dict(one), dict(deep), c_1, c_deep[False], c_deep[True])
    return {"host_layers": layers, "host_scale": scales, "host_layers_isolated": isolated,
            "host_tiny_blocks": dict(one),
            "host_microbatch_seconds": {"depth_1": c_1, "depth": c_deep[False], "depth_recompute": c_deep[True]}}


