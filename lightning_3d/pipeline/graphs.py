"""CUDA graphs of pipeline stages: a stage's forward and backward for one micro-batch shape, captured once and
replayed for every later micro-batch of that shape (``RuntimeConfig(cuda_graphs=True)``).

Why: a compiled stage still launches each of its kernels from Python, one micro-batch at a time; when those kernels
are short (small models, short sequences, T5's many small layers) the GPU waits on the host, and how long depends on
the host's speed from one minute to the next. A replayed graph launches the whole stage with one call. See
docs/speed.md, "CUDA graphs".

What a graph needs, and how this file provides it:

- Fixed addresses. The micro-batch's tensors are copied into the graph's input buffers; the outputs, the saved
  activations and the parameters' gradients live in the graph's memory pool and are overwritten by the next replay.
  So a stage may have one graphed micro-batch in flight: a forward that comes while another graphed forward of the
  same stage waits for its backward runs eagerly (the strategy accepts ``cuda_graphs`` only where the schedule keeps
  one micro-batch in flight, pipeline_parallel_size=1 with a forward-backward alternating schedule).
- Fixed shapes. Each stage captures the first micro-batch signature it trains on (shapes, dtypes, the non-tensor
  entries); a micro-batch of another signature (a last, smaller batch) runs eagerly, with one warning per stage.
- Gradients accumulated across micro-batches. The backward graph writes the parameters' gradients into fixed
  buffers; handing those to autograd as they are would let ``AccumulateGrad`` adopt a buffer as ``.grad`` when the
  gradient is None (its "steal" path) and the next replay would overwrite it. The replay hands autograd a copy when a
  parameter has no gradient yet (the first micro-batch of a step) and the buffer itself otherwise, which autograd adds
  in place, so gradient hooks (the data-parallel synchroniser's) run as in an eager step.

``torch.cuda.make_graphed_callables`` does the same capture, but returns its gradient buffers as they are (the steal
above breaks gradient accumulation over micro-batches) and captures in the "global" error mode, in which another
thread's CUDA call (a DataLoader's pin-memory thread) invalidates the capture; so the capture is written here, with
torch's public ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

# Eager forward-backward runs before a capture, on a side stream: the first compiles the stage's graphs (inductor) and
# runs lazy initialisation (cuBLAS handles, cuDNN plans, autotuning), which must not happen inside a capture.
WARMUP_ITERATIONS = 3


def microbatch_key(received: Sequence[Tensor], microbatch: Any) -> tuple | None:
    """What a graph is specialised to: the received tensors' shapes, dtypes and whether they need gradients, and the
    micro-batch's entries (a tensor's name, shape and dtype; any other entry's value). None when the micro-batch is
    not a flat mapping of tensors and hashable values (it then always runs eagerly)."""
    if not isinstance(microbatch, Mapping):
        return None
    entries = []
    for name in sorted(microbatch, key=str):
        value = microbatch[name]
        if isinstance(value, Tensor):
            entries.append((name, "tensor", tuple(value.shape), value.dtype, value.device))
        elif isinstance(value, Hashable) and not isinstance(value, (Mapping, list, tuple)):
            entries.append((name, "value", value))
        else:
            return None
    inputs = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in received)
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    return inputs, tuple(entries), autocast


class GraphedStage:
    """One stage's forward and backward for one micro-batch key, captured as two CUDA graphs that share ``pool``."""

    def __init__(self, stage: nn.Module, received: Sequence[Tensor], microbatch: Mapping[str, Any], pool: Any,
                 warmup: int = WARMUP_ITERATIONS) -> None:
        self.stage = stage
        self.names = tuple(k for k in sorted(microbatch, key=str) if isinstance(microbatch[k], Tensor))
        self.constants = {k: v for k, v in microbatch.items() if not isinstance(v, Tensor)}
        self.num_received = len(received)
        self.params = tuple(p for p in stage.parameters() if p.requires_grad)
        # Static input buffers: what every replay reads. Received tensors keep their requires_grad (their gradients are
        # what the stage sends back); the micro-batch's tensors are data.
        self.inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in received]
        self.inputs += [microbatch[k].detach().clone() for k in self.names]
        self.differentiable = [t for t in self.inputs[: self.num_received] if t.requires_grad] + list(self.params)
        # Capture with autocast's cast cache off: a cast cached during the capture would live in the graph's pool and
        # be handed to eager code after it (torch's make_graphed_callables refuses the cache for the same reason).
        device = "cuda"
        autocast = torch.autocast(device, dtype=torch.get_autocast_dtype(device),
                                  enabled=torch.is_autocast_enabled(device), cache_enabled=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with autocast, torch.cuda.stream(side):
            for _ in range(warmup):
                outputs = self._outputs(self._call())
                needed = [o for o in outputs if o.requires_grad]
                if needed:
                    torch.autograd.grad(needed, self.differentiable, [torch.zeros_like(o) for o in needed],
                                        allow_unused=True)
                del outputs, needed
        torch.cuda.current_stream().wait_stream(side)
        # "thread_local": CUDA calls of other threads (a DataLoader's pin-memory thread) do not invalidate the capture.
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with autocast, torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            result = self._call()
        self.single = isinstance(result, Tensor)
        self.outputs = self._outputs(result)
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in self.outputs]
        needed = [(o, g) for o, g in zip(self.outputs, self.grad_outputs) if g is not None]
        if not needed:
            raise ValueError(f"{type(stage).__name__} returned no tensor that requires a gradient: nothing to train.")
        with autocast, torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad([o for o, _ in needed], self.differentiable, [g for _, g in needed],
                                        allow_unused=True)
        self.grads: tuple[Tensor | None, ...] = grads
        self.pending = False  # a replayed forward whose backward has not run yet

    def _call(self) -> Any:
        received = self.inputs[: self.num_received]
        microbatch = dict(zip(self.names, self.inputs[self.num_received:]))
        microbatch.update(self.constants)
        return self.stage(*received, microbatch=microbatch)

    def _outputs(self, result: Any) -> list[Tensor]:
        outputs = [result] if isinstance(result, Tensor) else list(result) if isinstance(result, (tuple, list)) else None
        if outputs is None or not all(isinstance(o, Tensor) for o in outputs):
            raise TypeError(f"{type(self.stage).__name__} returned {type(result).__name__}: a graphed stage must return a"
                            " tensor or a tuple of tensors.")
        return outputs

    def __call__(self, received: Sequence[Tensor], microbatch: Mapping[str, Any]) -> Any:
        live = [*received, *(microbatch[k] for k in self.names)]
        outputs = _Replay.apply(self, *live[: self.num_received], *self.params, *live[self.num_received:])
        return outputs[0] if self.single else tuple(outputs)

    def load(self, live: Sequence[Tensor]) -> None:
        for static, value in zip(self.inputs, live):
            if static.data_ptr() != value.data_ptr():
                static.copy_(value)


