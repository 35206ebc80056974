"""A mixture-of-experts layer in place of the MLP: router, expert dispatch, grouped experts.

Shapes: b micro-batch, s sequence (s/t on this rank), h hidden, E experts (E/ep on this rank),
k experts per token, f expert width. T = this rank's tokens: each TP rank routes its own 1/t of
the sequence (its sequence-parallel rows, or its slice of the replicated (b, s, h) input,
gathered back afterwards), so no token is routed twice; the ranks holding the same sequence
(`seq`: tp, later tp+cp) agree on whatever the layer computes over a whole sequence (the
load-balancing loss, the capacity).

- Router: fp32 logits (T, E) = x W_r^T (+ b_r with `features.moe_bias`, gpt-oss), then the
  scores, the top-k choice and the weights of model/routing.py (`Routing`: softmax or sigmoid,
  the auxiliary-loss-free expert bias of DeepSeek-V3, node-limited groups, renormalised top-k,
  a scaling factor). Its weight is replicated; each TP rank sees only its tokens, so the
  gradient is summed over TP.
- Losses (fp32): Switch/GShard load balancing  coeff E sum_e f_e P_e  (f_e: the share of the
  sequence group's assignments routed to e, P_e: its mean router probability), and the router
  z-loss  coeff mean_t logsumexp(logits_t)^2. Each rank computes its tokens' share, so the sum
  over `seq` is the loss of the micro-batch. They join the training loss through
  `_AttachLoss`: identity on the layer's output forward, the losses' gradient (times the scale
  of the main loss, loss_scale / micro-batches, which the trainer hands in for the step with
  `aux_loss_scale`) added in backward, so every pipeline stage back-propagates its own layers'
  losses with no executor change.
- Capacity (--moe-expert-capacity-factor c; dropless without it): each expert of a sequence
  group takes at most ceil(c T_seq k / E) assignments; the drop policy "position" keeps first
  choices before second ones, and within a choice earlier sequence positions first (the same
  assignments in every layout). A dropped assignment contributes nothing (the residual and the
  shared expert still pass the token on).
- Experts: all local experts in two or three grouped GEMMs (`ops.grouped_mm`) over the
  assignments sorted by expert; dispatch and combine over ep in parallel/expert_parallel.py.
  Expert weights are (E/ep, out, in), split over "ep" along dim 0, named by global expert
  (`layers.{i}.mlp.experts.gate_up.weight` (E, 2f, h): gate rows then up rows; without a gated MLP
  `experts.up.weight` (E, f, h); `experts.down.weight` (E, h, f)). With `features.moe_bias`
  (gpt-oss) each has a bias, `experts.gate_up.bias` (E, 2f) and `experts.down.bias` (E, h),
  and `features.clamped_swiglu` makes the activation gpt-oss's (`clamped_swiglu`).
  With etp > 1 (--expert-tensor-parallel-size) they are also cut over "etp" (specs.Cut):
  fc1 column-parallel (f/etp of the gate rows and of the up rows), fc2 row-parallel (f/etp
  columns); combine sums the partial outputs. The router stays replicated.
"""

import math
from collections import deque
from contextlib import contextmanager

import torch
import torch.nn as nn

from megalite.config import ModelConfig
from megalite.model.env import LayerEnv
from megalite.model.routing import Routing
from megalite.parallel import comm, expert_parallel
from megalite.parallel.comm import Group
from megalite.parallel.specs import Cut, mark, spec_of
from megalite.parallel.tensor_parallel import shard_spec

STATS = 4  # per layer after the E loads: aux loss, z-loss, dropped assignments, passes
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope in its clamped SwiGLU


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: (up + 1) g sigmoid(1.702 g), with g = gate clamped above at
    `limit` and up clamped to [-limit, limit]."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)


# The gradient the auxiliary losses get in backward (outside `aux_loss_scale`: 1.0).
_aux_scale = 1.0


@contextmanager
def aux_loss_scale(scale: float):
    """In the block, the auxiliary losses that forward attaches get the gradient `scale` in
    backward: the main loss's, loss_scale / micro-batches. Whoever runs a step's forward and
    backward (the trainer) wraps them in it, as Megatron's MoEAuxLossAutoScaler is told its
    scale; the layers read it when they attach their losses (recompute too, inside the block)."""
    global _aux_scale
    old, _aux_scale = _aux_scale, float(scale)
    try:
        yield
    finally:
        _aux_scale = old


