"""Node-local checkpoints replicated to peers (--non-persistent-ckpt-type local).

Every --non-persistent-save-interval steps each rank saves what a persistent save would have
it write (its own shard of the weights and the optimizer state, Checkpointer._local_tensors),
as --async-save does: the step copies it to host buffers reused from save to save, and a
background thread writes the safetensors file with its sha256 (shard_io.write_shard), then
`part.json` (the file's checksum, its index entries, this rank's RNG states and the index
fields of the save), into a temporary directory renamed into place last. Nothing is gathered:
a local save is no collective of the training groups.

With --replication the ranks form groups of --replication-factor F ranks --replication-jump J
apart (Megatron's replication groups: in each block of J*F ranks, {i, i + J, ..., i + (F-1)J};
with J the ranks per node, F ranks on F different nodes), and the same thread then sends the
directory's two files to the other F - 1 members of its group and keeps theirs under
`replica-<rank>/`, over a gloo process group of just those F ranks (CPU, never the training
stream; each rank creates only its own). At most one local save is in flight: the next one, a
stop and the end of training wait for it. Persistent saves (--save-interval) go on as before.

Layout of --non-persistent-local-ckpt-dir (one per node, or shared: each rank its own folder):

    rank00003/iter_0000040/{model-tp01-dp01.safetensors, part.json}   rank 3's own
    rank00003/replica-00007/iter_0000040/{...}                         rank 7's, kept by rank 3

A part holds its files' sha256, so a restart (local_restore.py) never loads a corrupt or
partial copy, and its index entries name the slices of the logical tensors as a persistent
checkpoint's do, so a local checkpoint is topology-free: a restart at another world reads it.
"""

import json
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megalite.checkpoint import format as fmt
from megalite.checkpoint import shard_io, writing
from megalite.checkpoint.async_save import BackgroundSave, host_copy
from megalite.checkpoint.regions import encode_rng
from megalite.errors import MegaliteError

PART = "part.json"
KEEP = 2  # local iterations kept per rank (the newest may be mid-write when a node dies)
CHUNK = 64 << 20  # bytes per message when a file is sent


def rank_dir(root, rank: int) -> Path:
    return Path(root) / f"rank{rank:05d}"


def replica_dir(root, holder: int, owner: int) -> Path:
    return rank_dir(root, holder) / f"replica-{owner:05d}"


def clique(rank: int, factor: int, jump: int) -> list[int]:
    """The replication group of `rank`: the `factor` ranks `jump` apart in its block of
    jump * factor ranks, itself included (each keeps a copy of the others' parts)."""
    block = rank - rank % (jump * factor)
    return [block + rank % jump + k * jump for k in range(factor)]


def check(c, world: int):
    """The local tier's flags against the world (pure): one clear line when impossible."""
    if not c.non_persistent_save_interval:
        return
    if c.non_persistent_ckpt_type != "local":
        raise MegaliteError(
            "--non-persistent-save-interval needs --non-persistent-ckpt-type local (the only kind)"
        )
    if not c.non_persistent_local_ckpt_dir:
        raise MegaliteError(
            "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR (a "
            "node-local disk or /dev/shm)"
        )
    f, j = c.replication_factor, c.replication_jump
    if c.replication and (f < 1 or j < 1):
        raise MegaliteError(f"--replication-factor {f} and --replication-jump {j} must be >= 1")


def copies(world: int, factor: int, jump: int) -> int:
    """The copies of a part the world can hold: the largest f <= --replication-factor whose
    blocks of jump * f ranks tile the world (a restart on fewer nodes keeps its command line
    and replicates less, or not at all)."""
    return next(f for f in range(factor, 0, -1) if f == 1 or world % (jump * f) == 0)


def _write_dir(final: Path, files: dict[str, bytes | None], write_shard=None):
    """Write a part directory aside (`.<name>.tmp`), then rename it into place."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if write_shard is not None:
        write_shard(tmp)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    writing.fsync_dir(final.parent)


def _prune(folder: Path, keep: int = KEEP):
    done = sorted(p for p in folder.glob("iter_*") if (p / PART).is_file())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def send_bytes(data: bytes, dst: int, group, device=None) -> list:
    """Queue `data` to global rank `dst` (its length first, then CHUNK-sized pieces) on
    `device` (the group's: CUDA for NCCL); the works to wait."""
    device = device or torch.device("cpu")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)
    buf = buf.to(device)
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    works = [dist.isend(n, dst, group=group)]
    for lo in range(0, len(data), CHUNK):
        works.append(dist.isend(buf[lo : lo + CHUNK], dst, group=group))
    return works


def recv_bytes(src: int, group, device=None) -> bytes:
    device = device or torch.device("cpu")
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group)
    out = torch.empty(int(n), dtype=torch.uint8, device=device)
    for lo in range(0, int(n), CHUNK):
        dist.recv(out[lo : lo + CHUNK], src, group=group)
    return out.cpu().numpy().tobytes()


