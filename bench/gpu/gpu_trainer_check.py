"""The trainer on one GPU: host syncs per step, and tp/pp/dp ranks sharing the GPU over gloo.

    python bench/gpu/gpu_trainer_check.py syncs [--device cuda] [--steps 5] [--out DIR]
    python bench/gpu/gpu_trainer_check.py multirank [--device cuda] [--steps 3] [--out DIR]

Run by bench/gpu_check.sh on a lent GPU; both also run on CPU (`--device cpu`, what
`make bench` does) so the code does not rot between GPU loans.

syncs: one process, a tiny llama model (synthetic tokens, bf16 on a GPU), `Trainer.train_step`.
After warm-up steps, --steps non-logging steps run under `torch.cuda.set_sync_debug_mode("warn")`
and every "synchronizing CUDA operation" warning is counted, with the line of megalite that
issued it; then one logging step likewise. Reported: syncs per non-logging step (the design
says one: the optimizer's status read; more in any step fails the check) and the step time.
On CPU, where CUDA's debug mode does not exist, megalite/testing.py's host-sync counter stands
in (it sees reads of device values, not blocking host-to-device copies).

multirank: NCCL refuses two ranks on one device, so the ranks of each layout (tp2, pp2, dp2
with ZeRO-1) share the one GPU over gloo with CUDA tensors, and train a few steps of a tiny
model end to end through `Trainer`; the losses must equal a one-rank run's on the same GPU
(same data whatever the layout). megalite picks NCCL whenever CUDA is available
(parallel/groups.py init_distributed), so this check creates the gloo process group itself
before building the groups and the trainer (init_distributed then keeps it). Gloo with CUDA
tensors is `_gloo_cuda.py`: first each collective is probed with CUDA tensors (send/recv in
processes of their own, under a timeout, as they may crash), and the pipeline's p2p batches are
staged through host memory by a test-only wrapper around `torch.distributed.batch_isend_irecv`
(`stage_p2p_through_host`), the one path gloo refuses.

Results: printed, and written as JSON to --out (syncs.json, multirank.json).
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from types import SimpleNamespace

import numpy as np
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench._common import timed  # noqa: E402
from bench.gpu._gloo_cuda import init_gloo, probe, stage_p2p_through_host  # noqa: E402

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2-zero1": dict(zero=1)}


# ---- the trainer on synthetic data ------------------------------------------------------------


def make_trainer(device, world, tp=1, pp=1, zero=0, kernels="torch", precision="fp32",
                 layers=4, hidden=64, seq=32, vocab=256, gbs=8, mbs=1):  # fmt: skip
    """A Trainer over the groups of this process (gloo world already initialised)."""
    from megalite.config import Config
    from megalite.parallel.groups import build_groups
    from megalite.pipeline.partition import end_stages
    from megalite.shape import validate
    from megalite.training.trainer import Trainer

    cfg = Config()
    m, t, p = cfg.model, cfg.training, cfg.parallel
    m.flavour, m.num_layers, m.hidden_size, m.num_attention_heads = "llama", layers, hidden, 4
    m.seq_length, m.vocab_size = seq, vocab
    t.micro_batch_size, t.global_batch_size, t.precision, t.kernels = mbs, gbs, precision, kernels
    p.tp, p.pp = tp, pp
    cfg.optimizer.zero_stage = zero
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, world)
    stages = end_stages(shape.pp, shape.vpp, shape.placement)
    groups = build_groups(shape.topology(), device, embed_stages=stages)
    tokens = np.random.default_rng(0).integers(0, vocab, (16 * gbs, seq + 1))
    data = SimpleNamespace(train=tokens, valid=None, tokenizer=None)
    return Trainer(cfg, shape, groups, data=data)


# ---- host syncs per step ----------------------------------------------------------------------


def _syncs_cuda(trainer, steps):
    """(warnings per non-logging step, the lines that issued them, the logging step's count,
    seconds per non-logging step)."""
    where = {}
    counts = []

    def run(log):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(log=log)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        hits = [w for w in caught if "synchroniz" in str(w.message)]
        for w in hits:
            key = f"{os.path.relpath(w.filename)}:{w.lineno}"
            where[key] = where.get(key, 0) + 1
        return len(hits)

    for _ in range(steps):
        counts.append(run(False))
    logging_step = run(True)
    with timed("cuda") as t:
        for _ in range(steps):
            trainer.train_step(log=False)
    return counts, where, logging_step, t.wall / steps


def _syncs_cpu(trainer, steps):
    from megalite.testing import HostSyncCounter

    counts, where = [], {}

    def run(log):
        c = HostSyncCounter()
        with c.counting():
            trainer.train_step(log=log)
        for what, stack in c.where:
            line = [s for s in stack.splitlines() if "megalite" in s][-1:] or [what]
            where[line[0].strip()] = where.get(line[0].strip(), 0) + 1
        return c.count

    for _ in range(steps):
        counts.append(run(False))
    logging_step = run(True)
    with timed() as t:
        for _ in range(steps):
            trainer.train_step(log=False)
    return counts, where, logging_step, t.wall / steps


SYNCS_PER_STEP = 1  # the design's one: the optimizer's status read


def syncs_ok(counts: list[int], limit: int = SYNCS_PER_STEP) -> bool:
    """The judgement: every non-logging step measured, none with more than `limit` host syncs."""
    return bool(counts) and max(counts) <= limit


def syncs(a) -> dict:
    from megalite.parallel import groups as pg

    device = torch.device(a.device)
    os.environ.pop("MASTER_ADDR", None)  # a world of one: init_distributed uses a HashStore
    pg.init_distributed()
    cuda = device.type == "cuda"
    # on a GPU a small but real step; on CPU (a smoke test of this code) a tiny one
    size = dict(layers=4, hidden=256, seq=256, vocab=2048, gbs=16, mbs=4) if cuda else {}
    trainer = make_trainer(device, 1, kernels="auto", precision="bf16" if cuda else "fp32", **size)
    model = (
        "llama 4 x 256, s 256, 4 micro-batches of 4, bf16" if cuda else "llama 4 x 64, s 32, fp32"
    )
    for _ in range(2):  # warm-up (kernel compilation, allocator)
        trainer.train_step(log=True)
    counts, where, logging_step, step_s = (_syncs_cuda if cuda else _syncs_cpu)(trainer, a.steps)
    out = {
        "device": str(device) + ("" if not cuda else f" ({torch.cuda.get_device_name()})"),
        "how": "torch.cuda.set_sync_debug_mode('warn')"
        if cuda
        else "megalite/testing.py host-sync counter",
        "model": model,
        "syncs_per_step": counts,
        "logging_step_syncs": logging_step,
        "where": where,
        "step_s": step_s,
        "ok": syncs_ok(counts),
    }
    print(f"host syncs per non-logging step ({out['how']}): {counts} (design: at most "
          f"{SYNCS_PER_STEP}); "
          f"logging step: {logging_step}; step time {step_s * 1e3:.1f} ms; {out['model']}")  # fmt: skip
    for line, n in sorted(where.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {line}")
    pg.destroy()
    return out


def _layout(rank, world, tmp, device_name, layout, steps, queue):
    device = torch.device(device_name)
    try:
        init_gloo(rank, world, tmp, device)
        if device.type == "cuda" or os.environ.get("MEGALITE_CHECK_STAGE_P2P"):
            stage_p2p_through_host(force=device.type != "cuda")
        trainer = make_trainer(device, world, **LAYOUTS.get(layout, {}))
        losses = []
        with timed(device) as t:  # (the device drained before the clock starts, too)
            for _ in range(steps):
                losses.append(trainer.train_step(log=True)["loss"])
        queue.put((rank, {"losses": losses, "s_per_step": t.wall / steps}))
        from megalite.parallel import groups as pg

        pg.destroy(barrier=True)
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()[-2000:]}))
        raise


def _spawn(fn, world, args, timeout) -> dict:
    """Run fn(rank, world, tmp, *args, queue) in `world` processes; {rank: result} or an error."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=fn, args=(r, world, tmp, *args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < world and time.monotonic() < deadline:
            try:
                r, res = queue.get(timeout=1)
                got[r] = res
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
        for p in procs:
            p.join(timeout=max(1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
    if len(got) < world:
        return {"error": f"ranks {sorted(set(range(world)) - set(got))} gave no result within "
                         f"{timeout} s (exit codes {codes}): crashed or hung", **got}  # fmt: skip
    return got


def multirank(a) -> dict:
    out = {"device": a.device, "backend": "gloo", "probes": {}, "layouts": {}}
    safe = ["all_reduce", "all_gather_single", "reduce_scatter_single", "broadcast"]
    res = _spawn(probe, 2, (a.device, safe), a.timeout)
    out["probes"] = res.get(0, res)
    res = _spawn(probe, 2, (a.device, ["send/recv"]), min(a.timeout, 30))
    out["probes"]["send/recv (raw)"] = (res.get(0) or {}).get("send/recv") or res.get("error")
    print(
        f"gloo with {a.device} tensors: " + "; ".join(f"{k} {v}" for k, v in out["probes"].items())
    )
    print("  (the layouts below stage p2p through host memory on CUDA: stage_p2p_through_host)")
    ref = _spawn(_layout, 1, (a.device, "reference", a.steps), a.timeout)
    out["layouts"]["one rank"] = ref.get(0, ref)
    ok = "losses" in out["layouts"]["one rank"]
    for name in a.layouts:
        res = _spawn(_layout, 2, (a.device, name, a.steps), a.timeout)
        r = res.get(0, res)
        if "losses" in r and ok:
            want = out["layouts"]["one rank"]["losses"]
            r["max_rel_diff_vs_one_rank"] = max(
                abs(x - y) / abs(y) for x, y in zip(r["losses"], want)
            )
            r["agrees"] = r["max_rel_diff_vs_one_rank"] < 1e-4
        out["layouts"][name] = r
        ok = ok and r.get("agrees", False)
    for name, r in out["layouts"].items():
        if "losses" in r:
            extra = "" if "agrees" not in r else (
                f"; vs one rank: max rel diff {r['max_rel_diff_vs_one_rank']:.1e} "
                f"({'agrees' if r['agrees'] else 'DIFFERS'})")  # fmt: skip
            print(f"  {name}: {a.steps} steps, losses {[round(x, 5) for x in r['losses']]}, "
                  f"{r['s_per_step'] * 1e3:.0f} ms/step{extra}")  # fmt: skip
        else:
            print(f"  {name}: FAILED {r.get('error', r)}")
    out["ok"] = ok
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("syncs", "multirank"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="5 for syncs, 3 for multirank")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--timeout", type=float, default=120, help="seconds per group of processes")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.device == "cuda":  # torch.cuda.set_device refuses a device without an index
        a.device = "cuda:0"
    os.makedirs(a.out, exist_ok=True)
    if a.what == "syncs":
        a.steps = a.steps or 5
        res = syncs(a)
        ok = res["ok"]
    else:
        a.steps = a.steps or 3
        res = multirank(a)
        ok = res["ok"]
    with open(os.path.join(a.out, f"{a.what}.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"{a.what}: {'ok' if ok else 'FAILED'} ({os.path.join(a.out, a.what + '.json')})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
