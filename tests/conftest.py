import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU; it must be set before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread (and OMP_NUM_THREADS=1 for the processes tests start): the tests' tensors
# are tiny, and on a busy machine a second thread turns each op into a wait for a core (on a
# loaded 2-core machine tests/unit/test_model.py and two more files took 94 s at 2 threads, 12 s
# at 1).
THREADS = os.environ.get("MEGALITE_TEST_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", THREADS)
torch.set_num_threads(int(THREADS))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "full: a parity-sweep case whose code paths representative cases run too (make test "
        "leaves it out, make test-full runs it)",
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Ranks spawned by megalite.testing.spawn fork from one forkserver: preload there what the
    collected tests import (megalite, the test modules, this conftest), so that a rank starts
    without importing them again (2 to 4 s of CPU a rank, which a 2-core machine feels)."""
    from megalite import testing

    mods = sorted(m for m in sys.modules if m.partition(".")[0] in ("megalite", "tests"))
    testing.CONTEXT.set_forkserver_preload(["torch", "torch.distributed", *mods])
