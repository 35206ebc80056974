"""The console commands (setup.py entry points); tools/*.py and pretrain_gpt.py wrap them.

megalite-train (also `python -m megalite.train`, `torchrun ... -m megalite.train`),
megalite-preprocess, megalite-convert, megalite-generate, megalite-plan, megalite-serve and
megalite-diagnose-hang (megalite/training/hang.py).
"""
