"""A Megatron-LM checkpoint --loaded directly, and a run's saves going back to Megatron.

megatron-core saves a Llama-style GPTModel at tp=2 (tests/megatron_oracle.py: legacy with its
optimizer state, and torch_dist) at iteration 7 with 56 consumed samples. `pretrain_gpt.py
--load` of the legacy directory continues at iteration 8 with exactly the losses of a run
that loads `megalite-convert --from megatron --keep-position`'s output (the same weights,
iteration, data position and LR schedule position -- Megatron's scheduler's num_steps, the lr
of each step checked against megatron-core's scheduler; a fresh optimizer, said in one line); the torch_dist directory,
loaded at pp=2 under torchrun, gives the same losses. The runs save with `--ckpt-format
torch_dist` and `--ckpt-format torch` (legacy, at the run's pp=2): megatron-core loads each
--save directory (the tracker and the iteration directory megalite's files share) with the
logits of megalite's own checkpoint there, and megatron-core's scheduler loads the saved
scheduler state at the lr megalite continues with.
"""

import pytest
import torch

from megalite.lr_schedule import LRSchedule
from tests import megatron_oracle as mo
from tests import megatron_oracle_files as mf
from tests.e2e.conftest import pretrain
from tests.unit import test_megatron_schedule as sched

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]

# (--lr-decay-iters 30: the decay is still under way at iterations 8-10)
TRAIN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "3e-3",
         "--lr-warmup-iters", "1", "--eval-interval", "0", "--log-interval", "1",
         "--wandb-mode", "disabled", "--train-iters", "10", "--lr-decay-iters", "30"]  # fmt: skip


def test_load_megatron_directly_and_save_back(tiny_data, tmp_path):
    from megalite.cli import convert

    arch, layout = mo.LLAMA, mo.Layout(tp=2)
    x = mo.tokens(arch)
    mt = tmp_path / "mt"
    mo.run(mo.save_ranks, [(arch, layout, str(mt), x, 0)])
    convert.main([str(mt / "legacy"), str(tmp_path / "ml"), "--to", "megalite",
                  "--keep-position"])  # fmt: skip
    prefix, model = tiny_data
    data = ["--data-path", prefix, "--tokenizer-model", model]
    converted, _ = pretrain(1, [*TRAIN, *data, "--load", str(tmp_path / "ml")], tmp_path)
    save = ["--save", str(tmp_path / "run"), "--ckpt-format", "torch_dist"]
    direct, r = pretrain(1, [*TRAIN, *data, "--load", str(mt / "legacy"), *save], tmp_path)
    assert "Megatron optimizer state is not mapped" in r.stdout + r.stderr
    assert [m["iteration"] for m in direct] == [m["iteration"] for m in converted] == [8, 9, 10]
    assert [m["loss"] for m in direct] == [m["loss"] for m in converted]  # exactly
    # the LR schedule continues at Megatron's own position (its scheduler's num_steps, one
    # skipped step behind the consumed samples): megatron-core's scheduler built from the run's
    # flags, stepped there, gives every step's lr
    cfg = sched.config({"train_iters": 10, "global_batch_size": 4, "micro_batch_size": 1},
                       {"lr": 3e-3, "lr_warmup_iters": 1, "lr_decay_iters": 30})  # fmt: skip
    groups = [{}]
    ref = sched.megatron_scheduler(sched.Args(cfg), groups)
    ref.step(increment=mf.SCHEDULE_SAMPLES)
    for m in direct:
        assert m["lr"] == groups[0]["lr"], m["iteration"]
        ref.step(increment=4)
    assert direct[0]["lr"] != LRSchedule.from_config(cfg).rates(56).lr  # not the consumed samples
    assert [m["lr"] for m in converted] == [m["lr"] for m in direct]
    legacy = ["--save", str(tmp_path / "run2"), "--ckpt-format", "torch"]
    args = [*TRAIN, *data, "--load", str(mt / "torch_dist"), "--pp", "2", *legacy]
    dist, _ = pretrain(2, args, tmp_path)
    assert [m["iteration"] for m in dist] == [8, 9, 10]
    assert [m["loss"] for m in dist] == pytest.approx([m["loss"] for m in converted], rel=1e-4)

    # the --save directories, as Megatron-LM loads them: torch_dist (padded for tp=1), and
    # legacy (--ckpt-format torch) at the run's layout, pp=2
    jobs = [(arch, mo.Layout(), str(tmp_path / "run"), "torch_dist", x),
            (arch, mo.Layout(pp=2), str(tmp_path / "run2"), "legacy", x)]  # fmt: skip
    for (_, _, run, _, _), theirs in zip(jobs, mo.run(mo.load_ranks, jobs)):
        assert (tmp_path / run / "latest_checkpointed_iteration.txt").read_text() == "10"
        ours = mo.megalite_logits(run, x)
        v = arch.vocab
        assert (theirs[..., :v] - ours[..., :v]).abs().max() <= 1e-5, run
    common = torch.load(tmp_path / "run" / "iter_0000010" / "common.pt", weights_only=False)
    assert common["iteration"] == 10
    assert common["args"].consumed_train_samples == 56 + 3 * 4
    # the saves carry the scheduler: megatron-core's, built from the same flags, loads it (every
    # value checked equal to its own) and continues at the lr megalite would use next
    legacy_file = tmp_path / "run2" / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt"
    for saved in (common, torch.load(legacy_file, weights_only=False)):
        assert saved["opt_param_scheduler"]["num_steps"] == mf.SCHEDULE_SAMPLES + 3 * 4
        back = [{}]
        sched.megatron_scheduler(sched.Args(cfg), back).load_state_dict(
            saved["opt_param_scheduler"]
        )
        assert (
            back[0]["lr"]
            == groups[0]["lr"]
            == LRSchedule.from_config(cfg).rates(mf.SCHEDULE_SAMPLES + 12).lr
        )
