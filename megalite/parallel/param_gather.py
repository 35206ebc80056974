"""Waiting for the overlapped parameter all-gather (ZeRO-1/2 with --overlap-param-gather)
right before each parameter is read, in forward order.

Each parameter's gather is waited for right before it is read, in gather (forward)
order: every called module waits, in a pre-hook, for the buckets of its subtree (a
layer, the embedding; the MoE layer for its `router`), the chunk for its own
parameters. The parameters of plain `nn.Module` containers (the untied head `output`)
are read by an owner that no hook sees (the chunk, after its final norm): such a
container waits when the parameter is read from it (`GatheredOnRead`). A wait for
them in the chunk's pre-hook would make the embedding wait for the head's gather, the
last launched, and so for every gather (no overlap at all).
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
        for name, module in chunk.named_modules():
            if name and _called(module) and (bs := buckets(module.parameters())):
                module.register_forward_pre_hook(wait(bs))
            elif name and type(module) in (nn.Module, GatheredOnRead):
                owned = {n: buckets([p]) for n, p in module.named_parameters(recurse=False)}
                if any(owned.values()):  # (its own buckets: several buffers share a model)
                    module.__class__ = GatheredOnRead
                    gathers = module.__dict__.setdefault("_gathers", {})
                    for n, bs in owned.items():
                        gathers[n] = gathers.get(n, []) + bs
        if own := buckets(chunk.parameters(recurse=False)):
            chunk.register_forward_pre_hook(wait(own))


def _called(module: nn.Module) -> bool:
    """Whether a module is called by its parent's forward, as far as its type tells: plain
    `nn.Module`s and the list/dict containers only hold modules and parameters."""
    containers = (nn.ModuleDict, nn.ModuleList, nn.ParameterDict, nn.ParameterList)
    plain = type(module) in (nn.Module, GatheredOnRead)
    return not plain and not isinstance(module, containers)


class GatheredOnRead(nn.Module):
    """A plain container (no forward) whose parameters wait for their overlapped gather when
    they are read from it: its owner reads them itself, where no module hook sees it."""

    def __getattr__(self, name):
        gathers = self.__dict__.get("_gathers")
        if gathers and gathers.get(name):
            wait_gathers(gathers[name])
        return super().__getattr__(name)


def wait_gathers(buckets):
    for b in buckets:
        if b.gather is not None:
            b.gather[0].wait()
            b.gather = None
