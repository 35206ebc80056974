"""Typed configuration: nested dataclasses filled from defaults, then YAML, then CLI flags.

Every field carries its documentation (shown by `--help`) and its flag names: the field name
with dashes (`--micro-batch-size`) plus Megatron-LM's long names and short aliases.
`megalite/config_read.py` fills one from YAML, flags or a dict (this package is data only and
imports nothing of megalite but model_config); `megalite.shape.validate()` rejects impossible
combinations with one clear sentence before any process group exists and derives the run's
shape; nothing writes into a Config afterwards. The model's part (`ModelConfig`, the `FLAVOURS`
table) is megalite/model_config.py; the other sections are a module each: parallel.py,
optimizer.py, training.py, and files.py (data, checkpoint, logging: what a run reads and writes).
"""

import dataclasses
from dataclasses import dataclass, field

from megalite.config.files import CheckpointConfig, DataConfig, LoggingConfig
from megalite.config.optimizer import OptimizerConfig
from megalite.config.parallel import DEFAULT_ORDER, ParallelConfig
from megalite.config.training import TrainingConfig
from megalite.model_config import ModelConfig

__all__ = [
    "DEFAULT_ORDER",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "TrainingConfig",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
