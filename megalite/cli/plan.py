"""Plan a run before launching it: memory per GPU, bubble, traffic, and the layouts that fit.

    python tools/plan.py --config configs/tiny.yaml --gpus 8
    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --vocab-size 51200 --precision bf16 --mbs 1 --gbs 512 \\
        --recompute-granularity selective --gpus 64 --gpu-memory 80 --gpus-per-node 8

Model and training flags are pretrain_gpt.py's; the layout flags (--tp --pp --vpp, --zero-stage,
--sequence-parallel) describe the layout printed first (where it can run on --gpus; the search
does not depend on it). The search tries micro-batch sizes 1, 2, 4 and 8 for each layout
unless --micro-batch-size is given (on the command line or in --config's YAML): then only it.
The layouts that fit are ranked by an
estimated step time (--mfu, --peak-tflops, --intra-node-gbps, --inter-node-gbps set its
assumptions). Needs no GPU and no process group.
"""

import argparse
import sys

from megalite.config_read import parse_args
from megalite.errors import MegaliteError, run_main
from megalite.parallel.zero import ZERO
from megalite.plan.layouts import MICRO_BATCH_SIZES, check_model
from megalite.plan.ranking import Cluster
from megalite.shape import validate
from megalite.training.dry_run import print_plan


def main(argv):
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], add_help=False
    )
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU [80]")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node [8]")
    ap.add_argument("--top", type=int, default=10, help="layouts listed [10]")
    d = Cluster(1)
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=d.peak_tflops,
        help=f"dense peak per GPU at the training precision [{d.peak_tflops:g}]",
    )
    ap.add_argument(
        "--mfu",
        type=float,
        default=d.mfu,
        help=f"model FLOPs utilisation the compute reaches [{d.mfu:g}]",
    )
    ap.add_argument(
        "--intra-node-gbps",
        type=float,
        default=d.intra_node_gbps,
        help=f"bus bandwidth per GPU inside a node, GB/s [{d.intra_node_gbps:g}]",
    )
    ap.add_argument("--inter-node-gbps", type=float, default=d.inter_node_gbps,
                    help=f"bus bandwidth per GPU across nodes, GB/s [{d.inter_node_gbps:g}]")  # fmt: skip
    ap.add_argument("--search-zero-stages", type=lambda v: [int(x) for x in v.split(",")],
                    default=None, metavar="0,1,2",
                    help="the ZeRO stages the search tries [0,1,2]; 0 plans as Megatron-LM did "
                         "before its distributed optimizer")  # fmt: skip
    ns, rest = ap.parse_known_args(argv)
    numbers = (ns.gpus, ns.gpus_per_node, ns.gpu_memory, ns.peak_tflops, ns.mfu,
               ns.intra_node_gbps, ns.inter_node_gbps)  # fmt: skip
    if min(numbers) <= 0 or ns.mfu > 1:
        raise MegaliteError(
            "--gpus, --gpus-per-node, --gpu-memory, --peak-tflops and the bandwidths must be "
            "positive, and --mfu in (0, 1]"
        )
    given = set()
    cfg = parse_args(rest, given)
    check_model(cfg)  # what no layout fixes; the layout given (default: dp = all GPUs) may not run
    try:
        shape = validate(cfg, ns.gpus)
    except MegaliteError as e:
        shape = str(e)
    cluster = Cluster(ns.gpus, ns.gpu_memory, min(ns.gpus_per_node, ns.gpus), peak_tflops=ns.peak_tflops,
                      mfu=ns.mfu, intra_node_gbps=ns.intra_node_gbps,
                      inter_node_gbps=ns.inter_node_gbps)  # fmt: skip
    if any(z not in ZERO for z in ns.search_zero_stages or ()):
        raise MegaliteError(f"--search-zero-stages takes stages of {sorted(ZERO)}")
    sizes = None if "training.micro_batch_size" in given else MICRO_BATCH_SIZES
    print_plan(cfg, shape, cluster, top=ns.top, zero_stages=ns.search_zero_stages,
               micro_batch_sizes=sizes)  # fmt: skip


def cli():
    """The console entry point megalite-plan."""
    sys.exit(run_main(main))
