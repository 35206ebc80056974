"""The one helper for multi-process tests: N gloo ranks on CPU, joined through a file:// store.

`spawn(fn, n, *args)` runs `fn(rank, n, *args)` in n processes with torch.distributed already
initialised, and returns the list of their return values. An exception on any rank fails the
caller with that rank's traceback; a rank that hangs past `timeout` fails it too (all ranks are
killed), so a stuck collective never hangs the suite.
"""

import os
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed"])


def _entry(rank, world_size, tmp, fn, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        with open(f"{tmp}/out.{rank}", "wb") as fh:
            torch.save(result, fh)  # read back with weights_only: no pickle code runs
        if dist.is_initialized():  # (unless fn tore it down itself)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(f"{tmp}/err.{rank}", "w") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)


def spawn(fn, world_size, *args, timeout=180):
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            _CTX.Process(target=_entry, args=(r, world_size, tmp, fn, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                break
            for r, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and failed is None:
                    failed = r
            if failed is not None:
                time.sleep(2)  # let the other ranks write their own errors first
                break
            time.sleep(0.05)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        errors = {
            r: open(f"{tmp}/err.{r}").read()
            for r in range(world_size)
            if os.path.exists(f"{tmp}/err.{r}")
        }
        if errors:
            # a crashed rank makes its peers fail with "connection closed": show the cause first
            secondary = ("Connection closed", "Connection reset", "Broken pipe")
            r = min(errors, key=lambda r: (any(m in errors[r] for m in secondary), r))
            raise AssertionError(f"rank {r} of {world_size} failed:\n{errors[r]}")
        if alive:
            raise TimeoutError(
                f"ranks {alive} of {world_size} still running after {timeout}s (hang?)"
            )
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks {bad} exited with {[procs[r].exitcode for r in bad]}")
        out = []
        for r in range(world_size):
            with open(f"{tmp}/out.{r}", "rb") as fh:
                out.append(torch.load(fh, weights_only=True))
        return out
