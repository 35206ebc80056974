"""Plan a run before launching it: memory per GPU, bubble, traffic, and the layouts that fit.

    python tools/plan.py --config configs/tiny.yaml --gpus 8
    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-attention-heads 96 \\
        --seq-length 2048 --vocab-size 51200 --precision bf16 --mbs 1 --gbs 512 \\
        --recompute-granularity selective --gpus 64 --gpu-memory 80 --gpus-per-node 8

Model and training flags are pretrain_gpt.py's (--help lists them), or the model of a Hugging
Face config.json (--hf-config DIR|config.json; model flags given override it). The layout flags
(--tp --pp --cp --vpp --ep, --zero-stage, --sequence-parallel, --tp-comm-overlap) describe the
layout planned first, exactly as given (where it can run on --gpus), and placed among the layouts
searched by its estimate (the search does not depend on it). The answer ends with the launch
line (torchrun ... pretrain_gpt.py and its flags) of the layout preferred: the fastest, or one
at most 3% slower with at least a tenth of the usable memory more to spare (the margin said). The search tries micro-batch sizes 1, 2, 4 and 8 for each layout
unless --micro-batch-size is given (on the command line or in --config's YAML): then only it;
and recompute none, selective and full unless --recompute-granularity is given.
The layouts that fit are ranked by an
estimated step time: each op timed by its shape on --gpu (plan/compute.py: GEMMs by size,
flash attention by sequence, the memory-bound ops by bytes; calibrated on Megatron-LM's published
throughput, docs/planner.md) or at a flat --mfu, the communication at --intra-node-gbps and
--inter-node-gbps. Needs no GPU and no process group.
"""

import argparse
import json
import os
import sys
from dataclasses import replace

from megalite.config_read import build_parser, parse_args
from megalite.errors import MegaliteError, run_main
from megalite.parallel.zero import ZERO
from megalite.plan.compute import GPUS
from megalite.plan.layouts import MICRO_BATCH_SIZES, RECOMPUTES, check_model
from megalite.plan.ranking import Cluster
from megalite.shape import validate
from megalite.training.dry_run import print_plan


def main(argv):
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__.split("\n")[0], add_help=False
    )
    ap.add_argument(
        "-h", "--help", action="store_true", help="this help, then pretrain_gpt.py's flags"
    )
    ap.add_argument("--gpus", type=int, help="GPUs in the cluster (required)")
    ap.add_argument("--hf-config", metavar="DIR|config.json",
                    help="the model from a Hugging Face config.json (or a directory holding one); "
                         "model flags given override its fields")  # fmt: skip
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU [80]")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node [8]")
    ap.add_argument("--top", type=int, default=10, help="layouts listed [10]")
    d = Cluster(1)
    ap.add_argument("--gpu", choices=sorted(GPUS), default=d.gpu,
                    help=f"the GPU whose peak, memory bandwidth and GEMM efficiency time each op "
                         f"(plan/compute.py) [{d.gpu}]")  # fmt: skip
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense peak per GPU at the training precision [--gpu's]")  # fmt: skip
    ap.add_argument("--mfu", type=float, default=None,
                    help="a flat model FLOPs utilisation instead of the time by shape [none]")  # fmt: skip
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
    if ns.help:
        print(ap.format_help())
        print("Model, batch, training and layout flags: pretrain_gpt.py's, as follows.\n")
        print(build_parser("tools/plan.py").format_help())
        return
    if ns.gpus is None:
        raise MegaliteError("--gpus is required: the GPUs in the cluster (tools/plan.py --help)")
    if ns.peak_tflops is None:
        ns.peak_tflops = GPUS[ns.gpu].peak_tflops
    numbers = (ns.gpus, ns.gpus_per_node, ns.gpu_memory, ns.peak_tflops, ns.mfu or 1,
               ns.intra_node_gbps, ns.inter_node_gbps)  # fmt: skip
    if min(numbers) <= 0 or (ns.mfu or 1) > 1:
        raise MegaliteError(
            "--gpus, --gpus-per-node, --gpu-memory, --peak-tflops and the bandwidths must be "
            "positive, and --mfu in (0, 1]"
        )
    given = set()
    cfg = parse_args(rest, given)
    if ns.hf_config:
        cfg = replace(cfg, model=hf_model(ns.hf_config, cfg.model, given))
    check_model(cfg)  # what no layout fixes; the layout given (default: dp = all GPUs) may not run
    try:
        shape = validate(cfg, ns.gpus)
    except MegaliteError as e:
        shape = str(e)
    cluster = Cluster(ns.gpus, ns.gpu_memory, min(ns.gpus_per_node, ns.gpus), peak_tflops=ns.peak_tflops,
                      mfu=ns.mfu, gpu=ns.gpu, intra_node_gbps=ns.intra_node_gbps,
                      inter_node_gbps=ns.inter_node_gbps)  # fmt: skip
    if any(z not in ZERO for z in ns.search_zero_stages or ()):
        raise MegaliteError(f"--search-zero-stages takes stages of {sorted(ZERO)}")
    sizes = None if "training.micro_batch_size" in given else MICRO_BATCH_SIZES
    recomputes = None if "training.recompute" in given else RECOMPUTES
    print_plan(cfg, shape, cluster, top=ns.top, zero_stages=ns.search_zero_stages,
               micro_batch_sizes=sizes, recomputes=recomputes)  # fmt: skip


def hf_model(path: str, flags, given: set):
    """The ModelConfig of a Hugging Face config.json (`path`, or a directory holding one:
    checkpoint/hf_config.py's mapping), with the model fields given as flags (`given`: the
    names parse_args set, "model.seq_length", ...) taken from `flags` instead."""
    from megalite.checkpoint.hf_config import model_config_from_hf

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise MegaliteError(f"--hf-config {path}: no such file (a config.json or its directory)")
    try:
        with open(file) as fh:
            hf = json.load(fh)
    except (OSError, ValueError) as e:
        raise MegaliteError(f"--hf-config {file} is not a readable JSON file: {e}") from None
    m = model_config_from_hf(hf)
    mine = {k.split(".", 1)[1] for k in given if k.startswith("model.")}
    return replace(m, **{k: getattr(flags, k) for k in mine})


def cli():
    """The console entry point megalite-plan."""
    sys.exit(run_main(main))
