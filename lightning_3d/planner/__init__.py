"""The parallelism planner (Aceso-style): predicts step time and memory of a (dp, pp, tp) configuration from a cost
model (``lightning_3d.costs``), searches the configurations, and writes a config ``lightning-3d fit`` runs.
``plan(config, gpus)`` is the Python API; ``lightning-3d plan`` and ``lightning-3d profile`` the commands.
docs/planner.md explains the model and the search.
"""

from lightning_3d.planner.api import Plan, load_config, plan, workload_from_config
from lightning_3d.planner.model import Candidate, Prediction, Workload, predict, simulate_candidate
from lightning_3d.planner.search import SearchOptions, SearchResult, search

__all__ = [
    "Candidate", "Plan", "Prediction", "SearchOptions", "SearchResult", "Workload", "load_config", "plan", "predict",
    "search", "simulate_candidate", "workload_from_config",
]
