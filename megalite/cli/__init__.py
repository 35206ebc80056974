"""The console commands (setup.py entry points) other than megalite-train (megalite/train.py, the
module `torchrun -m megalite.train` runs); tools/*.py and pretrain_gpt.py wrap them.

megalite-preprocess, megalite-convert, megalite-generate, megalite-plan, megalite-serve and
megalite-diagnose-hang (megalite/training/hang.py).
"""
