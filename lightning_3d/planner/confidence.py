"""How sure the planner is: the runner-up configurations whose predicted step time is within the model's error of the
best, and for each the one measurement that would tell it from the best (docs/planner.md, "How sure the plan is").

Two predictions, each off by up to a fraction ``e`` of its value either way, cannot be ranked when their intervals
``[t (1 - e), t (1 + e)]`` overlap, i.e. when ``t_runner_up <= t_best (1 + e) / (1 - e)``. ``e`` defaults to the
validated error of the performance model (the time MAPE of the latest validation suite on one GPU, or on several;
docs/planner.md, "Validation"), and can be given (``SearchOptions.model_error``, ``lightning-3d plan --model-error``).

The measurement that tells two candidates apart is named by the model's own terms: the step's time splits into the
busiest pipeline rank's compute (its stages' forward and backward over every micro-batch), the pipeline's bubble and
sends (what the schedule's makespan adds to that compute), the exposed data-parallel synchronisation, the optimizer
step and the step's own seconds; the term whose prediction differs most between the two decides their order, so
that is what one step of each (``lightning-3d plan --verify``) settles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_3d.planner.model import Candidate, Prediction

# The time MAPE of the latest validation of the model (docs/planner.md: "The one-GPU suite with graphed
# configurations" for one GPU, "Why the second four-GPU validation missed" for several). Update with each suite.
VALIDATED_ERROR_ONE_GPU = 0.10
VALIDATED_ERROR_SEVERAL_GPUS = 0.114

TERM_NAMES = {
    "compute": "the busiest rank's compute (its layers' forward and backward over every micro-batch)",
    "bubble": "the pipeline bubble and sends",
    "dp_sync": "the exposed data-parallel synchronisation",
    "optimizer": "the optimizer step",
    "overhead": "the step's own seconds (loop, hooks, per-parameter work)",
}


def validated_error(num_gpus: int) -> float:
    """The model's documented time error (a fraction) for a plan on ``num_gpus`` GPUs."""
    return VALIDATED_ERROR_ONE_GPU if num_gpus == 1 else VALIDATED_ERROR_SEVERAL_GPUS


def check_model_error(error: float) -> float:
    if isinstance(error, bool) or not isinstance(error, (int, float)) or not (0.0 <= error < 1.0):
        raise ValueError(f"model_error={error!r} must be a fraction in [0, 1) (0.1 for a model within 10 %); leave it"
                         " unset for the validated error in docs/planner.md.")
    return float(error)


def within_error(best: float, other: float, error: float) -> bool:
    """Whether ``other``'s predicted time cannot be told from ``best``'s by a model off by ``error`` either way."""
    return other <= best * (1.0 + error) / (1.0 - error)


def step_terms(p: Prediction) -> dict[str, float]:
    """The prediction's step time split into the terms of ``TERM_NAMES`` (seconds; they add up to ``p.step_time``)."""
    c = p.candidate
    per_rank = [sum(p.stage_forward[s] + p.stage_backward[s] for s in range(r, c.num_stages, c.pp)) for r in range(c.pp)]
    compute = c.num_microbatches * max(per_rank)
    return {"compute": compute, "bubble": p.pipeline_time - compute, "dp_sync": p.exposed_dp_time,
            "optimizer": p.optimizer_time, "overhead": p.overhead_time}


def describe(c: Candidate) -> dict[str, object]:
    """The options a candidate sets, by the name a user reads (what ``differences`` compares)."""
    out: dict[str, object] = {"dp": c.dp, "pp": c.pp, "tp": c.tp}
    if c.cp > 1:
        out["cp"] = f"{c.cp} {c.cp_attention}"
    out["micro-batch"] = f"{c.microbatch_size}x{c.num_microbatches}"
    if c.pp > 1:
        out["schedule"] = c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else "")
        out["split"] = "/".join(map(str, c.layer_split))
    ckpt = c.stage_checkpointing
    out["checkpointing"] = "all" if all(ckpt) else "none" if not any(ckpt) else "".join("1" if x else "0" for x in ckpt)
    for name, value in option_flags(c).items():
        out[name] = value
    return out


def option_flags(c: Candidate) -> dict[str, object]:
    """The on/off options beyond the layout (compression, graphs, ...), as ``describe`` shows them."""
    return {"compression": c.compression, "cuda_graphs": c.cuda_graphs, "sequence_parallel": c.sequence_parallel,
            "shard_optimizer_state": c.shard_optimizer_state, "compile": c.compile}


def label(c: Candidate) -> str:
    d = describe(c)
    flags = [k for k, v in option_flags(c).items() if v is True]
    core = [f"{k}={v}" for k, v in d.items() if k not in option_flags(c)]
    return " ".join(core + flags)


def differences(best: Candidate, other: Candidate) -> str:
    """What ``other`` sets differently from ``best``, as "pp=2 schedule=1f1b vs pp=1" (the runner-up's first)."""
    a, b = describe(other), describe(best)
    keys = [k for k in {**a, **b} if a.get(k) != b.get(k)]
    if not keys:
        return "the same options"

    def side(d: dict) -> str:
        return " ".join(f"{k}={d[k]}" for k in keys if k in d) or "-"

    return f"{side(a)} vs {side(b)}"


@dataclass(frozen=True)
class RunnerUp:
    """A candidate the model cannot tell from the best: its prediction, what it changes, the deciding term."""

    prediction: Prediction
    rank: int  # its place in the plan's predictions (0 is the best)
    differs: str
    term: str  # a key of TERM_NAMES, or "none" where every term is predicted the same
    term_seconds: tuple[float, float]  # the term's prediction for the runner-up, then for the best

    def sentence(self, best: Prediction) -> str:
        a, b = self.term_seconds
        if self.term == "none":
            return (f"{self.differs} ({self.prediction.step_time * 1e3:.1f} ms predicted for both): the model sees no"
                    " difference (no term of it depends on this option here); measure one step of each"
                    " (lightning-3d plan --verify)")
        return (f"{self.differs} ({self.prediction.step_time * 1e3:.1f} vs {best.step_time * 1e3:.1f} ms"
                f" predicted): {TERM_NAMES[self.term]} decides ({a * 1e3:.1f} vs {b * 1e3:.1f} ms); measure one step"
                " of each (lightning-3d plan --verify)")

    def to_dict(self, best: Prediction) -> dict:
        return {"rank": self.rank, "configuration": label(self.prediction.candidate), "differs": self.differs,
                "step_time_s": round(self.prediction.step_time, 6), "deciding_term": self.term,
                "term_s": [round(x, 6) for x in self.term_seconds], "measure": self.sentence(best)}


def runner_ups(predictions: list[Prediction], error: float) -> list[RunnerUp]:
    """The predictions whose step time is within ``error`` of the fastest predicted (``within_error``; the first
    unless a verification reordered them), each with the term that decides between it and that one."""
    finite = [k for k, p in enumerate(predictions) if math.isfinite(p.step_time)]
    if not finite:
        return []
    b = min(finite, key=lambda k: predictions[k].step_time)
    best = predictions[b]
    base = step_terms(best)
    out = []
    for rank, p in enumerate(predictions):
        if rank == b or not within_error(best.step_time, p.step_time, error):
            continue
        terms = step_terms(p)
        key = max(terms, key=lambda k: abs(terms[k] - base[k]))
        seconds = (terms[key], base[key])
        if abs(seconds[0] - seconds[1]) <= 1e-9 * max(best.step_time, 1e-12):  # the same prediction, term by term
            key = "none"
        out.append(RunnerUp(p, rank, differences(best.candidate, p.candidate), key, seconds))
    return out