class _Replay(torch.autograd.Function):
    """Replays a ``GraphedStage``. Its differentiable inputs are the received tensors and the parameters (in the order
    of ``GraphedStage.differentiable``), so autograd routes the backward graph's gradients to them."""

    @staticmethod
    def forward(ctx, graphed: GraphedStage, *tensors: Tensor):  # type: ignore[override]
        n, p = graphed.num_received, len(graphed.params)
        graphed.load([*tensors[:n], *tensors[n + p:]])
        graphed.forward_graph.replay()
        graphed.pending = True
        ctx.graphed = graphed
        return tuple(o.detach() for o in graphed.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor):  # type: ignore[override]
        graphed: GraphedStage = ctx.graphed
        for buffer, grad in zip(graphed.grad_outputs, grads):
            if buffer is None:
                continue
            if grad is None:
                buffer.zero_()
            elif buffer.data_ptr() != grad.data_ptr():
                buffer.copy_(grad)
        graphed.backward_graph.replay()
        graphed.pending = False
        grads_iter = iter(graphed.grads)
        out: list[Tensor | None] = [None]  # for ``graphed``
        for t in graphed.inputs[: graphed.num_received]:
            # A received tensor's gradient goes to the previous stage after this returns; a copy keeps the next
            # replay from overwriting it before it is sent.
            grad = next(grads_iter) if t.requires_grad else None
            out.append(None if grad is None else grad.clone())
        for param in graphed.params:
            grad = next(grads_iter)
            # A parameter without a gradient yet would adopt the buffer itself (AccumulateGrad's steal); the next
            # replay would then overwrite its gradient. With one, autograd adds the buffer into it in place.
            out.append(None if grad is None else grad.clone() if param.grad is None else grad)
        out.extend(None for _ in graphed.names)
        return tuple(out)


