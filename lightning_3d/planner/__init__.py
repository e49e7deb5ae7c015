"""The parallelism planner (Aceso-style): predicts step time and memory of a (dp, pp, tp) configuration from a cost
model (``lightning_3d.costs``), searches the configurations, and writes a config ``lightning-3d fit`` runs; and the
profiler that measures the cost model's profile on a GPU. ``plan(config, gpus)`` and ``profile_model(config)`` are the
Python API; ``lightning-3d plan`` and ``lightning-3d profile`` the commands. docs/planner.md explains the model, the
profile and the search.

The names below are the planner's public surface; code outside ``lightning_3d.planner`` (the CLI, benchmarks,
notebooks) uses only them. Its modules, by job: ``api`` (configs in and out, ``plan``), ``command``
(``lightning-3d plan``), ``workload`` (what is priced: candidates and per-layer costs), ``model`` (the performance
model), ``communication`` and ``context`` (its
collectives' and context parallelism's terms), ``search``; the profiler: ``profile`` (the command), ``layers`` (the
layers' grids), ``timing`` (measuring primitives), ``overheads`` and ``tiny_runs`` (the step's costs outside the
layers), ``multi_gpu`` (collectives and tensor-parallel layers across GPUs).
"""

from lightning_3d.planner.api import Plan, load_config, plan, workload_from_config
from lightning_3d.planner.command import plan_main
from lightning_3d.planner.model import Candidate, Prediction, Workload, layer_terms, predict, simulate_candidate
from lightning_3d.planner.multi_gpu import measure_collectives, measure_tp_layers, tp_degrees
from lightning_3d.planner.overheads import host_layers_in_situ, measure_overheads, step_seconds_at_depth
from lightning_3d.planner.profile import add_compiled, profile_main, profile_model
from lightning_3d.planner.search import SearchOptions, SearchResult, search
from lightning_3d.planner.tiny_runs import train_tiny

__all__ = [
    "Candidate", "Plan", "Prediction", "SearchOptions", "SearchResult", "Workload", "add_compiled", "host_layers_in_situ",
    "layer_terms", "load_config", "measure_collectives", "measure_overheads", "measure_tp_layers", "plan", "plan_main",
    "predict", "profile_main", "profile_model", "search", "simulate_candidate", "step_seconds_at_depth",
    "tp_degrees", "train_tiny", "workload_from_config",
]
