"""tools/generate.py: the installed `megalite-generate` (its code: megalite/cli/generate.py)."""

from megalite.cli.generate import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
