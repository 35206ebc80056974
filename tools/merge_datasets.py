"""tools/merge_datasets.py: the installed `megalite-merge-datasets` (its code: megalite/cli/merge_datasets.py)."""

from megalite.cli.merge_datasets import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
