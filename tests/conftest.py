import os
import sys

import pytest
import torch


def _import_pypi_kernels():
    """transformers (5.25+) imports the PyPI package `kernels`, which the repository's own
    kernels/ directory (installed as megalite.kernels) shadows while the repository root is on
    sys.path, as it is under pytest: import the installed one first, from site-packages."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    hidden = [p for p in sys.path if os.path.abspath(p or ".") == root]
    sys.path[:] = [p for p in sys.path if p not in hidden]
    try:
        import kernels  # noqa: F401
    except ImportError:  # transformers without it: nothing is shadowed
        pass
    finally:
        sys.path[:0] = hidden


_import_pypi_kernels()

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("MEGALITE_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
