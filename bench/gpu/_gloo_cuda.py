"""Gloo with CUDA tensors, for gpu_trainer_check.py multirank: NCCL refuses two ranks on one
device, so ranks sharing the one GPU talk over gloo. What gloo does with CUDA tensors (torch's
ProcessGroupGloo.cpp): all_reduce, all_gather (all_gather_single), broadcast and gather have CUDA
variants that stage through pinned host memory; reduce_scatter_single is a clone plus a CUDA
all_reduce; send/recv hand the tensor's data pointer to gloo as host memory with no device check.
So `probe` tries each collective megalite uses with CUDA tensors against the expected values, and
`stage_p2p_through_host` (test-only) stages the pipeline's p2p batches through host memory, the
one path gloo refuses. `init_gloo` starts a spawned rank's gloo world."""

import torch
import torch.distributed as dist


def init_gloo(rank, world, tmp, device):
    """This spawned rank's gloo world (file:// rendezvous in `tmp`), on `device`'s GPU if any."""
    torch.set_num_threads(1)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)


class _StagedWork:
    """A p2p work whose tensor went through a host buffer: waiting copies a receive back."""

    def __init__(self, work, target, host, recv):
        self.work, self.target, self.host, self.recv = work, target, host, recv

    def wait(self, timeout=None):
        self.work.wait()
        if self.recv:
            self.target.copy_(self.host)
            self.recv = False
        return True

    def is_completed(self):
        return self.work.is_completed()


def stage_p2p_through_host(force: bool = False):
    """Wrap torch.distributed.batch_isend_irecv so that CUDA tensors (any tensor with `force`,
    to test this on CPU) travel through host copies: gloo's send/recv read and write the
    tensor's memory as host memory. Test-only: every send is a blocking device-to-host copy."""
    real = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        host_ops, staged = [], []
        for op in ops:
            t = op.tensor
            if t.device.type == "cpu" and not force:
                host_ops.append(op)
                staged.append(None)
                continue
            recv = "recv" in getattr(op.op, "__name__", "")
            h = torch.empty(t.shape, dtype=t.dtype) if recv else t.detach().to("cpu", copy=True)
            host_ops.append(dist.P2POp(op.op, h, peer=op.peer, group=op.group, tag=op.tag))
            staged.append((t, h, recv))
        works = real(host_ops)
        return [w if s is None else _StagedWork(w, *s) for w, s in zip(works, staged)]

    dist.batch_isend_irecv = batch_isend_irecv
    return real


def probe(rank, world, tmp, device_name, which, queue):
    """Each collective megalite uses, with tensors on `device`, against the expected values."""
    device = torch.device(device_name)
    init_gloo(rank, world, tmp, device)
    out = {}
    n = 8

    def check(name, fn):
        try:
            ok = fn()
            out[name] = "ok" if ok else "wrong result"
        except Exception as e:  # noqa: BLE001 - the probe reports whatever gloo says
            out[name] = f"refused: {str(e).strip().splitlines()[0][:160]}"

    def all_reduce():
        t = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(t)
        return torch.equal(t.cpu(), torch.full((n,), float(sum(range(1, world + 1)))))

    def all_gather():
        t = torch.full((n,), float(rank), device=device)
        o = torch.empty(n * world, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(o, t)
        return torch.equal(o.cpu(), torch.arange(world).float().repeat_interleave(n))

    def reduce_scatter():
        t = torch.arange(n * world, dtype=torch.float32, device=device)
        o = torch.empty(n, device=device)
        w = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            o, t, async_op=True
        )
        w.wait()
        expect = torch.arange(n * world, dtype=torch.float32)[rank * n : (rank + 1) * n] * world
        return torch.equal(o.cpu(), expect)

    def broadcast():
        t = torch.full((n,), float(rank + 5), device=device)
        dist.broadcast(t, src=0)
        return torch.equal(t.cpu(), torch.full((n,), 5.0))

    def send_recv():
        t = torch.full((n,), float(rank), device=device)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, t.clone(), peer), dist.P2POp(dist.irecv, t, peer)]
        for w in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
            w.wait()
        return torch.equal(t.cpu(), torch.full((n,), float(peer)))

    probes = {"all_reduce": all_reduce, "all_gather_single": all_gather,
              "reduce_scatter_single": reduce_scatter, "broadcast": broadcast,
              "send/recv": send_recv}  # fmt: skip
    for name in which:
        check(name, probes[name])
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()
