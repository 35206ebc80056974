"""The run's shape: every value derived from the config and the world size, computed once.

`validate(cfg, world_size)` rejects impossible combinations with one clear sentence (before any
process group exists; nothing here imports torch, but for an FP8 run's check of its recipe and
device) and returns a frozen `RunShape`. Nothing is written into the user's config: code that
needs a derived value (dp, the schedule, the micro-batches per step, the padded vocabulary, ...)
reads the shape. The planner's layout search calls `derive` too, so a layout it proposes is one
`validate` accepts.

`run_shape.py` is the shape itself, `validation.py` derives and validates it (the layout, the
batch, the flags), `checks.py` holds the checks of one feature each (experts, latent attention,
multi-token prediction, FP8, the batch-size schedule).
"""

from megalite.shape.run_shape import RunShape
from megalite.shape.validation import derive, model_ranks, validate

__all__ = ["RunShape", "derive", "model_ranks", "validate"]
