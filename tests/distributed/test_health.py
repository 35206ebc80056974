"""Stragglers and loss spikes, through the Trainer on gloo ranks.

- A rank slowed down (a sleep in its forward) is the slowest rank in the metrics and is named
  in a warning after --straggler-window logging steps.
- The loss-spike guard (pp=2: the loss lives on the last stage only) skips an injected spike on
  every rank and counts it; with --spike-rerun a spike the re-run reproduces stays skipped and
  one it does not is kept; with no spike the run is the guard-off run bit for bit.
"""

import json
import time

import pytest
import torch

from megalite.testing import spawn, tiny_config, tiny_trainer

pytestmark = pytest.mark.distributed


def _trainer(metrics=None, pp=1, iters=6, **training):
    cfg = tiny_config()
    t = cfg.training
    t.train_iters = iters
    cfg.optimizer.lr = 3e-3
    for k, v in training.items():
        setattr(t, k, v)
    cfg.parallel.pp = pp
    cfg.logging.metrics_file = metrics
    return tiny_trainer(cfg)


def _straggler(rank, world, metrics):
    tr = _trainer(metrics, iters=6, log_interval=1, straggler_threshold=1.2, straggler_window=3)
    if rank == 1:  # a slow device: every forward takes 6 times as long and 50 ms more (so
        # that a busy machine delaying rank 0 for a moment does not make it the slower one)
        chunk = tr.chunks[0]
        forward = chunk.forward

        def slow(*a, **kw):
            t0 = time.perf_counter()
            out = forward(*a, **kw)
            time.sleep(0.05 + 5 * (time.perf_counter() - t0))
            return out

        chunk.forward = slow
    lines = []
    tr.logger.print = lambda *a: lines.append(" ".join(map(str, a)))
    tr.train()
    return lines


def test_a_slow_rank_is_named(tmp_path):
    metrics = tmp_path / "m.jsonl"
    lines = spawn(_straggler, 2, str(metrics))[0]  # rank 0 logs
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 7))
    for r in rows:
        assert r["slowest_rank"] == 1 and r["slowest_ratio"] >= 1.2, r
        assert r["compute_s_min"] <= r["compute_s_median"] <= r["compute_s_max"]
    warnings = [x for x in lines if "straggler" in x]
    assert len(warnings) == 2, lines  # after logging steps 3 and 6: a full window each
    assert warnings[0].startswith("megalite: warning: rank 1 is a straggler"), warnings


def _params(tr):
    tr.opt.wait_params()
    return [p.detach().clone() for c in tr.chunks for p in c.parameters()]


def _spikes(rank, world):
    off = _trainer(pp=2, iters=14)
    off.train()
    quiet = _trainer(pp=2, iters=14, spike_threshold=10.0, spike_min_steps=5)
    quiet.train()
    same = all(torch.equal(a, b) for a, b in zip(_params(off), _params(quiet)))

    tr = _trainer(pp=2, iters=14, spike_threshold=10.0, spike_min_steps=5, spike_rerun=True)
    runs = {}  # iteration -> schedule runs so far (a re-run is the second)
    real_run = tr._forward_backward_update

    def counted(*args):
        runs[tr.iteration + 1] = runs.get(tr.iteration + 1, 0) + 1
        return real_run(*args)

    tr._forward_backward_update = counted
    for chunk in tr.chunks:
        if chunk.has_head:  # the last stage: rank 1
            forward = chunk.forward

            def spiking(x, labels=None, forward=forward):
                loss = forward(x, labels)
                it = tr.iteration + 1
                data_spike = it == 10  # every run of step 10: a bad batch
                transient = it == 12 and runs[it] == 1  # the first run of step 12 only
                return loss * 20 if data_spike or transient else loss

            chunk.forward = spiking
    lines, params = [], {}
    tr.logger.print = lambda *a: lines.append(" ".join(map(str, a)))
    step = tr.train_step

    def recorded(log=True):
        out = step(log)
        params[tr.iteration] = _params(tr)
        return out

    tr.train_step = recorded
    tr.train()
    unchanged = {
        it: all(torch.equal(a, b) for a, b in zip(params[it - 1], params[it]))
        for it in (10, 11, 12)
    }
    return same, quiet.skipped_total, tr.skipped_total, tr.spikes_total, unchanged, runs, lines


def test_loss_spikes_are_skipped_and_rerun():
    for rank, (same, quiet, skipped, spikes, unchanged, runs, lines) in enumerate(
        spawn(_spikes, 2)
    ):
        assert same and quiet == 0  # no spike: bit for bit the run without the guard
        assert skipped == spikes == 1, (skipped, spikes)  # step 10 only, on both ranks
        assert unchanged == {10: True, 11: False, 12: False}, unchanged
        assert runs[10] == runs[12] == 2 and runs[11] == 1, runs
        if rank == 0:
            text = "\n".join(lines)
            assert "at iteration 10 is above the spike limit" in text and "a data spike" in text
            assert "at iteration 12 is above the spike limit" in text
            assert "not reproducible, suspect a hardware fault; its step is kept" in text