class StageGraphs:
    """The CUDA graphs of this rank's stages, by stage index: captured on a stage's first training micro-batch,
    replayed for every later one with the same key, eager otherwise (see the module docstring).

    ``capture``: what builds a graphed stage (``GraphedStage``; the CPU tests pass an eager stand-in to test the
    bookkeeping)."""

    def __init__(self, capture: Callable[..., Any] | None = None) -> None:
        self.capture = capture or GraphedStage
        self.graphs: dict[int, tuple[tuple, Any]] = {}
        self.eager_keys: dict[int, tuple] = {}  # stages that warned about a micro-batch of another key
        self.pool: Any = None
        self.replays = 0  # micro-batches replayed (read by tests and benchmarks)
        self.eager = 0  # training micro-batches that ran eagerly
        self.warned_pending = False

    def forward(self, index: int, stage: nn.Module, received: Sequence[Tensor], microbatch: Any) -> Any:
        key = microbatch_key(received, microbatch)
        entry = self.graphs.get(index)
        if entry is None and key is not None:
            if self.pool is None and self.capture is GraphedStage:
                self.pool = torch.cuda.graph_pool_handle()
            try:
                captured = self.capture(stage, received, microbatch, self.pool)
            except Exception as error:
                # A stage that cannot be captured (host synchronisation inside it, an op CUDA graphs refuse): the
                # user asked for graphs, so stop with what failed rather than train slower than they planned.
                raise RuntimeError(
                    f"cuda_graphs: capturing stage {index} ({type(stage).__name__}) on micro-batch shapes"
                    f" {_describe(key)} failed: {type(error).__name__}: {error}. A captured stage may not synchronise"
                    " with the host (.item(), .cpu(), data-dependent shapes) or change shapes between runs; fix the"
                    " stage, or set cuda_graphs=False."
                ) from error
            entry = self.graphs[index] = (key, captured)
        if entry is not None and entry[0] == key and not entry[1].pending:
            self.replays += 1
            return entry[1](received, microbatch)
        if entry is not None and entry[0] == key and not self.warned_pending:
            self.warned_pending = True
            warnings.warn(
                f"cuda_graphs: stage {index} got a forward while its graphed micro-batch still waits for its backward"
                " (the schedule keeps more than one micro-batch in flight); such forwards run eagerly. Use a schedule"
                " that runs each micro-batch's backward before the next forward (\"1f1b\" at pipeline_parallel_size=1).",
                stacklevel=2,
            )
        elif entry is not None and entry[0] != key and index not in self.eager_keys:
            self.eager_keys[index] = key
            warnings.warn(
                f"cuda_graphs: stage {index} captured micro-batches of shapes {_describe(entry[0])} and got one of"
                f" {_describe(key)}; such micro-batches run eagerly (without CUDA graphs). Give every training"
                " micro-batch the same shapes (drop_last=True, padding to a fixed length) to replay them all.",
                stacklevel=2,
            )
        elif key is None and index not in self.eager_keys:
            self.eager_keys[index] = key
            warnings.warn(
                f"cuda_graphs: stage {index} got a micro-batch of type {type(microbatch).__name__} that is not a flat"
                " mapping of tensors and hashable values; it runs eagerly (without CUDA graphs).", stacklevel=2,
            )
        self.eager += 1
        return stage(*received, microbatch=microbatch)

    def memory(self) -> dict[str, int]:
        """Bytes of the graphs' memory pool on this device: ``reserved`` (the pool's segments) and ``allocated`` (what
        the caching allocator counts as live in them: the graphs' static outputs and gradient buffers).

        The difference is what the replays use and ``torch.cuda.max_memory_allocated`` never sees: a replay allocates
        nothing, so activations saved between a micro-batch's forward and backward graph and the graphs' temporaries
        live in blocks the allocator counts as free. A run's resident peak is its counted peak after the captures
        plus ``reserved - allocated`` (docs/speed.md, "CUDA graphs")."""
        if self.pool is None:
            return {"reserved": 0, "allocated": 0}
        pool = tuple(self.pool)
        segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == pool]
        return {"reserved": sum(s["total_size"] for s in segments),
                "allocated": sum(s["allocated_size"] for s in segments)}

    def begin_step(self) -> None:
        """A step starts: a graphed forward whose backward never ran (a step that raised) is no longer pending."""
        for _, graphed in self.graphs.values():
            graphed.pending = False

    def release(self) -> None:
        """Free the graphs and their memory pool (the strategy's teardown)."""
        self.graphs.clear()
        self.pool = None


def _describe(key: tuple | None) -> str:
    if key is None:
        return "(not a flat mapping)"
    inputs, entries, _ = key
    parts = [f"{e[0]}={list(e[2])}" for e in entries if e[1] == "tensor"]
    parts += [f"received={list(shape)}" for shape, _, _ in inputs]
    return "{" + ", ".join(parts) + "}"
