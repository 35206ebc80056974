"""tools/plan.py: the installed `megalite-plan` (its code: megalite/cli/plan.py)."""

from megalite.cli.plan import *  # noqa: F403  (its names, for scripts and tests that import them)

if __name__ == "__main__":
    cli()  # noqa: F405
