"""Time marks that never make the step wait on the device.

On a GPU a mark is a CUDA event recorded on the current stream; on a CPU it is a wall-clock
reading. Marks are turned into seconds only when read (`seconds`), which a GPU run does on
logging and profiled steps: reading waits for the later event, not for the device as a whole.
"""

import time

import torch


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        """Seconds from mark `start` to mark `end` (waits for `end` on a GPU)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start
