"""`python -m megalite.train` / `torchrun ... -m megalite.train`: megalite-train as a module."""

from megalite.cli.train import cli

if __name__ == "__main__":
    cli()
