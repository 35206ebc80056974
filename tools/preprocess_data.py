"""tools/preprocess_data.py: the installed `megalite-preprocess` (its code: megalite/cli/preprocess.py)."""

from megalite.cli.preprocess import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
