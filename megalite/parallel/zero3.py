"""ZeRO-3: every rank keeps 1/dp of each parameter, gathered layer by layer when it is used.

The parameters of a model chunk are grouped in units: one per layer (`chunk.layers[i]`) and one
"outer" unit for the rest (embedding, final norm, head), read by the chunk around its layers, as
FSDP wraps each block and the root. A unit is one bucket (a parameter that must be sharded alone,
a tied half, gets a bucket of its own in its unit), so the optimizer, the norm and checkpoints
see the same buckets and shards as at stages 1 and 2; the unit is only what is gathered and
freed together.

Each bucket has its persistent shard (`Zero3Buffer.shards`, what the optimizer updates) and a
full flat tensor (`Zero3Buffer.full`) that the parameters are views of. Freeing resizes the full
tensor's storage to zero: autograd keeps the parameters it saved for backward, so only freeing
the storage itself releases the memory, and gathering back into that same storage before
backward gives autograd its saved weights again (FSDP's flat parameter does the same; swapping
`.data` would leave the saved tensors alive, and sharing one buffer between layers would corrupt
them).

A step, per micro-batch (`reshard` below says what is kept):

  forward   a unit's pre-hook waits for its gather (started earlier as a prefetch, else now)
            and starts the next unit's; its post-hook frees it and hooks the unit's output, so
            the gradient reaching that output gathers the unit again (and prefetches the unit
            before it) before its backward runs
  backward  once every parameter of a bucket has its gradient, the bucket is reduce-scattered
            into this rank's shard gradient (stage 2's path, gradients staged only while they
            are reduced), and once all buckets of the unit are, the unit is freed
  step      the optimizer step starts gathering the units the next forward reads first

Frees whose gather would follow at once, with nothing to overlap it, are skipped
(`carried_units`, one chunk and a policy that frees within the step): the outer unit's after
its forward (the loss is its last op, FSDP2 keeps its root so), and the outer unit's and the
first layer's after a backward that another micro-batch follows.

Gradient accumulation: each micro-batch is reduce-scattered as it comes (m reduce-scatters of
every unit per step, no whole-model gradient ever exists), as FSDP2 without no_sync.

Keeping parameters (`reshard`): "forward" frees after forward and after backward (the default,
2 gathers per layer per micro-batch; the carried units fewer, `unit_gathers`); "backward"
(--zero3-keep-params) keeps them from forward to the end of the unit's backward (1 gather);
"step" (the default under pp, as torchtitan: 1F1B interleaves forwards and backwards of
different micro-batches) keeps them gathered until the step's gradients are reduced (1 gather
per step).

Parameter gathers are recorded in the ledger as "<kind>_gather" (e.g. dp_gather), the gradient
reduce-scatters under the group's own kind, so a step's traffic of each is visible.

Hybrid sharding (--dp-replicate): `dp` is the shard group and `shard_copies` its copies; the
units are gathered over `dp` alone, and each shard's gradient is all-reduced over the copies
once the step's reduce-scatters have landed (reducers.StepReducer.finish, ledger kind "dpr").
"""

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite.parallel import comm
from megalite.parallel.buckets import ALIGN, Bucket, Packer, ParamRange, grad_dtype, trainable
from megalite.parallel.buffers import from_reducer, gather_shards, nbytes, place, saves, solo
from megalite.parallel.comm import Group
from megalite.parallel.fp8_gather import fp8_buckets, weight_groups
from megalite.parallel.zero import GATHERS, ZERO

RESHARD = ("forward", "backward", "step")


