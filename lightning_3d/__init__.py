"""lightning_3d: 3D-parallel (data x pipeline x tensor) LLM training for PyTorch Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_3d.compression.config import CompressionConfig
from lightning_3d.distributed.parallel_dims import ParallelDims
from lightning_3d.pipeline.microbatch import MicroBatches
from lightning_3d.strategies.compressed_3d import Compressed3DStrategy
from lightning_3d.strategies.config import ParallelismConfig, PipelineConfig, RuntimeConfig
from lightning_3d.strategies.protocol import Parallel3DModule, StageLayout, read_on_host

if Compressed3DStrategy.strategy_name not in StrategyRegistry:
    Compressed3DStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CompressionConfig", "Compressed3DStrategy", "MicroBatches", "Parallel3DModule", "ParallelDims", "ParallelismConfig",
    "PipelineConfig", "RuntimeConfig", "StageLayout", "read_on_host",
]
__version__ = "0.1.0"
