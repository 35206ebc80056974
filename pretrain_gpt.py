"""Entry point: config -> distributed init -> build -> train (megalite-train; megalite/train.py).

torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/tiny.yaml --tp 2 --pp 2
"""

from megalite.train import cli

if __name__ == "__main__":
    cli()
