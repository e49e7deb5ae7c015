"""A cost model read from a profile file (``lightning-3d profile`` writes it): measured per-layer times and memory
on grids of micro-batch size × sequence length (× target length for T5's decoder), one grid per (kind, recompute,
tp), interpolated linearly and vectorised (SciPy's ``RegularGridInterpolator``). Above the largest profiled micro-batch
size a layer's device time and memory grow in proportion to the size from there (its work and activations are per
sample; the host times stay), so many short samples in one micro-batch (token budgets, dynamic micro-batching) get a
price; outside the lengths, or where the profiler ran out of memory (``null`` in the file), the cost is ``inf``. A
compiled model's grids are the exception: outside their lengths they price a shape as the eager grid there
times the compiled-to-eager ratio at the nearest compiled length (``ProfiledCostModel._read``).

The file is JSON (no pickle: a profile someone sends runs no code), versioned (``PROFILE_FORMAT``,
``PROFILE_VERSION``); docs/planner.md documents its fields. ``derive_tp=True`` prices a tensor-parallel degree the
profile lacks from its tp = 1 grid, scaled by the analytic model's tp ratio (the shard's compute), which is what a
one-GPU profile can offer for multi-GPU plans.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike
from scipy.interpolate import RegularGridInterpolator

from lightning_3d.costs.analytic import AnalyticCostModel
from lightning_3d.costs.host import IN_SITU_PASSES, in_situ_host_layers
from lightning_3d.costs.model import DeviceSpec, LayerKind, ModelShape

PROFILE_FORMAT = "lightning_3d.profile"
PROFILE_VERSION = 2
#: versions this code reads; version 1 lacks the host times and the fixed overheads (read as absent: zero)
READABLE_VERSIONS = (1, 2)
QUANTITIES = ("forward", "backward", "stored", "peak")
#: optional per-grid quantities (version 2): the host's (CPU) seconds to issue a layer's forward / backward
HOST_QUANTITIES = ("host_forward", "host_backward")
BLOCK_KINDS = ("block", "encoder_block", "decoder_block")
#: kinds whose work runs over the target sequence where the profile has a target axis (T5): their ``sustained``
#: ratios are indexed by micro-batch size x target length (``planner.clocks`` measures them so)
TARGET_KINDS = ("decoder_block", "head")


#: the grids' seconds, made non-decreasing in micro-batch size when read (``monotone_in_microbatch``)
TIME_QUANTITIES = ("forward", "backward", *HOST_QUANTITIES)


def monotone_in_microbatch(grid: np.ndarray) -> np.ndarray:
    """``grid`` (micro-batch size first) made non-decreasing along its first axis by pooling adjacent violators (the
    least-squares monotone fit, PAVA), per point of the other axes; unprofiled (inf) cells stay as they are.

    A layer's work grows with its micro-batch and its launches do not change, so its time cannot fall as the
    micro-batch grows; a grid that falls holds the noise of its samples (each a median of a few chained timings,
    a difference of two spans), which pooling averages over the neighbours instead of trusting one sample."""
    out = np.array(grid, dtype=float, copy=True)
    flat = out.reshape(out.shape[0], -1)
    for j in range(flat.shape[1]):
        col = flat[:, j]
        n = int(np.argmax(~np.isfinite(col))) if not np.all(np.isfinite(col)) else len(col)
        blocks: list[list[float]] = []  # [sum, count]
        for v in col[:n]:
            blocks.append([float(v), 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        i = 0
        for total, count in blocks:
            col[i:i + int(count)] = total / count
            i += int(count)
        flat[:, j] = col
    return flat.reshape(out.shape)


class _Grid:
    """One (kind, recompute, tp) grid: axes and the four measured quantities, interpolated; scaled past the largest
    micro-batch size, inf outside the lengths (module docstring)."""

    def __init__(self, entry: dict, where: str) -> None:
        axes = [entry["microbatch_size"], entry["seq_len"]]
        if entry.get("target_len") is not None:
            axes.append(entry["target_len"])
        self.axes = [np.asarray(a, dtype=float) for a in axes]
        for name, axis in zip(("microbatch_size", "seq_len", "target_len"), self.axes):
            if axis.ndim != 1 or len(axis) < 1 or np.any(np.diff(axis) <= 0) or np.any(axis <= 0):
                raise ValueError(f"{where}: {name} axis {axis.tolist()} must be positive and strictly increasing.")
        shape = tuple(len(a) for a in self.axes)
        self.interp = {}
        for q in (*QUANTITIES, *(h for h in HOST_QUANTITIES if entry.get(h) is not None)):
            values = np.array(entry[q], dtype=object)
            if values.shape != shape:
                raise ValueError(f"{where}: {q} has shape {values.shape}, the axes say {shape}.")
            grid = np.array([math.inf if v is None else float(v) for v in values.ravel()], dtype=float).reshape(shape)
            if np.any(grid < 0) or np.any(np.isnan(grid)):
                raise ValueError(f"{where}: {q} holds negative or NaN values.")
            if q in TIME_QUANTITIES:
                grid = monotone_in_microbatch(grid)
            # Singleton axes cannot be interpolated: padded to two equal points so that only that value is inside.
            axes = [a if len(a) > 1 else np.array([a[0], a[0] * (1 + 1e-9)]) for a in self.axes]
            padded = grid
            for dim, a in enumerate(self.axes):
                if len(a) == 1:
                    padded = np.concatenate([padded, padded], axis=dim)
            # Unprofiled points (inf) are interpolated as a mask: a point is inf when an unprofiled neighbour has a
            # positive weight (a zero-weight one, e.g. across the cell from a grid point, does not count).
            missing = np.isinf(padded)
            self.interp[q] = (RegularGridInterpolator(axes, np.where(missing, 0.0, padded), bounds_error=False,
                                                      fill_value=math.inf),
                              RegularGridInterpolator(axes, missing.astype(float), bounds_error=False, fill_value=1.0))

    def __call__(self, q: str, points: list[np.ndarray]) -> np.ndarray:
        b = np.broadcast_arrays(*points)
        flat = np.stack([p.ravel().astype(float) for p in b], axis=-1)
        # Past the largest profiled micro-batch: the value there, times the size ratio (device time and memory are
        # per sample once a size that large keeps the GPU busy; a pessimistic price where it does not yet). An
        # out-of-memory cell at the top stays inf. Host times do not grow with the size.
        top = self.axes[0][-1]
        scale = np.maximum(flat[:, 0] / top, 1.0) if q not in HOST_QUANTITIES else 1.0
        flat[:, 0] = np.minimum(flat[:, 0], top)
        values, missing = self.interp[q]
        out = np.where(missing(flat) > 0, math.inf, values(flat) * scale)
        return out.reshape(b[0].shape)


class ProfiledCostModel:
    """``CostModel`` from a profile file (see the module docstring)."""

    def __init__(self, profile: str | Path | dict, *, derive_tp: bool = False, tp_link_bandwidth: float | None = None,
                 tp_latency: float = 10e-6, compiled: bool = False, sustained_clock: bool = True) -> None:
        if isinstance(profile, dict):
            data, where = profile, "profile"
            digest = hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()[:12]
        else:
            raw = Path(profile).read_bytes()
            where, digest = str(profile), hashlib.sha256(raw).hexdigest()[:12]
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{where} is not a profile (JSON expected): {err}") from None
        check_profile(data, where)
        self.source = f"profile:{where}#{digest}"
        self.shape = ModelShape(**data["model"])
        self.device = DeviceSpec(**data["device"])
        self.collectives = data.get("collectives", {})
        #: measured AdamW step seconds per parameter (None when the profile lacks it; the planner then estimates)
        self.optimizer_seconds_per_parameter = (data.get("optimizer") or {}).get("seconds_per_parameter")
        self.version = int(data["version"])
        overheads = data.get("overheads") or {}
        #: measured host overhead of one micro-batch outside its layers (the strategy's engine, the forward and
        #: backward calls) and of one step outside the micro-batches and the optimizer (Lightning's loop, hooks);
        #: 0 for version-1 profiles, which did not measure them
        self.microbatch_overhead_seconds = float(overheads.get("microbatch_seconds") or 0.0)
        self.step_overhead_seconds = float(overheads.get("step_seconds") or 0.0)
        #: how the step's own seconds grow per block a rank holds beyond ``step_overhead_blocks`` (the tiny model's
        #: blocks, where ``step_overhead_seconds`` was measured): the tiny widths at the real depth measure it
        #: (``planner.overheads.step_seconds_at_depth``); 0 where a profile lacks it
        self.step_overhead_per_block_seconds = float(overheads.get("step_seconds_per_block") or 0.0)
        self.step_overhead_blocks = int(overheads.get("step_blocks") or 0)
        #: per block kind, the host's seconds to issue the layer inside the training loop (the profiler's tiny model
        #: at the real depth: ``measure_overheads``), a floor besides the isolated ``host_forward``/``host_backward``
        #: grids of that kind; absent from older profiles
        self.host_layers_in_situ: dict[str, dict[str, float]] = _in_situ_terms(overheads, self.shape)
        #: grids of torch.compile'd blocks (``compiled=True``) instead of eager ones; embedding and head are eager
        self.compiled = bool(compiled)
        self.derive_tp = derive_tp
        self.tp_link_bandwidth = tp_link_bandwidth
        self.tp_latency = tp_latency
        self._grids: dict[tuple[str, bool, int], _Grid] = {}
        #: (kind, recompute, tp) grids measured across tp GPUs (the profiler's ``measure_tp_layers``): their spans hold
        #: the layer's collectives, which the planner then does not add again
        self._with_collectives: set[tuple[str, bool, int]] = set()
        #: a compiled model's eager grids where the same (kind, recompute, tp) has a compiled one (blocks; the head where
        #: the profile compiled its loss): they price the lengths outside the compiled grid's (``_read``)
        self._eager_twins: dict[tuple[str, bool, int], _Grid] = {}
        self._warned_beyond: set[str] = set()
        for kind, entries in data["layers"].items():
            # Per (recompute, tp): the grid of the asked compilation; the embedding and head fall back to eager ones
            # (a profile compiles the blocks, and the head's loss where it can).
            chosen: dict[tuple[bool, int], tuple[int, dict]] = {}
            eager: dict[tuple[bool, int], tuple[int, dict]] = {}
            for i, entry in enumerate(entries):
                same = bool(entry.get("compiled", False)) == self.compiled
                key = (bool(entry["recompute"]), int(entry["tp"]))
                if not same:
                    eager[key] = (i, entry)  # the last, as an eager model's reading keeps
                    if kind in BLOCK_KINDS:
                        continue
                if key not in chosen or same:
                    chosen[key] = (i, entry)
            for (rc, tp), (i, entry) in chosen.items():
                self._grids[(kind, rc, tp)] = _Grid(entry, f"{where}: layers.{kind}[{i}]")
                if tp > 1 and entry.get("collectives"):
                    self._with_collectives.add((kind, rc, tp))
                if self.compiled and entry.get("compiled", False) and (rc, tp) in eager:
                    j, other = eager[(rc, tp)]
                    self._eager_twins[(kind, rc, tp)] = _Grid(other, f"{where}: layers.{kind}[{j}]")
        if self.compiled:
            missing = [k for k in data["layers"] if k in BLOCK_KINDS and not any(kk == k for kk, _, _ in self._grids)]
            if missing:
                raise ValueError(f"{where} has no compiled grid for {missing}: profile with `lightning-3d profile"
                                 f" --compile` (or read it with compiled=False for eager costs).")
        self._analytic = AnalyticCostModel(self.shape, self.device) if derive_tp else None
        #: per layer kind, (log tokens, ratio) of the profile's ``sustained`` section: the slow-down of the layer's
        #: kernels at the clock a busy GPU's power limit leaves (``planner.clocks``); empty where the profile has none
        #: or ``sustained_clock=False`` (the grids' burst times stand)
        self.sustained: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if sustained_clock:
            for kind, entry in ((data.get("sustained") or {}).get("kinds") or {}).items():
                if entry.get("tokens"):
                    order = np.argsort(entry["tokens"])
                    self.sustained[kind] = (np.log(np.asarray(entry["tokens"], dtype=float)[order]),
                                            np.maximum(np.asarray(entry["ratio"], dtype=float)[order], 1.0))

    def clock_ratio(self, kind: str, microbatch_size: ArrayLike, seq_len: ArrayLike,
                    target_len: ArrayLike | None = None) -> np.ndarray:
        """The factor on ``kind``'s grid seconds at the sustained clock: the profile's ratios interpolated linearly in
        log tokens (micro-batch size x sequence length; x target length for T5's decoder and head), the nearest
        measured ratio outside them, and at least 1 (a busy GPU does not run faster than the burst); 1 for kinds
        without a measurement. Applied to every micro-batch alike: a step whose GPU idles waiting for the host runs
        cooler, but its time is the host's then (``costs.host``), and the larger device term stays below it."""
        b, s = np.asarray(microbatch_size, dtype=float), np.asarray(seq_len, dtype=float)
        curve = self.sustained.get(kind)
        if curve is None:
            return np.ones(np.broadcast_shapes(b.shape, s.shape))
        length = np.asarray(target_len, dtype=float) if kind in TARGET_KINDS and target_len is not None else s
        tokens = np.maximum(b * length, 1.0)
        return np.interp(np.log(tokens), curve[0], curve[1])

    def kinds(self) -> set[str]:
        return {k for k, _, _ in self._grids}

    def includes_tp_collectives(self, kind: str, recompute: bool, tp: int) -> bool:
        """Whether ``layer_time`` at this tp degree is a measured span that already holds the layer's tensor-parallel
        collectives (a grid the profiler measured across tp GPUs), so that no modelled all-reduce is added."""
        return (kind, recompute, tp) in self._with_collectives

    def _read(self, key: tuple[str, bool, int], q: str, points: list[np.ndarray], stacklevel: int = 4) -> np.ndarray:
        """``q`` of the grid ``key`` at ``points``. A compiled grid (a block's, the head's) prices the lengths outside its own (sequence
        and target axes; micro-batch sizes scale as in every grid) as the eager grid there times the ratio of compiled
        to eager at the nearest length the compiled grid holds, the same micro-batch size: a compiled profile timed at
        the lengths one fixed batching runs (a packed row's) still prices the shorter rows of a dynamic plan, with the
        speed-up measured closest to them, where a plain lookup would call them unplannable (inf). Inside its lengths
        a compiled grid is read as measured, out-of-memory cells included. ``stacklevel``: the warning's, at the
        public method's caller."""
        grid = self._grids[key]
        out = grid(q, points)
        eager = self._eager_twins.get(key)
        if eager is None or q not in eager.interp:
            return out
        b = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in points))
        outside = np.zeros(b[0].shape, dtype=bool)
        for axis, x in zip(grid.axes[1:], b[1:]):
            outside |= (x < axis[0]) | (x > axis[-1])
        if not outside.any():
            return out
        if key[0] not in self._warned_beyond:
            self._warned_beyond.add(key[0])
            spans = ", ".join(f"{name} {int(a[0])}..{int(a[-1])}" for name, a in zip(("seq_len", "target_len"), grid.axes[1:]))
            warnings.warn(f"The profile's compiled {key[0]!r} grid holds {spans}: shapes outside it are priced as its"
                          " eager grid times the compiled-to-eager ratio at the nearest compiled length. For measured"
                          " prices, profile with compiled grids over the lengths you train (`lightning-3d profile"
                          " --compile`, or `planner.add_compiled` on this profile).", stacklevel=stacklevel)
        # Only the points outside are priced again (a dynamic plan's ranges can be many).
        there = [x[outside] for x in b]
        nearest = [there[0], *(np.clip(x, axis[0], axis[-1]) for axis, x in zip(grid.axes[1:], there[1:]))]
        compiled_near, eager_near, eager_there = grid(q, nearest), eager(q, nearest), eager(q, there)
        usable = np.isfinite(eager_near) & (eager_near > 0)
        ratio = np.where(usable, compiled_near / np.where(usable, eager_near, 1.0),
                         np.where(compiled_near == 0, 1.0, math.inf))
        with np.errstate(invalid="ignore"):
            priced = eager_there * ratio
        # 0 x inf (a zero cell against an unmeasured ratio) and inf x 0 are unpriced, never NaN: a NaN would pass a
        # memory budget's comparison.
        out = np.array(out, dtype=float, copy=True)
        out[outside] = np.where(np.isnan(priced), math.inf, priced)
        return out

    def _lookup(self, kind: str, recompute: bool, tp: int, q: str, points: list[np.ndarray]) -> np.ndarray:
        if (kind, recompute, tp) in self._grids:
            return self._read((kind, recompute, tp), q, points)
        if recompute and (kind, False, tp) in self._grids and kind in ("embedding", "head"):
            return self._lookup(kind, False, tp, q, points)  # these layers are never recomputed
        base = self._grids.get((kind, recompute, 1))
        if tp > 1 and self.derive_tp and base is not None:
            b, s, t = points[0], points[1], points[2] if len(points) > 2 else None
            if q in ("forward", "backward"):
                one = self._analytic.layer_time(kind, b, s, target_len=t, recompute=recompute, tp=1)
                many = self._analytic.layer_time(kind, b, s, target_len=t, recompute=recompute, tp=tp)
                i = 0 if q == "forward" else 1
            else:
                one = self._analytic.layer_memory(kind, b, s, target_len=t, recompute=recompute, tp=1)
                many = self._analytic.layer_memory(kind, b, s, target_len=t, recompute=recompute, tp=tp)
                i = 0 if q == "stored" else 1
            ratio = np.divide(many[i], one[i], out=np.ones_like(np.asarray(one[i], dtype=float)), where=one[i] > 0)
            return self._read((kind, recompute, 1), q, points[: len(base.axes)]) * ratio
        shape = np.broadcast_shapes(*(np.shape(p) for p in points))
        return np.full(shape, math.inf)

    def _points(self, kind, microbatch_size, seq_len, target_len, recompute, tp):
        grid = self._grids.get((kind, recompute, tp)) or self._grids.get((kind, False, tp)) or self._grids.get((kind, recompute, 1))
        points = [np.asarray(microbatch_size, dtype=float), np.asarray(seq_len, dtype=float)]
        if grid is not None and len(grid.axes) == 3:
            if target_len is None:
                raise ValueError(f"the profile's {kind!r} grid has a target length axis: pass target_len.")
            points.append(np.asarray(target_len, dtype=float))
        return points

    def layer_time(self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                   target_len: ArrayLike | None = None, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        p = self._points(kind, microbatch_size, seq_len, target_len, recompute, tp)
        ratio = self.clock_ratio(kind, microbatch_size, seq_len, target_len)
        fwd = self._lookup(kind, recompute, tp, "forward", p) * ratio
        bwd = self._lookup(kind, recompute, tp, "backward", p) * ratio
        if tp > 1 and self.tp_link_bandwidth and not self.includes_tp_collectives(kind, recompute, tp):
            h, e = self.shape.hidden_size, self.shape.bytes_per_element
            b, s = np.asarray(microbatch_size, dtype=float), np.asarray(seq_len, dtype=float)
            tokens = b * (np.asarray(target_len, dtype=float) if kind == "decoder_block" and target_len is not None else s)
            count = {"embedding": 1, "head": 1, "decoder_block": 3}.get(kind, 2)
            comm = count * (2 * (tp - 1) / tp * tokens * h * e / self.tp_link_bandwidth + self.tp_latency)
            fwd, bwd = fwd + comm, bwd + comm
        return fwd, bwd

    def layer_host_time(self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                        target_len: ArrayLike | None = None, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds the host takes to issue the layer's kernels (version-2 profiles; zeros where
        the profile has none). A tensor-parallel shard launches the same kernels as the whole layer, so a degree
        the profile lacks takes the tp = 1 host time (the collectives' launches are not counted)."""
        p = self._points(kind, microbatch_size, seq_len, target_len, recompute, tp)
        keys = [(kind, recompute, tp), (kind, recompute, 1)]
        if kind in ("embedding", "head"):
            keys += [(kind, False, tp), (kind, False, 1)]
        key = next((k for k in keys if k in self._grids), None)
        shape = np.broadcast_shapes(*(np.shape(x) for x in p))
        f = b = np.zeros(shape)
        if key is not None and "host_forward" in self._grids[key].interp:
            q = p[: len(self._grids[key].axes)]
            f, b = self._read(key, "host_forward", q, stacklevel=3), self._read(key, "host_backward", q, stacklevel=3)
        # The in-situ times were measured with eager tiny models: a floor of eager blocks only. A compiled block
        # issues its fused graph's few kernels, whose host time its own (compiled) grid holds.
        situ = None if self.compiled else self.host_layers_in_situ.get(kind)
        if situ is not None:
            # The in-situ time is the eager block's host time inside the training loop, at every micro-batch size and
            # shard (the same launches): it replaces the isolated grid, which times the block alone in a tight loop
            # and can measure well above the loop's time per block (docs/planner.md, "in-situ host times"); taking
            # the larger of the two put that excess into every host-bound prediction.
            pre = "recompute_" if recompute else ""
            f = np.broadcast_to(np.float64(situ[pre + "forward"]), np.shape(f)).copy()
            b = np.broadcast_to(np.float64(situ[pre + "backward"]), np.shape(b)).copy()
        return f, b

    def layer_memory(self, kind: LayerKind, microbatch_size: ArrayLike, seq_len: ArrayLike, *,
                     target_len: ArrayLike | None = None, recompute: bool = False, tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
        p = self._points(kind, microbatch_size, seq_len, target_len, recompute, tp)
        return self._lookup(kind, recompute, tp, "stored", p), self._lookup(kind, recompute, tp, "peak", p)


def _in_situ_terms(overheads: dict, shape: ModelShape) -> dict[str, dict[str, float]]:
    """The in-situ host seconds per block kind (``overheads.host_layers``), re-derived from the stored seconds of the
    tiny models where the profile holds them (``costs.host.in_situ_host_layers``: the loop scales as measured).
    Profiles written before that rule clamped the scales at 1 and did not store the isolated times: those are the
    stored terms over their scales, and the tiny model had one block of each kind (the recipe's ``RecipeCosts.tiny``)."""
    stored = {k: {q: float(v[q]) for q in IN_SITU_PASSES} for k, v in (overheads.get("host_layers") or {}).items()}
    seconds, scales = overheads.get("host_microbatch_seconds"), overheads.get("host_scale")
    if not stored or not seconds or not scales:
        return stored
    isolated = overheads.get("host_layers_isolated")
    if isolated is None:
        if min(scales) <= 0:
            return stored
        isolated = {k: {q: v[q] / scales[q.startswith("recompute")] for q in IN_SITU_PASSES} for k, v in stored.items()}
    tiny = overheads.get("host_tiny_blocks") or {k: 1 for k in isolated}
    deep: dict[str, int] = {}
    for k in shape.layer_kinds():
        if k in isolated:
            deep[k] = deep.get(k, 0) + 1
    layers, _ = in_situ_host_layers({k: {q: float(v[q]) for q in IN_SITU_PASSES} for k, v in isolated.items()},
                                    tiny, deep, float(seconds["depth_1"]), float(seconds["depth"]),
                                    float(seconds["depth_recompute"]))
    return layers


def check_profile(data: object, where: str = "profile") -> None:
    """Raise a ValueError naming what is wrong with a profile's structure (format, version, fields)."""
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{where} is not a lightning_3d profile (its 'format' must be {PROFILE_FORMAT!r}).")
    if data.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{where} has profile version {data.get('version')!r}; this lightning_3d reads versions"
                         f" {list(READABLE_VERSIONS)}. Re-run `lightning-3d profile` with this version.")
    for key, cls in (("model", ModelShape), ("device", DeviceSpec)):
        section = data.get(key)
        allowed = {f.name for f in fields(cls)}
        if not isinstance(section, dict) or set(section) - allowed:
            raise ValueError(f"{where}: '{key}' must be a mapping of {sorted(allowed)}.")
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{where}: 'layers' must map layer kinds to lists of grids.")
    needed = {"tp", "recompute", "microbatch_size", "seq_len", *QUANTITIES}
    for kind, entries in layers.items():
        if kind not in ("embedding", "block", "encoder_block", "decoder_block", "head"):
            raise ValueError(f"{where}: unknown layer kind {kind!r}.")
        for i, entry in enumerate(entries):
            missing = needed - set(entry)
            if missing:
                raise ValueError(f"{where}: layers.{kind}[{i}] lacks {sorted(missing)}.")
            if (entry.get("host_forward") is None) != (entry.get("host_backward") is None):
                raise ValueError(f"{where}: layers.{kind}[{i}] has one of host_forward/host_backward without the other.")
    _check_sustained(data.get("sustained"), where)
    overheads = data.get("overheads")
    if overheads is not None:
        if not isinstance(overheads, dict) or any(
                not isinstance(overheads.get(k, 0.0), (int, float)) or overheads.get(k, 0.0) < 0
                for k in ("microbatch_seconds", "step_seconds")):
            raise ValueError(f"{where}: 'overheads' must hold microbatch_seconds and step_seconds as non-negative"
                             f" numbers (got {overheads!r}).")
        per_block, blocks = overheads.get("step_seconds_per_block", 0.0), overheads.get("step_blocks", 0)
        if (not isinstance(per_block, (int, float)) or isinstance(per_block, bool) or not per_block >= 0
                or not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0
                or (per_block > 0 and "step_blocks" not in overheads)):
            given = overheads.get("step_blocks", "none")
            raise ValueError(f"{where}: 'overheads.step_seconds_per_block' must be non-negative seconds and"
                             f" 'overheads.step_blocks' a non-negative count of blocks, given with it (got"
                             f" {per_block!r} and {given!r}); profile again with `lightning-3d profile`.")
        for field in ("host_layers", "host_layers_isolated"):
            _check_in_situ(overheads.get(field), field, where)
        seconds, tiny = overheads.get("host_microbatch_seconds"), overheads.get("host_tiny_blocks")
        keys = ("depth_1", "depth", "depth_recompute")
        if seconds is not None and (not isinstance(seconds, dict) or set(seconds) != set(keys) or any(
                not isinstance(seconds[k], (int, float)) or not seconds[k] >= 0 for k in keys)):
            raise ValueError(f"{where}: 'overheads.host_microbatch_seconds' must hold non-negative {list(keys)} seconds"
                             f" (got {seconds!r}); re-run `lightning-3d profile`.")
        if tiny is not None and (not isinstance(tiny, dict) or any(
                k not in BLOCK_KINDS or not isinstance(n, int) or n < 1 for k, n in tiny.items())):
            raise ValueError(f"{where}: 'overheads.host_tiny_blocks' must map block kinds {list(BLOCK_KINDS)} to"
                             f" positive block counts (got {tiny!r}); re-run `lightning-3d profile`.")


def _check_sustained(section: object, where: str) -> None:
    """The ``sustained`` section (``planner.clocks``): per layer kind, equally long lists of positive tokens and
    positive finite ratios, or the error that kept the kind from being measured."""
    if section is None:
        return
    kinds = section.get("kinds") if isinstance(section, dict) else None
    if not isinstance(kinds, dict):
        raise ValueError(f"{where}: 'sustained' must hold 'kinds', a mapping of layer kinds to their measured ratios.")
    for kind, entry in kinds.items():
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: sustained.kinds.{kind} must be a mapping (got {entry!r}).")
        if "error" in entry and "tokens" not in entry:
            continue
        tokens, ratio = entry.get("tokens"), entry.get("ratio")
        good = (isinstance(tokens, list) and isinstance(ratio, list) and len(tokens) == len(ratio)
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in tokens)
                and all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
                        for r in ratio))
        if not good:
            raise ValueError(f"{where}: sustained.kinds.{kind} must hold 'tokens' (positive counts) and 'ratio' (positive"
                             f" finite factors) of one length (got tokens={tokens!r}, ratio={ratio!r}); re-run"
                             " `lightning-3d profile`.")


def _check_in_situ(situ: object, field: str, where: str) -> None:
    """The in-situ host seconds per block kind (``host_layers``, ``host_layers_isolated``): non-negative, per pass."""
    if situ is not None:
        names = IN_SITU_PASSES
        if not isinstance(situ, dict) or any(
                k not in BLOCK_KINDS or not isinstance(v, dict) or set(v) != set(names)
                or any(not isinstance(v[n], (int, float)) or not v[n] >= 0 for n in names) for k, v in situ.items()):
            raise ValueError(f"{where}: 'overheads.{field}' must map block kinds {list(BLOCK_KINDS)} to"
                             f" non-negative {list(names)} seconds (got {situ!r}); re-run `lightning-3d profile`.")


def new_profile(shape: ModelShape, device: DeviceSpec, **extra) -> dict:
    """An empty profile document (the profiler and tests fill ``layers``)."""
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": asdict(shape), "device": asdict(device),
            "layers": {}, **extra}
