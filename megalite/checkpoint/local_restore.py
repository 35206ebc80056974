"""A restart from the newest complete copy: the local tier (local_tier.py) or the persistent one.

1. **Locate.** The ranks of a node share the rank folders of its directory (whichever ranks
   wrote them: a restart may number the nodes otherwise, or have fewer ranks); each lists the
   parts in its share (owners' own copies and replicas) newer than the persistent checkpoint
   and checks every file against the sha256 its part records; a corrupt or partial copy is
   left out (and counted).
2. **Agree.** One all-gather of those small records (iteration, owner, the world that saved it)
   and the persistent iteration: every rank computes the same choice (`choose`), the newest
   iteration for which every owner's part has a good copy somewhere; else the persistent tier.
3. **Fetch.** The part of each owner (entries, checksums, RNG) comes from one holder (an
   all-gather), so every rank has the whole index; each rank names the files its load reads
   (`needed_files`: the slices its parameters and their optimizer state cover at the new
   layout, plus those it verifies) and receives those it lacks from a holder over the tier's
   world group (p2p, on the device: NCCL on GPUs; no training runs meanwhile).
4. **Load.** The rank's files (links to its own copies, the fetched ones) and the merged index
   form an ordinary checkpoint directory, which the Checkpointer loads as it loads --save's own:
   any layout, so a restart at a smaller world reshards.

One line says which tier, which iteration and how many shards came from peers.
"""

import json
import os
import shutil
import time
from pathlib import Path

from megalite.checkpoint import format as fmt
from megalite.checkpoint import writing
from megalite.checkpoint.local_tier import PART, rank_dir, recv_bytes, send_bytes
from megalite.checkpoint.regions import all_gather, piece_blocks, rank_params
from megalite.model.moe import expert_biases


def _good(folder: Path) -> dict | None:
    """The part in `folder` if it and every file it names are whole (sha256), else None."""
    try:
        part = json.loads((folder / PART).read_text())
        for name, meta in part["files"].items():
            path = folder / name
            if path.stat().st_size != meta["bytes"] or fmt.sha256_file(path) != meta["sha256"]:
                return None
        return part
    except (OSError, ValueError, KeyError, TypeError):
        return None


def survey(
    root, newer_than: int, local_rank: int = 0, local_world: int = 1
) -> tuple[list, dict, int]:
    """([(iteration, owner, saved world)] of the good copies in this node's directory that this
    rank checks, {(iteration, owner): folder}, the number of corrupt or partial copies found).
    The node's ranks share its rank folders, whichever ranks wrote them (a restart may number
    the nodes otherwise, or have fewer ranks): `local_rank` of `local_world` takes every
    local_world-th folder."""
    found = sorted(Path(root).glob("rank*")) if Path(root).is_dir() else []
    bases = [d for d in found if d.name[4:].isdigit()][local_rank::local_world]
    records, where, bad = [], {}, 0
    for base in bases:
        homes = [(int(base.name[4:]), base)]
        homes += [
            (int(r.name[8:]), r) for r in sorted(base.glob("replica-*")) if r.name[8:].isdigit()
        ]
        for owner, home in homes:
            for folder in sorted(home.glob("iter_*")):
                it = int(folder.name[5:]) if folder.name[5:].isdigit() else -1
                if it <= newer_than or (it, owner) in where:
                    continue
                part = _good(folder)
                if part is None or part.get("rank") != owner:
                    bad += 1
                    continue
                records.append((it, owner, int(part["world"])))
                where[(it, owner)] = folder
    return records, where, bad


def choose(gathered: list[list], persistent: int) -> tuple[int, int, dict] | None:
    """The newest iteration above `persistent` (-1: none) that every owner of its save has a
    good copy of: (iteration, saved world, {owner: [holder ranks]}), or None. `gathered[h]`
    holds rank h's records (survey). Pure: every rank computes the same."""
    by_it = {}
    for holder, records in enumerate(gathered):
        for it, owner, world in records:
            by_it.setdefault((it, world), {}).setdefault(owner, []).append(holder)
    for (it, world), holders in sorted(by_it.items(), reverse=True):
        if it > persistent and all(o in holders for o in range(world)):
            return it, world, {o: sorted(holders[o]) for o in range(world)}
    return None


def needed_files(tensors: dict, chunks) -> set[str]:
    """The files a rank's load reads from a checkpoint index's `tensors`: those holding a slice
    its parameters (and their optimizer state, the whole local tensor: a superset of its ZeRO
    shard) overlap at this layout, and those holding its expert biases and FP8 histories."""
    out = set()

    def overlapping(name, region):
        for s in tensors.get(name, {}).get("shards", []):
            if region is None or all(a < d and c < b for (a, b), (c, d) in zip(region, s["slice"])):
                out.add(s["file"])

    for name, p, spec in rank_params(chunks):
        regions = [r for _, _, r in piece_blocks(spec, p.shape, 0, p.numel())]
        for key in [name] + [fmt.opt_name(k, name) for k in fmt.OPTIMIZER_KINDS]:
            for region in regions:
                overlapping(key, region)
    for name, _ in expert_biases(chunks):
        overlapping(name, None)
    for name in tensors:
        if ".fp8_" in name:  # delayed-scaling histories: small, read whole where present
            overlapping(name, None)
    return out


