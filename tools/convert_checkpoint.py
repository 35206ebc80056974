"""tools/convert_checkpoint.py: the installed `megalite-convert` (its code: megalite/cli/convert.py)."""

from megalite.cli.convert import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