def unit_of(name: str) -> str:
    """The unit a parameter belongs to, by its name in the chunk: "layers.<i>" or "" (outer)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else ""


def unit_layout(chunks: list[list[tuple]], pad: int) -> list[tuple]:
    """Buckets of a ZeRO-3 buffer, in bucket_layout's format [(start, end, [(name, offset,
    numel)])]: per chunk its outer unit, then its layers in order (forward order); one bucket
    per unit, an `alone` parameter in a bucket of its own. `chunks`: per chunk [(name, numel,
    alone)] in registration order; `alone` may also name a kind ("fp8": the weights ZeRO-3
    gathers in FP8), whose parameters share a bucket of their own in each unit. The buffer and
    the planner both lay units out with this."""
    pack = Packer(pad)
    for params in chunks:
        units: dict[str, list] = {"": []}
        for name, n, alone in params:
            units.setdefault(unit_of(name), []).append((name, n, alone))
        for members in units.values():
            shared = [(name, n) for name, n, alone in members if not alone]
            kinds: dict[str, list] = {}
            for name, n, alone in members:
                if alone is True:
                    pack.close([(name, n)])
                elif alone:
                    kinds.setdefault(alone, []).append((name, n))
            for ranges in kinds.values():
                pack.close(ranges)
            if shared:
                pack.close(shared)
    return pack.out


def carried_units(units: list[tuple[str, bool]], chunks: int, policy: str) -> list[str]:
    """Of a rank's first chunk's units [(key, holds FP8 weights)] in forward order (key as
    unit_of: "" the outer unit), those kept gathered from one micro-batch's backward, where
    they run last, to the next one's forward, where they run first, and gathered after the
    optimizer step for the next step: the outer unit and the first layer. Only with one chunk
    and a policy that frees within the step, where a forward and its backward follow each
    other directly, so they are held only while the outer unit and two layers may be anyway
    (the planner's peak). Units holding FP8 weights are left out: their gather records the FP8
    recipe's amax."""
    if chunks != 1 or policy == "step":
        return []
    plain = [key for key, fp8 in units[:2] if not fp8]
    return [k for k in plain if k == ""] + [k for k in plain if k != ""][:1]


def unit_gathers(policy: str, microbatches: int, key: str, carried: list[str]) -> int:
    """How often a unit is gathered per step under `policy` (zero.GATHERS), `carried` being
    carried_units: the outer unit once a step when carried (then also kept from its forward to
    its backward, as FSDP2 keeps its root: the loss is its last op, its gradient the backward's
    first), the first layer once per backward and once after the step under "forward"."""
    if key not in carried:
        return GATHERS[policy](microbatches)
    return microbatches + 1 if policy == "forward" and key else 1


@dataclass(eq=False)
class Unit:
    """Parameters gathered and freed together: a layer, or a chunk's outer parameters."""

    name: str
    module: nn.Module  # whose forward uses them (hooked)
    buckets: list
    chunk: int
    gathered: bool = False  # storage allocated (the gather may still be in flight)
    works: list = field(default_factory=list)  # gathers in flight
    reduced: int = 0  # buckets reduce-scattered in this backward pass

    @property
    def key(self) -> str:
        """Its unit_of key: "" for the outer unit."""
        return "" if self.name == "outer" else self.name


class Zero3Buffer:
    """The buffers of ZeRO-3, seen by the optimizer as a GradBuffer (parallel/buffers.py:
    buckets, shards, shard gradients), whose parameters live as shards, gathered per unit
    around their use. The weights of FP8 linears sit in a bucket of their own per unit;
    `fp8_gather` (--fp8-param-gather) gathers them as FP8 data and a scale
    (parallel/fp8_gather.py)."""

    grad_buffer = None  # no whole-model gradient buffer: per-shard accumulators

    def __init__(self, chunks: list[nn.Module], dp: Group, reshard: str = "forward",
                 own_bucket=lambda name, p: False, fp8_gather: bool = False,
                 shard_copies: Group | None = None, bf16_grads: bool = False):  # fmt: skip
        if reshard not in RESHARD:
            raise ValueError(f"reshard must be one of {RESHARD}, got {reshard!r}")
        # FP8 weights get a bucket of their own per unit whether or not they travel in FP8: one
        # layout, so a run with the flag equals one without bit for bit (the norm's sums too)
        groups = weight_groups(chunks, check=fp8_gather)
        fp8 = {p for g in groups for p in g.params}
        own = lambda name, p: "fp8" if p in fp8 else own_bucket(name, p)  # noqa: E731
        named, self.param_dtype = trainable(chunks)
        params = [x for c in named for x in c]
        self.dp, self.zero, self.shard_copies = dp, ZERO[3], shard_copies or solo(dp)
        self.scale = 1.0 / (dp.size * self.shard_copies.size)  # the mean over every replica
        self.gather_group = dataclasses.replace(dp, kind=f"{dp.kind}_gather")
        self.reshard = reshard
        self.grad_dtype = grad_dtype(self.param_dtype, bf16_grads)  # (--grad-reduce-in-bf16)
        device = params[0][1].device
        layout = unit_layout(
            [[(n, p.numel(), own(n, p)) for n, p in c] for c in named], dp.size * ALIGN
        )
        by_name = dict(params)
        chunk_of = {n: c for c, named_c in enumerate(named) for n, _ in named_c}
        grads = lambda lo, hi: torch.zeros(hi - lo, dtype=self.grad_dtype, device=device)  # noqa: E731
        self.buckets, self.ranges, self.units, units = [], [], [], {}
        # per bucket: the whole bucket the parameters are views of (storage freed between uses)
        self.full: dict[Bucket, torch.Tensor] = {}
        self.shards: dict[Bucket, torch.Tensor] = {}  # and this rank's shard of it
        for start, end, ranges in layout:
            first = ranges[0][0]
            c = chunk_of[first]
            b = place(start, end, [by_name[n] for n, _, _ in ranges], c, dp, self.shard_copies,
                      True, grads)  # fmt: skip
            full = self.full[b] = torch.zeros(b.numel, dtype=self.param_dtype, device=device)
            with torch.no_grad():
                for n, o, k in ranges:
                    p = by_name[n]
                    view = full[o - start : o - start + k].view_as(p)
                    view.copy_(p)
                    p.data = view  # the model reads the unit's storage (freed between uses)
                    self.ranges.append(ParamRange(n, p, o, b))
            self.shards[b] = full[b.dp_start - start : b.shard_end - start].clone()
            self.buckets.append(b)
            key = (c, unit_of(first))
            if key not in units:
                module = chunks[c].get_submodule(key[1]) if key[1] else chunks[c]
                units[key] = Unit(key[1] or "outer", module, [], c, gathered=True)
                self.units.append(units[key])
            units[key].buckets.append(b)
        self.numel = layout[-1][1] if layout else 0
        offsets = {r.param: r.offset for r in self.ranges}
        self._fp8 = fp8_buckets(self.shards, groups, offsets) if fp8_gather else {}
        self._unit_of = {b: u for u in self.units for b in u.buckets}
        # gradients: stage 2's path, a unit freed once all its buckets are reduced
        self.reducer = self.zero.reducer(self.buckets, self.ranges, dp, self.scale,
                                         self.zero.in_flight, on_launch=self._launched,
                                         shard_copies=self.shard_copies)  # fmt: skip
        self.gathered_bytes = self._held()
        self._plan_keeps(len(chunks))
        for u in self.units:  # built whole: from now on each rank holds its shards only,
            if u not in self._prefetched:  # and the units the first forward reads first
                self._free(u)
        self._hook(chunks)
        for r in self.ranges:
            r.param.register_post_accumulate_grad_hook(self.reducer.on_grad)
        self.zero_grad(1)

    # ---- gathering and freeing ----------------------------------------------------------

    def _held(self) -> int:
        """Parameter bytes gathered now (full tensors and FP8 copies)."""
        full = sum(f.untyped_storage().nbytes() for f in self.full.values())
        return full + sum(f.full8.untyped_storage().nbytes() for f in self._fp8.values())

    def _gather(self, u: Unit, wait: bool = True, whole: bool = False):
        """Allocate the unit's storage and start gathering its shards into it (a prefetch),
        and with `wait` wait for them. FP8 weights travel in FP8 unless `whole`."""
        if not u.gathered:
            record = torch.is_grad_enabled()  # a training forward (backward's hooks run without)
            for b in u.buckets:
                f8 = None if whole else self._fp8.get(b)
                if f8 is None:
                    full = self.full[b]
                    full.untyped_storage().resize_(b.numel * full.element_size())
                    u.works.append(comm.all_gather(full, self.shards[b], self.gather_group,
                                                   async_op=True))  # fmt: skip
                else:
                    f8.full8.untyped_storage().resize_(b.numel)
                    u.works.append(f8.start(self.gather_group, record))
            self.gathered_bytes = self._held()
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            u.gathered = True
        if wait:
            for w in u.works:
                if w is not None:
                    w.wait()
            u.works = []

    def _free(self, u: Unit):
        if not u.gathered:
            return
        self._gather(u, wait=True)  # never release storage a collective still writes
        for b in u.buckets:
            self.full[b].untyped_storage().resize_(0)
            if b in self._fp8:
                self._fp8[b].full8.untyped_storage().resize_(0)
                self._fp8[b].release()
        self.gathered_bytes = self._held()
        u.gathered = False

    def free_all(self):
        for u in self.units:
            self._free(u)

    def _plan_keeps(self, n_chunks: int):
        """The units carried over from one micro-batch (and step) to the next (carried_units),
        and the outer unit kept from its forward to its backward when it is carried."""
        first = [u for u in self.units if u.chunk == 0]
        keys = [(u.key, any(b in self._fp8 for b in u.buckets)) for u in first]
        carried = carried_units(keys, n_chunks, self.reshard)
        self._carry = [u for u in first if u.key in carried]
        self._keep_forward = {u for u in self._carry if u.name == "outer"}
        self._prefetched = list(self._carry)  # (built whole: these stay gathered)

    def _hook(self, chunks):
        per_chunk = [[u for u in self.units if u.chunk == c] for c in range(len(chunks))]
        for order in per_chunk:
            for i, u in enumerate(order):
                nxt = order[i + 1] if i + 1 < len(order) else None
                # backward runs the units in reverse; the outer unit's (the loss, the head) first
                prev = order[i - 1] if i > 0 else None
                if u.name == "outer" and len(order) > 1:
                    prev = order[-1]
                u.module.register_forward_pre_hook(self._pre_forward(u, nxt))
                u.module.register_forward_hook(self._post_forward(u, prev))

    def _pre_forward(self, u: Unit, nxt: Unit | None):
        def hook(module, args):
            self._gather(u)
            if nxt is not None:
                self._gather(nxt, wait=False)  # overlaps this unit's forward

        return hook

    def _post_forward(self, u: Unit, prev: Unit | None):
        def hook(module, args, output):
            training = torch.is_grad_enabled()
            if training:
                outs = output if isinstance(output, (tuple, list)) else (output,)
                for t in outs:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._pre_backward(u, prev))
            if not training or (self.reshard == "forward" and u not in self._keep_forward):
                self._free(u)

        return hook

    def _pre_backward(self, u: Unit, prev: Unit | None):
        def hook(grad):
            self._gather(u)
            if prev is not None and self.reshard == "forward":
                self._gather(prev, wait=False)  # backward runs the units in reverse

        return hook

    def _launched(self, b: Bucket, more: bool):
        """Bucket `b`'s reduce-scatter has started: once all the unit's have, its backward is
        over for this micro-batch, and it is freed unless kept (`more`: another micro-batch
        follows, whose forward reads the carried units first)."""
        u = self._unit_of[b]
        u.reduced += 1
        if u.reduced == len(u.buckets):
            u.reduced = 0
            if self.reshard != "step" and not (more and u in self._carry):
                self._free(u)

    # ---- the step and the optimizer's interface -------------------------------------------

    staged_bytes = from_reducer("staged_bytes")  # gradient buckets staged now (no buffer)
    peak_staged_bytes = from_reducer("peak_staged_bytes")  # the most staged at once so far

    def zero_grad(self, microbatches: int):
        self.reducer.zero_grad(microbatches)
        for u in self.units:
            u.reduced = 0
            if u not in self._prefetched:  # (those hold the shards of the last update)
                self._free(u)  # kept from an evaluation or a checkpoint: gathered afresh
        self.peak_gathered_bytes = self.gathered_bytes

    def finish(self):
        self.reducer.finish()
        self.free_all()  # the step changes the shards: every unit is gathered afresh
        self._prefetched = []

    def group_of(self, b: Bucket) -> Group:
        return self.dp

    def param_shard(self, b: Bucket) -> torch.Tensor:
        return self.shards[b]

    def saves(self, b: Bucket) -> bool:
        return saves(b, self.dp, self.shard_copies)

    def gather_shards(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full-bucket tensors from this rank's per-bucket shards (collective over DP)."""
        return gather_shards(self.buckets, shards, self.dp)

    def all_gather_params(self, overlap: bool = False):
        """After the optimizer step: start gathering the units the next forward reads first
        (`_carry`), so the step's first forward finds them landed. Every other unit is gathered
        where it is used."""
        for u in self._carry:
            self._gather(u, wait=False)
        self._prefetched = list(self._carry)

    def wait_params(self):
        """Wait for the step's prefetch and free it: whoever calls this reads or writes the
        shards (checkpoints), and the next forward gathers afresh."""
        for u in self._prefetched:
            self._free(u)
        self._prefetched = []

    @contextmanager
    def gathered(self, write_back: bool = False):
        """Every parameter whole in the block (checkpoints, tests); with `write_back` what the
        block wrote into the parameters becomes this rank's shards. Collective over DP."""
        self.free_all()  # (FP8 weights: gathered whole here, in their high precision)
        for u in self.units:
            self._gather(u, wait=False, whole=True)
        for u in self.units:
            self._gather(u)
        try:
            yield
            if write_back:
                with torch.no_grad():
                    for b in self.buckets:
                        lo, hi = b.dp_start - b.start, b.shard_end - b.start
                        self.shards[b].copy_(self.full[b][lo:hi])
        finally:
            self.free_all()

    def memory_bytes(self) -> dict:
        """Bytes this rank holds: its parameter shards, the most parameter bytes it held
        gathered at once in the step, and its gradient shards."""
        return {"param_bytes": nbytes(self.shards.values()),
                "param_gathered_peak_bytes": self.peak_gathered_bytes,
                "grad_bytes": nbytes(b.shard_grad for b in self.buckets)}  # fmt: skip
