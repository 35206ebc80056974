"""A backward in two halves, for zero-bubble schedules: I (the input gradient, which the
previous stage waits for) now, W (the weight gradients) later.

The autograd graph of a stage is cut where the gradient towards the input meets the parameters:
the *intermediate* nodes are those on the path from the input to the output that also lead to a
parameter (a matmul computes both dX and dW; a norm both dX and dweight). I runs backward from
the output to the input only, keeping the graph, and records the gradient arriving at each
intermediate node (a pre-hook); nothing flows to the parameters. W later starts from those
recorded gradients at the intermediates and runs to the parameters only, so no input gradient
is computed twice (but on the path between two depths where one weight is used at both, as
the MTP modules' shared embedding: W runs it again, with the parameters there in the same
pass). Parameters whose intermediates overlap are done together. W accumulates into `.grad`
like any backward, so gradient hooks (the data-parallel buckets) fire then.
(torch.distributed.pipelining does the same split; this is a small version of the idea.)
"""

from collections import defaultdict, deque

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge


def _node(t: torch.Tensor):
    """The autograd node that receives t's gradient (a leaf's accumulator, made on demand)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _reachable(starts, edges, stop=()):
    """Nodes reachable from `starts` along `edges` (node -> nodes), not entering `stop`; and
    the `stop` nodes that were hit."""
    seen, hit, queue = set(starts), set(), deque(starts)
    while queue:
        for nxt in edges.get(queue.popleft(), ()):
            if nxt in stop:
                hit.add(nxt)
            elif nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return seen, hit


def _run(tensors, grads, inputs, keep_graph: bool):
    """Backward from `tensors` (tensors or gradient edges) into the `.grad` of `inputs` only.
    The engine call accepts a released output (empty storage: the executor frees sent outputs)."""
    Variable._execution_engine.run_backward(
        tensors=tuple(tensors), grad_tensors=tuple(grads), keep_graph=keep_graph,
        create_graph=False, inputs=tuple(inputs), allow_unreachable=True, accumulate_grad=True,
    )  # fmt: skip


def input_grad(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor, params):
    """I: x.grad from out's gradient `grad` (None: out is a scalar loss); returns W, a function
    that computes the parameters' gradients later (once)."""
    root = out.grad_fn
    params = [p for p in params if p.requires_grad]
    if root is None or not params:  # nothing for W: a chunk of 0 layers returns its input
        _run([out], [torch.ones_like(out) if grad is None else grad], [x], keep_graph=False)
        return lambda: None
    # the graph from the output down, and the reverse edges (node -> the nodes that feed it)
    down, up, queue = {}, defaultdict(list), deque([root])
    seen = {root}
    while queue:
        n = queue.popleft()
        down[n] = [f for f, _ in n.next_functions if f is not None]
        for f in down[n]:
            up[f].append(n)
            if f not in seen:
                seen.add(f)
                queue.append(f)
    on_path, _ = _reachable([_node(x)], up)  # between the input and the output
    groups = {}  # intermediate node -> its group {"params", "nodes"}

    def join(group, nodes):
        """`group` takes in `nodes` and the groups they are intermediates of."""
        for n in nodes:
            other = groups.get(n)
            if other is not None and other is not group:
                group["params"].update(other["params"])
                group["nodes"] |= other["nodes"]
                for m in other["nodes"]:
                    groups[m] = group
            groups[n] = group

    spans = []  # (a parameter's intermediates, the path's nodes between them)
    for p in params:
        _, hit = _reachable([_node(p)], up, stop=on_path)
        group = {"params": {id(p): p}, "nodes": set(hit)}
        join(group, hit)  # parameters sharing an intermediate are one group
        if len(hit) > 1:
            spans.append(hit)
    # A parameter used at two depths of the path (a weight shared by the MTP modules) has W
    # run the path's nodes from its upper intermediate down to its lower one: the groups with
    # an intermediate there, or running a node of it too, join it, so that no node runs in two
    # W passes (the first would free what the second needs)
    if spans:
        path_down = {n: [f for f in fs if f in on_path] for n, fs in down.items() if n in on_path}
        path_up = {n: [f for f in fs if f in on_path] for n, fs in up.items() if n in on_path}
        claimed = {}  # path node -> an intermediate of the group whose W runs it
        for hit in spans:
            below, _ = _reachable(list(hit), path_down)
            above, _ = _reachable(list(hit), path_up)
            between, rep = below & above, next(iter(hit))
            join(groups[rep], [n for n in between if n in groups]
                 + [claimed[n] for n in between if n in claimed])  # fmt: skip
            claimed.update((n, rep) for n in between)
    saved, handles = {}, []
    for n in groups:
        handles.append(n.register_prehook(lambda grads, n=n: saved.__setitem__(n, grads)))
    try:
        _run([out], [torch.ones_like(out) if grad is None else grad], [x], keep_graph=True)
    finally:
        for h in handles:
            h.remove()
    unique = list({id(g): g for g in groups.values()}.values())

    def weights():
        for group in unique:
            nodes = [n for n in group["nodes"] if n in saved]
            edges = [(GradientEdge(n, i), g) for n in nodes for i, g in enumerate(saved[n])
                     if g is not None]  # fmt: skip
            if not edges:
                continue
            # with several intermediates, one may lie below another: the gradient it recorded
            # is already its whole gradient, so what flows into it now is replaced by that
            clamps = [n.register_prehook(lambda grads, n=n: saved[n]) for n in nodes]
            try:
                _run([e for e, _ in edges], [g for _, g in edges], group["params"].values(), False)
            finally:
                for h in clamps:
                    h.remove()
        saved.clear()

    return weights
