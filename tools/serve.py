"""tools/serve.py: the installed `megalite-serve` (its code: megalite/cli/serve.py)."""

from megalite.cli.serve import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