class _AttachLoss(torch.autograd.Function):
    """y = x forward; backward passes x's gradient through and gives `loss` the gradient
    `scale` (what backward of the main loss gives it: loss_scale / micro-batches)."""

    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.scale, ctx.dtype = scale, loss.dtype
        return x

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=ctx.dtype, device=g.device), None


def _checkpoint_phase() -> str | None:
    """ "forward" in the first pass of a torch.utils.checkpoint region, "recompute" in its
    replay during backward, None elsewhere: the saved-tensor hooks checkpoint installs say which."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    name = getattr(hooks[0], "__qualname__", "") if hooks else ""
    if name.startswith("_checkpoint_hook"):
        return "forward"
    if name.startswith("_recomputation_hook"):
        return "recompute"
    return None


class _Weight(nn.Module):
    """Holds one stacked expert weight (and bias), so its logical name ends in `.weight`."""

    def __init__(self, w: nn.Parameter, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = w, bias


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv, shared: nn.Module | None = None):
        """The experts are spread over `env.experts` (ProcessGroups.experts: ep, and etp when
        each is cut too); `shared`: the shared expert (an MLP), or None."""
        super().__init__()
        tp, ep = env.tp, env.experts
        self.tp, self.ep, self.ops, self.shared = tp, ep, env.ops, shared
        self.sequence_parallel = env.sequence_parallel
        self.seq = tp  # the ranks that hold one sequence between them
        e, h, f, etp = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn, ep.etp
        if f % etp:
            raise ValueError(f"moe_ffn_hidden_size={f} is not divisible by etp={etp}")
        if etp > 1 and cfg.features.moe_bias:
            raise ValueError("expert biases (gpt-oss) do not run with etp > 1")
        self.f = f // etp  # this rank's slice of each expert's width
        self.e, self.k, self.gated = e, cfg.moe_router_topk, cfg.features.gated_mlp
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.bias_rate = cfg.moe_router_bias_update_rate
        self.routing = Routing.of(cfg)
        self.clamp = cfg.swiglu_limit if cfg.features.clamped_swiglu else None
        self.gelu_kw = cfg.features.gelu_kwargs
        biased = cfg.features.moe_bias
        kw = env.tensor_kw
        self.router = nn.Module()
        self.router.weight = mark(nn.Parameter(torch.empty(e, h, **kw)),
                                  **shard_spec(tp, None, partial_grad=True))  # fmt: skip
        self.router.bias = None
        if biased:
            spec = shard_spec(tp, None, partial_grad=True, no_weight_decay=True)
            self.router.bias = mark(nn.Parameter(torch.zeros(e, **kw)), **spec)
        if e % ep.ep:
            raise ValueError(f"num_experts={e} is not divisible by ep={ep.ep}")
        local = e // ep.ep
        split = {"split_dim": 0, "split_axis": "ep", "split_size": ep.ep, "split_index": ep.ep_rank}
        parts = 2 if self.gated else 1  # gate and up rows, or up alone
        self.experts = nn.Module()
        name = "gate_up" if self.gated else "up"
        # Over etp: fc1 column-parallel (this rank's slice of the gate rows and of the up rows),
        # fc2 row-parallel (the same slice of its input columns; partial sums, added in combine).
        cut1 = {"cut": Cut(1, etp, ep.etp_rank, parts)} if etp > 1 else {}
        cut2 = {"cut": Cut(2, etp, ep.etp_rank)} if etp > 1 else {}
        w1 = mark(nn.Parameter(torch.empty(local, parts * self.f, h, **kw)), **split, **cut1)
        w2 = mark(nn.Parameter(torch.empty(local, h, self.f, **kw)), **split, **cut2)
        first = parts * f
        b1 = b2 = None
        if biased:  # one row per expert, split over ep like the weights
            b1 = mark(nn.Parameter(torch.zeros(local, first, **kw)), **split, no_weight_decay=True)
            b2 = mark(nn.Parameter(torch.zeros(local, h, **kw)), **split, no_weight_decay=True)
        setattr(self.experts, name, _Weight(w1, b1))
        self.experts.down = _Weight(w2, b2)
        device = kw["device"]
        stat_kw = {"dtype": torch.float64, "device": device}
        # Running sums since moe_stats() last read them: loads (E,), aux, z, dropped, passes.
        self.register_buffer("stats", torch.zeros(e + STATS, **stat_kw), persistent=False)
        # Auxiliary-loss-free balancing: a bias on the top-k choice, and the step's loads.
        # Not in state_dict: checkpoints name it themselves (expert_biases), whole.
        bias = cfg.moe_router_enable_expert_bias
        zeros = torch.zeros(e, dtype=torch.float32, device=device) if bias else None
        self.register_buffer("expert_bias", zeros, persistent=False)
        zeros = torch.zeros(e, **stat_kw) if bias else None
        self.register_buffer("step_load", zeros, persistent=False)
        # Routing decisions of checkpointed forwards, oldest first, for their recomputation
        # (micro-batches are recomputed in the order they ran forward).
        self._kept = deque()

    # ---- routing ------------------------------------------------------------------------------

    def route(self, tokens: torch.Tensor):
        """tokens (T, h) -> logits and probabilities (T, E), expert indices (T, k), weights
        (T, k); in fp32 at least, whatever the model's precision."""
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        logits = self.ops.linear(tokens.to(dtype), self.router.weight.to(dtype))
        if self.router.bias is not None:
            logits = logits + self.router.bias.to(dtype)
        probs = self.routing.scores(logits)
        top = self.routing.choose(probs, self.expert_bias)  # (T, k)
        return logits, probs, top, self.routing.weights(probs, top)

    def _capacity_keep(self, top: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """(T, k) bool: the assignments within capacity (drop policy "position": choice j
        before j + 1, then sequence position, then the row of the micro-batch; the TP ranks
        hold consecutive positions, so ranks before this one come first)."""
        k, e, seq = self.k, self.e, self.seq
        idx = top.view(b, s, k).permute(2, 1, 0).reshape(k, s * b)  # priority order
        onehot = torch.zeros(k, s * b, e, dtype=torch.int64, device=top.device)
        onehot.scatter_(2, idx.unsqueeze(-1), 1)
        mine = onehot.sum(1)  # (k, E)
        every = mine.new_empty(seq.size * k, e)
        comm.all_gather(every, mine, seq)
        every = every.view(seq.size, k, e)
        total = every.sum(0)
        start = total.cumsum(0) - total + every[: seq.rank].sum(0)  # (k, E) ahead of my rows
        pos = (onehot.cumsum(1) - onehot).gather(2, idx.unsqueeze(-1)).squeeze(-1)  # (k, s*b)
        capacity = math.ceil(self.capacity_factor * s * b * seq.size * k / e)
        keep = start.gather(1, idx) + pos < capacity  # (k, s*b)
        return keep.view(k, s, b).permute(2, 1, 0).reshape(b * s, k)

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, x, fused: bool = True):
        """x (b, s, h), or (b, s/t, h) with sequence parallelism -> the same shape. `fused` is
        False for inference with a KV cache: every TP rank then routes the whole input, and no
        assignment is dropped (a capacity per decode step of one token per row would drop by
        the batch's choices, and each TP rank would count every token)."""
        split = self.tp.size > 1 and not self.sequence_parallel and fused  # whole rows on each rank
        out = self._routed(x, split, dropless=not fused)
        if self.shared is not None:
            out = out + self.shared(x, fused=fused)
        return out

    def _routed(self, x: torch.Tensor, split: bool, dropless: bool = False) -> torch.Tensor:
        if split:  # this TP rank's 1/t of the sequence; gathered back at the end
            x = comm.scatter_to_group(x, self.tp, dim=1)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)  # (T, h)
        t, k, e = b * s, self.k, self.e
        logits, probs, top, w = self.route(tokens)
        training = self.training and torch.is_grad_enabled()
        dropping = self.capacity_factor is not None and not dropless
        # Full recompute replays this forward in backward: the routing decided in the first
        # pass (capacity and the dispatch plan: an all-gather and a host read) is kept for it.
        phase = _checkpoint_phase() if training else None
        kept = self._kept.popleft() if phase == "recompute" and self._kept else None
        keep = kept[0] if kept else (self._capacity_keep(top, b, s) if dropping else None)
        # Assignments a = token * k + choice, sorted by expert (dropped ones last, as expert E).
        key = top.reshape(-1) if keep is None else top.masked_fill(~keep, e).reshape(-1)
        order = torch.sort(key, stable=True).indices  # (T k,)
        counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        p = kept[1] if kept else expert_parallel.plan(counts[:e], self.ep, t * k, dropping)
        if phase == "forward":
            self._kept.append((keep, p))
        # Each token repeated k times, then permuted: a gather by a permutation, whose backward
        # (a scatter of distinct rows, then the sum over k) is deterministic.
        rows = tokens.unsqueeze(1).expand(t, k, h).reshape(t * k, h).index_select(0, order)
        local = expert_parallel.dispatch(rows[: p.n_send], p, self.ep)  # (n_recv, h)
        y = self._experts(local, p.offsets)
        back = expert_parallel.combine(y, p, self.ep)  # (n_send, h)
        if p.n_send < t * k:  # dropped assignments come back as zeros
            back = torch.cat([back, back.new_zeros(t * k - p.n_send, h)])
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(t * k, device=x.device)
        wk = w if keep is None else w * keep
        out = (back.index_select(0, unsort).view(t, k, h) * wk.unsqueeze(-1).to(back.dtype)).sum(1)
        out = out.view(b, s, h)
        if training:
            out = self._account(out, logits, probs, top, counts, t)
        return comm.gather_from_group(out, self.tp, dim=1) if split else out

    def _experts(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (n, h) sorted by local expert, offsets (E_local + 1,) -> (n, h)."""
        expert = None  # (n,) each row's local expert, for the biases
        if self.experts.down.bias is not None:
            rows = torch.arange(x.shape[0], device=x.device)
            expert = torch.searchsorted(offsets[1:], rows, right=True)  # on the device

        def mm(inp, w: _Weight):
            y = self.ops.grouped_mm(inp, w.weight, offsets)
            return y if w.bias is None else y + w.bias.index_select(0, expert)

        if self.gated:
            gate_up = mm(x, self.experts.gate_up)  # (n, 2f)
            gate, up = gate_up[:, : self.f], gate_up[:, self.f :]
            if self.clamp is None:
                y = self.ops.swiglu(gate, up)
            else:
                y = clamped_swiglu(gate, up, self.clamp)
        else:
            y = self.ops.gelu(mm(x, self.experts.up), **self.gelu_kw)  # (n, f)
        return mm(y, self.experts.down)

    def _account(self, out, logits, probs, top, counts, t: int):
        """Auxiliary losses attached to `out`, and the running statistics (all on the device)."""
        e, k, seq = self.e, self.k, self.seq
        n_seq = t * seq.size  # tokens of the sequence group
        load = torch.zeros(e, dtype=torch.float32, device=out.device)
        load.scatter_add_(0, top.reshape(-1), torch.ones(top.numel(), device=out.device))
        aux = z = torch.zeros((), dtype=probs.dtype, device=out.device)
        if self.aux_coeff:
            group_load = load.clone()
            comm.all_reduce(group_load, seq)  # f_e over the whole sequence group
            # P_e from the scores over all experts, whatever the top-k saw
            p_e = self.routing.aux_probs(probs).sum(0)
            aux = self.aux_coeff * e / (k * n_seq * n_seq) * (p_e * group_load).sum()
        if self.z_coeff:
            z = self.z_coeff * torch.logsumexp(logits, -1).square().sum() / n_seq
        if self.aux_coeff or self.z_coeff:
            out = _AttachLoss.apply(out, aux + z, _aux_scale)
        with torch.no_grad():
            dropped = top.numel() - counts[:e].sum()
            passes = torch.full((), 1.0 / seq.size, dtype=torch.float64, device=out.device)
            extra = torch.stack([aux.detach().double(), z.detach().double(), dropped.double(),
                                 passes])  # fmt: skip
            self.stats += torch.cat([load.double(), extra])
            if self.expert_bias is not None:
                self.step_load += load
        return out


def moe_layers(chunks):
    """(global layer index, MoELayer) of these chunks: the model's layers, then the MTP
    modules' (module k as layer num_layers + k, DeepSeek-V3's numbering)."""
    for chunk in chunks:
        for name, layer in getattr(chunk, "layers", {}).items():
            if isinstance(getattr(layer, "mlp", None), MoELayer):
                yield int(name), layer.mlp
        for k, module in getattr(chunk, "mtp", {}).items():
            if isinstance(getattr(module.layer, "mlp", None), MoELayer):
                yield chunk.cfg.num_layers + int(k), module.layer.mlp


def _table_rows(chunks, num_layers: int) -> int:
    """Rows of the per-layer tables reduced over the world: the layers, then the MTP modules."""
    return num_layers + chunks[0].cfg.mtp_num_layers


def expert_biases(chunks):
    """(logical name, (E,) fp32 buffer) of the expert biases of these chunks, named after the
    layer (layers.{i}.mlp.expert_bias, mtp.{k}.layer.mlp.expert_bias). A buffer, not a
    parameter (no gradient, no optimizer state), whole and equal on every rank holding the
    layer: checkpoints hold it beside the weights."""
    for _, m in moe_layers(chunks):
        if m.expert_bias is not None:
            layer = spec_of(m.router.weight).name.removesuffix("router.weight")
            yield layer + "expert_bias", m.expert_bias


@torch.no_grad()
def update_expert_bias(chunks, world: Group, num_layers: int):
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every expert bias moves by
    the update rate towards balance, b_e += u sign(mean load - load_e), from the step's loads
    summed over every rank holding the layer. One all-reduce of (layers + MTP, E) over the world
    (each rank fills its own layers' rows), on the device: no host read. A rank whose stage
    holds no MoE layer (--moe-layer-freq) enters it too, with zero rows: the others wait for it."""
    layers = [(i, m) for i, m in moe_layers(chunks) if m.expert_bias is not None]
    e = layers[0][1].e if layers else chunks[0].cfg.num_experts
    device = layers[0][1].stats.device if layers else world.device
    loads = torch.zeros(_table_rows(chunks, num_layers), e, dtype=torch.float64, device=device)
    for i, m in layers:
        loads[i] = m.step_load
        m.step_load.zero_()
    comm.all_reduce(loads, world)
    for i, m in layers:
        m.expert_bias += m.bias_rate * torch.sign(loads[i].mean() - loads[i]).float()


