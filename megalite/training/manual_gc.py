"""`--manual-gc`: Python's garbage collector on the same steps on every rank.

Left automatic, the collector runs whenever allocations cross its thresholds: at a different
moment on each rank, and a rank that pauses 0.1-1 s for a full collection in the middle of a step
stalls every rank waiting on its next collective (with thousands of ranks, every step has some
rank collecting). `--manual-gc` turns the automatic collector off for the run and collects on
the steps that are multiples of `--manual-gc-interval` (0: never between steps) and after every
evaluation, where all ranks collect together; Megatron's flags, torchtitan's `gc_freq`. Reference
cycles then live until the next collection: the step itself makes none (tensors are freed by
reference counting), so the interval bounds the garbage of logging, checkpointing and Python
glue, not of the model.
"""

import gc
import time
from contextlib import contextmanager


class ManualGC:
    def __init__(self, enabled: bool, interval: int = 0):
        self.enabled, self.interval = enabled, interval
        self.collections, self.seconds = 0, 0.0

    @contextmanager
    def running(self):
        """Automatic collection off for the duration (restored after), when enabled."""
        was = gc.isenabled()
        if self.enabled:
            gc.collect()  # start clean: what the build made
            gc.disable()
        try:
            yield self
        finally:
            if self.enabled and was:
                gc.enable()

    def after_step(self, iteration: int):
        if self.enabled and self.interval and iteration % self.interval == 0:
            self.collect()

    def collect(self):
        if self.enabled:
            t0 = time.perf_counter()
            gc.collect()
            self.collections += 1
            self.seconds += time.perf_counter() - t0
