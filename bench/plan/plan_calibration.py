"""The planner's time model against published throughput: every row of megalite/plan/published.py
(CALIBRATION, the rows the constants of plan/compute.py were fitted on, and HELD_OUT, which they
were not) planned at its published layout, its estimated per-GPU TFLOP/s beside the published,
and where the published (tp, cp, pp) ranks among the layouts searched. Pure arithmetic (no GPU).

    .venv/bin/python bench/plan/plan_calibration.py [--fit] [--only NAME]

--fit: also the least-squares fit (relative error) of two scales on the calibration rows: one
for the compute-bound time (GEMMs and attention) and one for the memory-bound ops; plan/compute.py's
SUSTAINED, ATTENTION* and MEMORY_TRAFFIC were divided by them (docs/planner.md, "Calibration").
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.plan import compute, published  # noqa: E402
from megalite.plan.ranking import step_parts  # noqa: E402
from megalite.training.flops import hardware_flops_per_token, model_flops_per_token  # noqa: E402


def flops(row) -> tuple[float, float]:
    """(hardware FLOPs per token, the FLOPs per token as the row's source counts them)."""
    m = published.config(row).model
    hw = hardware_flops_per_token(m, row.recompute)
    return hw, hw if row.counts == "hardware" else model_flops_per_token(m)


def rank_of(row, plans) -> int | None:
    seen = []
    for p in plans:
        key = (p.layout.tp, p.layout.cp, p.layout.pp)
        if key not in seen:
            seen.append(key)
    key = (row.tp, row.cp, row.pp)
    return seen.index(key) + 1 if key in seen else None


def split_times(row, p):
    """(compute-bound seconds, memory-bound seconds, the rest) of the plan's step."""
    cfg = published.config(row)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, micro_batch_size=p.layout.micro_batch_size))  # fmt: skip
    cluster = published.cluster(row)
    parts = step_parts(cfg, p, cluster, hardware_flops_per_token(cfg.model, row.recompute))
    gpu, peak = compute.GPUS[cluster.gpu], cluster.peak_tflops * 1e12
    layers = cfg.model.num_layers
    one = compute.layer_seconds(cfg, p.layout, False, gpu, peak)
    head = compute.head_seconds(cfg, p.layout, gpu, peak)
    scale = (parts["compute"] + parts["bubble"]) / (layers * sum(one.values()) + head)
    bound = (layers * (one["gemm"] + one["attention"]) + head) * scale
    memory = layers * one["memory"] * scale
    rest = sum(parts.values()) - parts["compute"] - parts["bubble"]
    target = flops(row)[1] * row.batch * row.seq / row.gpus / row.tflops / 1e12
    return bound, memory, rest, target


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    fit = []
    for title, rows in (("calibration", published.CALIBRATION), ("held out", published.HELD_OUT)):
        print(f"\n{title}:\n")
        print("| run | GPUs | layout (tp cp pp) | published TFLOP/s | estimated | error | rank |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            if args.only and args.only not in row.name:
                continue
            p, tflops, plans = published.estimate(row, *flops(row))
            layout = f"{row.tp} {row.cp} {row.pp}"
            if p is None:
                print(f"| {row.name} | {row.gpus} | {layout} | {row.tflops:g} | does not fit | | |")
                continue
            print(f"| {row.name} | {row.gpus:,} | {layout} | {row.tflops:g} | {tflops:.0f} | "
                  f"{tflops / row.tflops - 1:+.1%} | {rank_of(row, plans)} |", flush=True)  # fmt: skip
            if args.fit and title == "calibration":
                fit.append(split_times(row, p))
    if fit:
        import numpy as np

        a = np.array([[b / t, m / t] for b, m, r, t in fit])
        y = np.array([1 - r / t for b, m, r, t in fit])
        x, *_ = np.linalg.lstsq(a, y, rcond=None)
        print(f"\nfit: compute-bound x{x[0]:.3f}, memory-bound x{x[1]:.3f}; "
              f"residuals {np.round(a @ x / y - 1, 3).tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