class LocalTier:
    """The local saves of one rank (with --replication collective within its replication group,
    whose gloo group it creates)."""

    def __init__(self, cfg, groups, checkpointer, log=print):
        c = cfg.checkpoint
        check(c, groups.topo.world_size)
        self.cfg, self.groups, self.ckpt, self.log = cfg, groups, checkpointer, log
        self.interval = c.non_persistent_save_interval
        self.root = Path(c.non_persistent_local_ckpt_dir)
        self.factor = copies(groups.topo.world_size, c.replication_factor, c.replication_jump)
        self.factor = self.factor if c.replication else 1
        if c.replication and self.factor < c.replication_factor:
            log(f"megalite: warning: --replication-factor {c.replication_factor} with "
                f"--replication-jump {c.replication_jump} fits {self.factor} distinct ranks at "
                f"world size {groups.topo.world_size}; keeping {self.factor} copies")  # fmt: skip
        self.jump = c.replication_jump
        self.world, self.rank = groups.topo.world_size, groups.rank
        self.peers = [r for r in clique(self.rank, self.factor, self.jump) if r != self.rank]
        self.group = None
        if self.peers and dist.is_initialized():  # only this replication group's ranks meet
            minutes = cfg.parallel.distributed_timeout_minutes
            self.group = dist.new_group(sorted([self.rank, *self.peers]), backend="gloo",
                                        timeout=timedelta(minutes=minutes),
                                        use_local_synchronization=True)  # fmt: skip
        self._background = BackgroundSave()
        self._host = {}
        self.last = None  # (iteration, seconds the step waited, seconds in the background)

    def after_step(self, state_fn, iteration: int):
        if self.interval and iteration % self.interval == 0:
            self.save(state_fn())

    def save(self, state):
        """Copy this rank's shard to host and write + replicate it in the background."""
        t0 = time.perf_counter()  # the step's wait: for the previous local save, then the copy
        self.wait()
        tensors, event = host_copy(self.ckpt._local_tensors(), self._host)
        fname = self.ckpt._fname if tensors else None
        part = {"rank": self.rank, "world": self.world, "meta": self.ckpt._meta(state),
                "rng": {"rank": self.rank, **encode_rng(state.rng or {})}}  # fmt: skip
        name = fmt.iter_dirname(state.iteration)
        own = rank_dir(self.root, self.rank)
        waited = time.perf_counter() - t0

        def job() -> str | None:
            t1 = time.perf_counter()
            if event is not None:
                event.synchronize()
            done = {}

            def write(tmp: Path):
                entries, files = shard_io.write_shard(tmp, fname, tensors) if fname else ({}, {})
                done["part"] = {**part, "entries": entries, "files": files}
                (tmp / PART).write_text(json.dumps(done["part"]))

            error = None
            try:
                _write_dir(own / name, {}, write)
                _prune(own)
            except OSError as e:
                error = f"could not write the local checkpoint {own / name} ({e})"
            if self.group is not None:
                error = self._replicate(own / name, name, error) or error
            self.last = (state.iteration, waited, time.perf_counter() - t1)
            return error

        self._background.start(job)

    def _replicate(self, mine: Path, name: str, error) -> str | None:
        """Send this rank's part to its replication group, keep theirs (each member calls it,
        in the thread). A rank whose own write failed sends no files, and its peers keep none."""
        sends = recvs = self.peers
        try:
            blobs = {} if error else {p.name: p.read_bytes() for p in sorted(mine.iterdir())}
            head = json.dumps(list(blobs)).encode()  # the file names, then each file
            works = []
            for dst in sends:
                works += send_bytes(head, dst, self.group)
                for data in blobs.values():
                    works += send_bytes(data, dst, self.group)
            for src in recvs:
                got = {
                    n: recv_bytes(src, self.group) for n in json.loads(recv_bytes(src, self.group))
                }
                if PART in got:
                    folder = replica_dir(self.root, self.rank, src)
                    _write_dir(folder / name, got)
                    _prune(folder)
            for w in works:
                w.wait()
        except (OSError, RuntimeError, ValueError) as e:
            return f"could not replicate the local checkpoint {name} ({e})"
        return None

    def wait(self):
        """Wait for the local save in flight; its error is a warning (the persistent tier and
        the previous local save still stand), never a stop."""
        if not self._background.busy:
            return
        error = self._background.wait()
        if error:
            self.log(f"megalite: warning: {error}; the previous local checkpoint stands")
        elif self.last is not None:
            it, waited, background = self.last
            copies = f", copied to {len(self.peers)} peer(s)" if self.peers else ""
            self.log(f"local checkpoint of iteration {it} written{copies} in {background:.3f} s "
                     f"in the background; the step waited {waited:.4f} s")  # fmt: skip
