"""megalite-run: torchrun whose exit status is the truth when a scheduler stops the job.

    srun megalite-run --nnodes $SLURM_NNODES --nproc_per_node 8 ... pretrain_gpt.py ...
    python -m megalite.cli.run --standalone --nproc_per_node 2 pretrain_gpt.py ...

It takes torchrun's arguments and runs torchrun's agent unchanged, except at one point: on
SIGTERM (SLURM's `--signal=TERM@T`, a preemption, `scancel`) torchrun forwards the signal to its
workers, waits for them, then raises `SignalException` and exits 1 even when every worker saved
and exited 0, so `sbatch --dependency=afterok` never fires. Here, when the launcher was signalled
and every worker of this node then exited 0 (megalite's workers save and stop after the current
step on SIGTERM), the launcher exits 0 with one line; a worker that died, was killed or failed
keeps the non-zero exit (128 + the signal).

Workers get up to `--shutdown-timeout` seconds to save before torchrun kills them; torchrun's
default is 30 s, here it is 300 s unless the flag or TORCH_ELASTIC_SHUTDOWN_TIMEOUT says
otherwise (a save of a large model to shared storage takes longer than 30 s).
"""

import os
import signal
import sys

SHUTDOWN_TIMEOUT_S = 300


class _Exits:
    """The exit codes of the workers torchrun's agent shut down after a signal (None: it shut
    down none)."""

    codes: list[int | None] | None = None


def _record_exits():
    """Wrap the local agent's shutdown so the workers' exit codes are kept once they are down."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    shutdown = LocalElasticAgent._shutdown

    def recorded(self, *args, **kwargs):
        pcontext = self._pcontext
        shutdown(self, *args, **kwargs)
        handlers = getattr(pcontext, "subprocess_handlers", None)
        if handlers:
            _Exits.codes = [h.proc.poll() for h in handlers.values()]

    LocalElasticAgent._shutdown = recorded


def main(argv: list[str]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if not any(a.split("=")[0] in ("--shutdown-timeout", "--shutdown_timeout") for a in argv):
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    _record_exits()
    try:
        run.main(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        codes = _Exits.codes
        if codes and all(c == 0 for c in codes):
            print(
                f"megalite-run: {name}: all {len(codes)} workers of this node stopped cleanly "
                "(saved) and exited 0; exiting 0",
                file=sys.stderr,
                flush=True,
            )
            return 0
        print(
            f"megalite-run: {name}: the workers of this node exited with {codes}; exiting "
            f"{128 + int(e.sigval)}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(e.sigval)
    return 0


def cli():
    """The console entry point megalite-run."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
