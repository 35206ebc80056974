"""The fake device's counter (megalite/training/fake_cuda.py) and the matching of recorded
collectives (megalite/training/fake_world.py), in this process."""

import torch

from megalite.optim.clip_grad import step_status
from megalite.parallel.groups import single_process_groups
from megalite.training.fake_cuda import fake_cuda
from megalite.training.fake_world import RoleReport, match


def test_step_status_reads_the_device_once_with_host_flags():
    """Finding 2 (issue 32): the trainer's two host-float flags became two blocking copies
    (torch.as_tensor(f, device=...)) on top of the status read: three syncs, not one."""
    world = single_process_groups().world
    with fake_cuda(gpu="cpu") as fake:
        g = torch.randn(8)
        out = step_status([g], [], world, [0.0, 1.0, torch.zeros(())])
    assert len(out) == 5
    assert fake.syncs == 1, [w for w, _ in fake.where]


def test_fake_cuda_counts_a_blocking_copy_to_the_device():
    with fake_cuda() as fake:
        x = torch.randn(4, 4)
        x.to("cuda", non_blocking=True)  # unpinned: blocks
        x.pin_memory().to("cuda", non_blocking=True)  # pinned: does not
        y = torch.empty(4, 4, device="cuda")
        assert y[1:3].device.type == "cuda" and y.tolist()[0] == [0.0] * 4
    assert fake.syncs == 2, [w for w, _ in fake.where]


def test_match_finds_a_rank_that_skips_a_collective():
    world = (0, 1, 2)
    call = ("all_reduce", (4,), "float32")
    reports = [RoleReport(r, {}, {world: [call] * (1 if r == 1 else 2)}, {"world": world})
               for r in world]  # fmt: skip
    m = match(reports)
    assert m.compared == {"world": 1}
    assert [(x[3], x[4]) for x in m.mismatches] == [(1, 1)]  # rank 1 stops at the second call


def _moe_grads(recompute: str):
    from megalite.shape import validate
    from megalite.testing import tiny_config
    from megalite.training.build import build_rank

    cfg = tiny_config()
    m = cfg.model
    m.num_experts, m.moe_expert_capacity_factor, m.hidden_dropout = 4, 1.0, 0.0
    m.attention_dropout = 0.0
    cfg.training.recompute, cfg.training.global_batch_size = recompute, 2
    shape = validate(cfg, 1)
    parts = build_rank(cfg, shape, single_process_groups())
    g = torch.Generator().manual_seed(0)
    batch = [tuple(torch.randint(0, 100, (1, 16), generator=g) for _ in range(2)) for _ in range(2)]
    parts.opt.zero_grad(len(batch))
    parts.run(batch)
    return parts.opt.full_grads()


def test_full_recompute_with_kept_routing_gives_the_same_gradients():
    """Finding 7's fix replays the forward's routing (capacity drops included) in the
    recomputation: the gradients are those of a run without recompute."""
    a, b = _moe_grads("none"), _moe_grads("full")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


def test_storage_trace_counts_live_storages_once():
    """fake_memory.StorageTrace: a storage's bytes from the op that makes it until it is freed,
    views not again, ZeRO-3's resizes, and the peak restarted by reset_peak."""
    from megalite.training.fake_memory import StorageTrace

    with fake_cuda(gpu="cpu"), StorageTrace() as mem:
        a = torch.empty(256)  # 1 KiB
        view = a[:128]
        b = torch.empty(512)  # 2 KiB
        assert (mem.current, mem.peak) == (3072, 3072) and view.numel() == 128
        del b
        assert (mem.current, mem.peak) == (1024, 3072)
        mem.reset_peak()
        a.untyped_storage().resize_(0)  # as ZeRO-3 frees a gathered unit
        assert (mem.current, mem.peak) == (0, 1024)