def moe_metrics(chunks, world: Group, num_layers: int, num_experts: int) -> dict:
    """What a logging step reports of the MoE layers since the last call: per layer the load
    (share of the assignments each expert got, before drops), and over all layers the mean
    load-balancing and z losses per micro-batch, the dropped share and the worst imbalance
    (max load / mean load). One all-reduce over the world and one host read: call it on
    logging steps only, on every rank. The running sums restart."""
    layers = dict(moe_layers(chunks))
    device = next((m.stats.device for m in layers.values()), world.device)
    rows = _table_rows(chunks, num_layers)
    table = torch.zeros(rows, num_experts + STATS, dtype=torch.float64, device=device)
    for i, m in layers.items():
        table[i] = m.stats
        m.stats.zero_()
    comm.all_reduce(table, world)
    ran = [(i, r) for i, r in enumerate(table.tolist()) if r[-1] > 0]  # MoE layers that ran
    if not ran:
        return {}
    rows = [r for _, r in ran]
    loads = [r[:num_experts] for r in rows]
    total = [sum(x) or 1.0 for x in loads]
    passes = sum(r[-1] for r in rows)
    return {
        "moe_aux_loss": sum(r[num_experts] for r in rows) / passes,
        "moe_z_loss": sum(r[num_experts + 1] for r in rows) / passes,
        "moe_dropped_share": sum(r[num_experts + 2] for r in rows) / sum(total),
        "moe_load_imbalance": max(max(x) * num_experts / t for x, t in zip(loads, total)),
        "moe_load": {
            str(i): [round(v / t, 4) for v in x] for (i, _), x, t in zip(ran, loads, total)
        },
    }
