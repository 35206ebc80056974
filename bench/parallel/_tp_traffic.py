"""What bench_tp.py counts of each side's TP traffic besides the bytes on the wire: torch's
functional collectives, seen by a dispatch mode (`CollectiveCounter`), and megalite's
`CommLedger`, each collective attributed to the module that issued it (`ledger_by_origin`).
Both book bus bytes per rank by the same ring convention, so the two sides compare."""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.parallel import comm

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class CollectiveCounter(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (op -> [calls, bus bytes per rank]),
    with the ring bus-byte convention of megalite's ledger; like CommDebugMode it also sees the
    collectives issued inside DTensor's own dispatch (loss_parallel, redistributions)."""

    def __init__(self):
        super().__init__()
        self.by = defaultdict(lambda: [0, 0, set()])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            # as CommDebugMode does: let DTensor desugar the op into local ops and
            # collectives first; they come back through this mode
            return NotImplemented
        ns, _, op = func._overloadpacket._qualified_op_name.partition("::")
        if ns == "_c10d_functional" and op.startswith(COLLECTIVES):
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            n = dist.get_world_size()
            nbytes = t.numel() * t.element_size()
            if op.startswith("all_reduce"):
                bus = 2 * (n - 1) / n * nbytes
            elif op.startswith("all_gather"):
                bus = (n - 1) * nbytes  # input is one rank's piece
            elif op.startswith("reduce_scatter"):
                bus = (n - 1) / n * nbytes
            else:
                bus = nbytes
            self.by[op][0] += 1
            self.by[op][1] += int(bus)
            self.by[op][2].add(int(bus))
        return func(*args, **(kwargs or {}))


def ledger_by_origin(step, groups, batch, lr: float):
    """One step with every counted TP collective attributed to where it was issued: the
    embedding, a layer (forward and backward, through module hooks), outside any module (the
    head's entry into the TP region, the vocab-parallel loss) or the optimizer."""
    stack = ["head entry + loss (outside modules)"]
    by = defaultdict(list)
    real = comm._record

    def record(group, nbytes, t0):
        real(group, nbytes, t0)
        if group.kind == "tp":
            by[stack[-1]].append(int(nbytes))

    model = step.model
    mods = {"embedding": model.embedding.word, "final norm": model.final_norm}
    mods.update({f"layer {i}": layer for i, layer in model.layers.items()})

    def push(label):
        def hook(*_):
            stack.append(label)  # a hook returning None leaves outputs and gradients alone

        return hook

    def pop(*_):
        stack.pop()

    handles = []
    for label, mod in mods.items():
        handles += [mod.register_forward_pre_hook(push(label)), mod.register_forward_hook(pop)]
        if label == "embedding":
            continue
        handles += [
            mod.register_full_backward_pre_hook(push(label)),
            mod.register_full_backward_hook(pop),
        ]

    # The embedding's inputs (token ids) need no gradient, so its full backward hook would fire
    # before its backward ran: its backward is instead the rest of a micro-batch's backward,
    # from the gradient reaching its output to the next forward (or the optimizer).
    def embedding_backward(*_):
        stack.append("embedding (backward)")

    def leave_embedding_backward(*_):
        if stack[-1] == "embedding (backward)":
            stack.pop()

    emb = mods["embedding"]
    handles += [
        emb.register_full_backward_pre_hook(embedding_backward),
        emb.register_forward_pre_hook(leave_embedding_backward, prepend=True),
    ]
    comm._record = record
    groups.ledger.reset()
    try:
        step.backward(batch)
        leave_embedding_backward()
        stack.append("optimizer (grad_sync_tp)")
        step.opt.step(lr)
    finally:
        comm._record = real
        for h in handles:
            h.remove()
    return {"total": groups.ledger.snapshot(), "by": {k: v for k, v in by.items()}}
