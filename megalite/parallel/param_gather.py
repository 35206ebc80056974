"""Waiting for the overlapped parameter all-gather (ZeRO-1/2 with --overlap-param-gather)
right before each parameter is read, in forward order.

Each parameter's gather is waited for right before it is read, in gather (forward) order: every
called module waits, in a forward pre-hook, for the buckets of its subtree (a layer, the
embedding, the head; the MoE layer for its `router`). A parameter that no called module holds
(the chunk's own, or one of a plain `nn.Module` container the chunk reads itself) is waited for
in the chunk's pre-hook, before anything runs: correct, but not overlapped. The model keeps
such reads away (the head is a module of its own, model/gpt.py `Output`): a wait for the head
in the chunk's pre-hook would make the embedding wait for the head's gather, the last
launched, and so for every gather (no overlap at all). Nothing changes a module's class.
"""

from torch import nn


def wait_before_use(chunks: list[nn.Module], bucket_of: dict, order: dict):
    """Hook every chunk so a bucket's gather is waited for where its parameters are first read.
    `bucket_of`: parameter -> its bucket's Gather (`gather`: (work, ...) or None); `order`:
    bucket -> its place in forward order."""

    def buckets(params):
        return sorted({bucket_of[p] for p in params if p in bucket_of}, key=order.get)

    def wait(bs):
        def hook(module, args):
            wait_gathers(bs)

        return hook

    for chunk in chunks:
        seen = set()  # ids of the parameters a called module below the chunk waits for
        for name, module in chunk.named_modules():
            if name and _called(module):
                params = list(module.parameters())
                seen.update(map(id, params))
                if bs := buckets(params):
                    module.register_forward_pre_hook(wait(bs))
        if own := buckets(p for p in chunk.parameters() if id(p) not in seen):
            chunk.register_forward_pre_hook(wait(own))


def _called(module: nn.Module) -> bool:
    """Whether a module is called by its parent's forward, as far as its type tells: plain
    `nn.Module`s and the list/dict containers only hold modules and parameters."""
    containers = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)
    return type(module) is not nn.Module and not isinstance(module, containers)


def wait_gathers(buckets):
    for b in buckets:
        if b.gather is not None:
            b.gather[0].wait()
            b.gather = None
