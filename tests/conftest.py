import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("MEGALITE_TEST_THREADS", "2")))


def _import_hub_kernels():
    """transformers (5.x) imports the PyPI package `kernels` when it is installed (it depends on
    it); with the repository root on sys.path (`python -m pytest`, rootdir insertion) the root's
    kernels/ directory (megalite.kernels' sources) would be found first. Import the installed
    one while the root is off the path, so every later `import kernels` gets it."""
    root = Path(__file__).resolve().parents[1]
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != root]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # not installed: transformers does without it
    finally:
        sys.path[:] = saved


_import_hub_kernels()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