class Restart:
    """What a restart resumes from, agreed by every rank (`agree`); `fetch` assembles it."""

    def __init__(self, cfg, groups, persistent_path, log=print):
        self.cfg, self.groups, self.log = cfg, groups, log
        self.root = Path(cfg.checkpoint.non_persistent_local_ckpt_dir)
        self.persistent_path = persistent_path
        self.choice = None
        self.seconds = {}
        self.line = None
        self._dir = None

    @property
    def local(self) -> bool:
        return self.choice is not None

    def agree(self):
        """Locate and agree (collective: one all-gather)."""
        t0 = time.perf_counter()
        g = self.groups
        persistent = fmt.Checkpoint(self.persistent_path).iteration if self.persistent_path else -1
        local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        records, self._where, bad = survey(self.root, persistent, *local)
        gathered = all_gather((records, bad, persistent), g.world)
        persistent = gathered[0][2]  # shared storage: rank 0's view
        corrupt = sum(b for _, b, _ in gathered)
        self.choice = choose([r for r, _, _ in gathered], persistent)
        self.seconds["locate"] = time.perf_counter() - t0
        note = f"; {corrupt} corrupt or partial local copies skipped" if corrupt else ""
        note += f"; located in {self.seconds['locate']:.2f} s"
        if self.choice is None:
            newest = max((r[0] for rs, _, _ in gathered for r in rs), default=None)
            local = (
                "no local copy"
                if newest is None
                else f"no complete local iteration above {persistent}"
            )
            if persistent >= 0:
                self.line = (f"restart from the persistent tier: iteration {persistent} "
                             f"({self.persistent_path}; {local}{note})")  # fmt: skip
            elif newest is not None or corrupt:
                self.line = f"no checkpoint to restart from ({local}{note}); starting afresh"
        else:
            self._note = note
        return self

    def fetch(self, chunks) -> Path:
        """Gather the parts, fetch the files this rank lacks, write the directory to load
        (collective). Returns that directory."""
        t0 = time.perf_counter()
        g = self.groups
        it, world, holders = self.choice
        mine = {o: json.loads((self._where[(it, o)] / PART).read_text())
                for o in range(world) if holders[o][0] == g.rank}  # fmt: skip
        parts = {}
        for d in all_gather(mine, g.world):
            parts.update({int(o): p for o, p in d.items()})
        parts = [parts[o] for o in range(world)]
        owner_of = {f: o for o, p in enumerate(parts) for f in p["files"]}
        files = {f: m for p in parts for f, m in p["files"].items()}
        tensors = writing.merge_entries([p["entries"] for p in parts])
        need = needed_files(tensors, chunks) | set(sorted(files)[g.rank :: g.topo.world_size])
        held = {f for f in need if (it, owner_of[f]) in self._where}
        wants = all_gather(sorted(need - held), g.world)
        out = rank_dir(self.root, g.rank) / ".restore" / fmt.iter_dirname(it)
        shutil.rmtree(out.parent, ignore_errors=True)
        out.mkdir(parents=True)
        for f in held:
            (out / f).symlink_to((self._where[(it, owner_of[f])] / f).resolve())
        fetched = 0

        def read(f):
            return (self._where[(it, owner_of[f])] / f).read_bytes()

        for dst, names in enumerate(wants):  # the same order on every rank: no deadlock
            for f in names:
                src = holders[owner_of[f]][0]
                fetched += 1
                if g.rank == src:
                    for w in send_bytes(read(f), dst, g.world.pg, g.device):
                        w.wait()
                elif g.rank == dst:
                    (out / f).write_bytes(recv_bytes(src, g.world.pg, g.device))
        index = {**parts[0]["meta"], "rng": [p["rng"] for p in parts], "files": files,
                 "tensors": tensors}  # fmt: skip
        writing.write_atomic(out / fmt.INDEX, json.dumps(index))
        self._dir = out
        self.seconds["fetch"] = time.perf_counter() - t0
        self.line = (f"restart from the local tier: iteration {it} ({world} ranks' shards, "
                     f"{fetched} fetched from peers{self._note}, fetched in "
                     f"{self.seconds['fetch']:.2f} s)")  # fmt: skip
        return out

    def done(self):
        """Remove the assembled directory (its files are links or fetched copies)."""
        if self._dir is not None:
            shutil.rmtree(self._dir.parent, ignore_errors=True)
