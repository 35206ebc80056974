"""Ahead-of-time check of every Triton kernel for sm_80 / sm_90a / sm_100a, without a GPU.

    python tools/check_kernels.py [--full] [--arch sm_80 sm_86 ...] [--write docs/kernels.md]

Compiles each kernel through the launches its launcher makes on that GPU, reads registers and
spills from ptxas, fails on a compile error or shared memory over the architecture's limit.
See megalite/kernels/aot.py.
"""

import sys

from megalite.kernels.aot import main

if __name__ == "__main__":
    sys.exit(main())
