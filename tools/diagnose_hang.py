"""tools/diagnose_hang.py DIR: the rank a hung run waited on (megalite-diagnose-hang)."""

from megalite.training.hang import *  # noqa: F403

if __name__ == "__main__":
    cli()  # noqa: F405
