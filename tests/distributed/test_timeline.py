"""The timeline of a real pp=2 run: every forward and backward of every micro-batch on each
rank, in the schedule's order, never overlapping; gathered to rank 0 as JSON and drawn."""

import json
import os
import time

import pytest
import torch

from megalite.config import Config, ModelConfig
from megalite.model.gpt import GPTChunk
from megalite.pipeline.actions import COMPUTE
from megalite.pipeline.executor import first_stage_times, idle_ratio, run_schedule
from megalite.pipeline.partition import rank_chunks
from megalite.pipeline.schedules import bubble_theory, get_schedule
from megalite.plan import traffic
from megalite.plan.layouts import layout
from megalite.testing import spawn
from megalite.training import timeline

L, H, S, V, B = 4, 16, 8, 40, 2
CASES = [("1f1b", 1, 4), ("interleaved", 2, 4)]  # schedule, vpp, micro-batches


def model():
    return ModelConfig(flavour="gpt2", num_layers=L, hidden_size=H, num_attention_heads=2,
                       seq_length=S, vocab_size=V, make_vocab_size_divisible_by=8)  # fmt: skip


def run(rank, world, out_dir):
    from megalite.parallel.groups import build_groups
    from megalite.parallel.topology import Topology

    groups = build_groups(Topology(pp=world), torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    out = []
    for name, vpp, m in CASES:
        batch = [(torch.randint(V, (B, S), generator=g), torch.randint(V, (B, S), generator=g))
                 for _ in range(m)]  # fmt: skip
        chunks = [GPTChunk(model(), **kw) for kw in rank_chunks(L, world, vpp, rank)]
        actions = get_schedule(name, world, vpp, m, rank)
        tl = timeline.Timeline((1, 3), rank, groups.topo.coords(rank), f"{out_dir}/{name}")
        results = []
        for it in (1, 2, 3):  # steps 1 and 2 are profiled, 3 is not
            groups.ledger.reset()
            result = run_schedule(actions, chunks, groups, batch, hidden_shape=(B, S, H),
                                  dtype=torch.float32, timeline=tl.at(it))  # fmt: skip
            if tl.at(it):
                t0 = time.perf_counter()
                tl.record("optimizer", t0, time.perf_counter())
            results.append(result)
            meta = {"title": f"pp={world} {name}", "bubble_theory": bubble_theory(world, vpp, m)}
            tl.step_done(it, groups, meta)
        cfg = Config()
        cfg.model, cfg.training.micro_batch_size, cfg.training.global_batch_size = model(), B, B * m
        expected_pp = traffic.comm_bytes(cfg, layout(cfg, pp=world, vpp=vpp), rank, m)["pp"]
        assert groups.ledger.bytes["pp"] == expected_pp, (name, groups.ledger.bytes["pp"])
        computes = [(a.kind.value, a.chunk, a.mb) for a in actions if a.kind in COMPUTE]
        bubbles = [idle_ratio(*first_stage_times([r], groups.pp)) for r in results[:2]]
        out.append((name, computes, bubbles))
    return out


def check_rank(spans, computes, steps=(1, 2)):
    for step in steps:
        mine = [s for s in spans if s["step"] == step]
        got = [("F" if s["kind"] == "forward" else "B", s["chunk"], s["mb"])
               for s in mine if s["kind"] in timeline.COMPUTE]  # fmt: skip
        assert got == computes  # every F and B once, in the schedule's order
        (schedule,) = [s for s in mine if s["kind"] == "schedule"]
        inner = sorted((s for s in mine if s["kind"] not in ("schedule", "optimizer")),
                       key=lambda s: s["start"])  # fmt: skip
        assert all(a["end"] <= b["start"] for a, b in zip(inner, inner[1:]))  # no overlap
        assert schedule["start"] <= inner[0]["start"] and inner[-1]["end"] <= schedule["end"]
        assert all(s["kind"] in timeline.P2P and s["ops"] for s in inner if "ops" in s)


@pytest.mark.distributed
def test_timeline_of_a_pp2_run(tmp_path):
    results = spawn(run, 2, str(tmp_path))
    for i, (name, _, _) in enumerate(results[0]):
        data = json.load(open(tmp_path / name / "timeline.json"))
        assert data["steps"] == [1, 3] and [r["rank"] for r in data["ranks"]] == [0, 1]
        for r in data["ranks"]:
            check_rank(r["spans"], results[r["rank"]][i][1])
        # the first stage's idle / compute over both steps, between the two steps' values (the
        # `first_stage_times` of one step, as the metrics file's bubble_measured over several)
        lo, hi = sorted(results[0][i][2])
        assert lo - 1e-9 <= timeline.measured_bubble(data) <= hi + 1e-9
        assert os.path.getsize(tmp_path / name / "timeline.png") > 10_000
