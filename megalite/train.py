"""megalite-train: pretrain_gpt.py's command (config -> distributed init -> build -> train).

The console script `megalite-train`, and the module form torchrun needs:
torchrun --nproc_per_node 8 -m megalite.train --config configs/tiny.yaml --tp 2 --pp 2
(`megalite/training/` is the package that does the work; `megalite/cli/` the other commands.)
"""

import sys

from megalite.errors import run_main
from megalite.training.launch import main


def cli():
    """The console entry point megalite-train."""
    sys.exit(run_main(main))


if __name__ == "__main__":
    cli()
