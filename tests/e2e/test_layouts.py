"""Every layout gives the single-process loss curve (fp32, relative difference <= 1e-4 per step).

Each run is a torchrun of its own, and its cost is mostly starting its ranks; `make test` runs
the representative layouts, which between them take every code path of the others (FULL_ONLY
says where each moved one's paths are run), and `make test-full` all of them."""

import pytest

from tests.e2e.conftest import TINY, pretrain

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 20
LAYOUTS = {
    "tp2": (2, ["--tp", "2"]),
    "tp2-sp-overlap": (2, ["--tp", "2", "--sequence-parallel", "--tp-comm-overlap"]),
    "pp2-vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "tp2-pp2": (4, ["--tp", "2", "--pp", "2"]),
    "tp2-pp2-dp2-vpp2-zero1": (8, ["--tp", "2", "--pp", "2", "--vpp", "2", "--zero-stage", "1"]),
    # zero-bubble schedules: the backward split in I and W
    "pp2-zbv": (2, ["--pp", "2", "--vpp", "2", "--pp-schedule", "zbv"]),
    "tp2-pp2-dp2-zbh1": (8, ["--tp", "2", "--pp", "2", "--pp-schedule", "zb-h1"]),
    # uneven stages: 1 | 3 layers; a V whose first stage holds the embedding alone (0 layers)
    "pp2-first1": (2, ["--pp", "2", "--decoder-first-pipeline-num-layers", "1"]),
    "pp2-zbv-layout": (
        2,
        ["--pp", "2", "--vpp", "2", "--pp-schedule", "zbv", "--pp-layout", "E|tt|t|tL"],
    ),
    # flags whose arithmetic is that of one process too
    "dp2-zero2-recompute-selective": (2, ["--zero-stage", "2", "--recompute", "selective"]),
    "pp2-gpipe-recompute-full": (2, ["--pp", "2", "--pp-schedule", "gpipe", "--recompute", "full"]),
    "tp2-pp2-order-pp-tp-dp": (4, ["--tp", "2", "--pp", "2", "--order", "pp-tp-dp"]),
    # ZeRO-3: parameters sharded, gathered layer by layer (kept for the step under pp)
    "dp2-zero3-recompute-full": (2, ["--zero-stage", "3", "--recompute", "full"]),
    "dp2-tp2-zero3-sp": (4, ["--tp", "2", "--sequence-parallel", "--zero-stage", "3"]),
    "dp2-pp2-zero3": (4, ["--pp", "2", "--zero-stage", "3"]),
    # hybrid sharding: dp=4 as 2 copies of a shard group of 2 (reduce-scatter inside, all-reduce
    # of each shard over the copies)
    "dp4-r2-zero1": (4, ["--dp-replicate", "2", "--zero-stage", "1"]),
    "dp4-r2-tp2-zero3": (8, ["--tp", "2", "--dp-replicate", "2", "--zero-stage", "3"]),
    # context parallelism: each sequence split over cp ranks (ring, or all-to-all)
    "cp2": (2, ["--cp", "2"]),
    "cp2-tp2-sp": (4, ["--cp", "2", "--tp", "2", "--sequence-parallel"]),
    "cp2-pp2-a2a": (4, ["--cp", "2", "--pp", "2", "--cp-comm-type", "a2a"]),
    "cp2-tp2-pp2": (8, ["--cp", "2", "--tp", "2", "--pp", "2"]),
}
# Layouts whose every piece another layout runs too (marked `full`: make test-full only).
FULL_ONLY = {
    "tp2": "tp2-pp2-order-pp-tp-dp (tp without sp)",
    "tp2-sp": "dp2-tp2-zero3-sp, cp2-tp2-sp",
    "tp2-pp2": "tp2-pp2-order-pp-tp-dp (the same, ranks ordered otherwise)",
    "pp2-zbv": "pp2-zbv-layout (the V schedule, its stages laid out by hand)",
    "cp2": "cp2-tp2-sp (the ring), test_document_layout_matches_one_process[cp2-tp2-pp2]",
    "cp2-tp2-pp2": "test_document_layout_matches_one_process[cp2-tp2-pp2] (with documents)",
}
# Packed documents: positions restart, attention stays inside a document, no loss on EOD tokens;
# compared with one process given the same flags.
DOCUMENTS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
HIERARCHICAL = ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes"]  # A P
DOCUMENT_LAYOUTS = {
    "cp2-tp2-pp2": (8, ["--cp", "2", "--tp", "2", "--pp", "2"]),
    "cp2-pp2-dp2": (8, ["--cp", "2", "--pp", "2", "--zero-stage", "1"]),
    # hierarchical: all-to-all over adjacent cp pairs, the ring across the two pairs
    "cp4-a2a2xp2p2": (4, ["--cp", "4", *HIERARCHICAL, "2", "2"]),
}


@pytest.fixture(scope="module")
def baseline(one_process_curve):
    losses = one_process_curve  # STEPS steps (conftest)
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5  # it learns
    return losses


@pytest.fixture(scope="module")
def document_baseline(tiny_data, tmp_path_factory, baseline):
    prefix, model = tiny_data
    rows, _ = pretrain(1, [*TINY, "--data-path", prefix, "--tokenizer-model", model, "--train-iters", str(STEPS),
                           *DOCUMENTS], tmp_path_factory.mktemp("documents"))  # fmt: skip
    losses = [r["loss"] for r in rows]
    assert len(losses) == STEPS and losses != baseline  # the flags change what is learnt
    return losses


@pytest.mark.parametrize("layout", list(DOCUMENT_LAYOUTS))
def test_document_layout_matches_one_process(layout, document_baseline, tiny_data, tmp_path):
    nproc, flags = DOCUMENT_LAYOUTS[layout]
    test_layout_matches_one_process(layout, document_baseline, tiny_data, tmp_path,
                                    (nproc, [*flags, *DOCUMENTS]))  # fmt: skip


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=pytest.mark.full) if k in FULL_ONLY else k for k in LAYOUTS]
)
def test_layout_matches_one_process(layout, baseline, tiny_data, tmp_path, given=None):
    prefix, model = tiny_data
    nproc, flags = given or LAYOUTS[layout]
    args = [
        *TINY,
        "--data-path",
        prefix,
        "--tokenizer-model",
        model,
        "--train-iters",
        str(STEPS),
        *flags,
    ]
    rows, _ = pretrain(nproc, args, tmp_path)
    losses = [r["loss"] for r in rows]
    assert len(losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, baseline), 1):
        assert abs(a - b) <= 1e-4 * abs(b), f"{layout} step {step}: {a} vs one process {b}"
