"""--profile: a torch.profiler trace of a few steps, as Megatron-LM's --profile
--profile-step-start A --profile-step-end B asks: it starts when A steps are done and stops
when B are, on the ranks of --profile-ranks, each writing trace-rank<R>.json (Chrome trace
format: chrome://tracing, Perfetto) into --profile-dir (default --tensorboard-dir, else
profile/). Starting and stopping happen between steps: the step itself is unchanged."""

import os

import torch


class TorchProfile:
    def __init__(self, start: int, end: int, rank: int, out_dir: str, cuda: bool):
        self.start, self.end, self.rank, self.out_dir = start, end, rank, out_dir
        self.cuda = cuda
        self.prof = None
        self.path: str | None = None

    @classmethod
    def from_config(cls, cfg, rank: int, device) -> "TorchProfile | None":
        t = cfg.training
        if not t.profile or rank not in t.profile_ranks:
            return None
        out = t.profile_dir or cfg.logging.tensorboard_dir or "profile"
        cuda = torch.device(device).type == "cuda"
        return cls(t.profile_step_start, t.profile_step_end, rank, out, cuda)

    def before_step(self, done: int):
        """Call before each step, with the steps done so far."""
        if done == self.start and self.prof is None and self.start < self.end:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self.prof.start()

    def after_step(self, done: int) -> str | None:
        """Call after each step, with the steps done; the trace's path once written."""
        if self.prof is None or done < self.end:
            return None
        self.prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        self.path = os.path.join(self.out_dir, f"trace-rank{self.rank}.json")
        self.prof.export_chrome_trace(self.path)
        self.prof = None
        return self.path
