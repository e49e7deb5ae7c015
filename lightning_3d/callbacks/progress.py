"""The model summary and progress bar of a 3D-parallel run (whole-model parameter counts and FLOPs per token; "Epoch
N" without "v_num"). They live beside the strategy, which installs them in place of Lightning's defaults
(lightning_3d/strategies/run_output.py); here they are importable with the other callbacks, e.g. to pass your own
``ParallelModelSummary(max_depth=2)``."""

from lightning_3d.strategies.run_output import ParallelModelSummary, StepProgressBar, stage_parameter_counts, whole_model_counts

__all__ = ["ParallelModelSummary", "StepProgressBar", "stage_parameter_counts", "whole_model_counts"]
