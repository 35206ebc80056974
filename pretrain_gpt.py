"""Entry point: config -> distributed init -> build -> train. No logic of its own.

torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/tiny.yaml --tp 2 --pp 2
"""

from megalite.errors import run_main
from megalite.training.launch import main

if __name__ == "__main__":
    run_main(main)
