"""What a rank holds beyond its parameters' state and the activations it keeps, walked with the
schedule (activations.peak_activations, `buffers=True`): the pipeline's p2p tensors
(`P2PBuffers`) and, while a backward runs, its working memory (`backward_working`).

The p2p tensors are what pipeline/executor.py keeps alive, counted for its rules:

- A receive's buffer exists from the batch that posts it; the input it becomes is counted with
  the chunk's activations (its first norm keeps it) from the forward until its backward.
- A send's tensor (a chunk's output, an input's gradient) exists from the action that makes it.
- A batch holds every tensor of its sends and receives until it is known complete: the executor
  waits for the oldest batch when a new one would be the (MAX_IN_FLIGHT + 1)-th, and for the rest
  at the end of the schedule.
- A received gradient is used by the backward (B, or I of a split backward); a received input
  is dropped with the activations, at B or at W.

Each such tensor is one hidden tensor (shape.hidden_shape in the run's precision).
"""

from collections import deque

from megalite.config import Config
from megalite.pipeline.actions import (
    COMM,
    MAX_IN_FLIGHT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    B,
    F,
    I,
    W,
)
from megalite.plan.memory import BYTES, chunk_specs, fp8_layer, fused_blocks, kv_features
from megalite.shape import RunShape

# what each send or receive holds: the tensor's name (a chunk's input or output, or the gradient)
HELD = {SEND_F: "out", SEND_B: "grad_in", RECV_F: "in", RECV_B: "grad_out"}


class P2PBuffers:
    """`step(kind, chunk, mb)` for each action in order; returns the bytes of p2p tensors alive
    after it that the activations do not count."""

    def __init__(self, steps, nbytes: float):
        self.nbytes = nbytes
        self.sends = {(k, c, m) for k, c, m in steps if k in (SEND_F, SEND_B)}
        self.holders = {}  # (name, chunk, mb) -> {"batch", "use"}
        self.counted = set()  # received inputs the activations count now
        self.batches = deque()
        self.comm = False  # the previous action was a send or a receive: the same batch
        self.uncounted = 0  # held keys the activations do not count (kept as they change)

    def _hold(self, key, holder):
        if key not in self.holders and key not in self.counted:
            self.uncounted += 1
        self.holders.setdefault(key, set()).add(holder)

    def _drop(self, key, holder):
        held = self.holders.get(key)
        if held is not None:
            held.discard(holder)
            if not held:
                del self.holders[key]
                self.uncounted -= key not in self.counted

    def _count(self, key, counted: bool):
        """The activations start (or stop) counting a received input."""
        if (key in self.counted) != counted and key in self.holders:
            self.uncounted += -1 if counted else 1
        (self.counted.add if counted else self.counted.discard)(key)

    def step(self, kind, c, m) -> float:
        if kind in COMM:
            if not self.comm:  # a new batch: the oldest completes first when too many are out
                if len(self.batches) >= MAX_IN_FLIGHT:
                    for key in self.batches.popleft():
                        self._drop(key, "batch")
                self.batches.append([])
            key = (HELD[kind], c, m)
            self.batches[-1].append(key)
            self._hold(key, "batch")
            if kind in (SEND_F, SEND_B):
                self._drop(key, "use")  # the outbox hands it to the batch
            else:
                self._hold(key, "use")
        elif kind == F:
            self._count(("in", c, m), True)
            if (SEND_F, c, m) in self.sends:
                self._hold(("out", c, m), "use")
        elif kind in (B, I):
            self._drop(("grad_out", c, m), "use")
            if (SEND_B, c, m) in self.sends:
                self._hold(("grad_in", c, m), "use")
        if kind in (B, W):
            self._count(("in", c, m), False)
            self._drop(("in", c, m), "use")
        self.comm = kind in COMM
        return self.nbytes * self.uncounted


def backward_working(cfg: Config, shape: RunShape, kw: dict) -> float:
    """Bytes one backward of this chunk holds on top of the kept activations, at its widest
    layer: the layer's weight gradients as autograd makes them, before the gradient buffer adds
    them in (one layer's parameters), and at the widest moment of its blocks the gradient of the
    block's widest activation (the MLP's or each expert's intermediate; attention's q/k/v) and,
    with sequence parallelism, a fused block's input gathered again, (b, s, h) (outside FP8:
    tensor_parallel._JoinedLinear); at the head, the logits' gradient and the output weight's;
    at the embedding its weight's (what a stage without layers holds: issue 47's fake world)."""
    m, t = cfg.model, cfg.training
    e, tp = BYTES[t.precision], shape.tp
    tokens = m.seq_length // shape.cp * t.micro_batch_size
    specs = chunk_specs(
        m, tp, **kw, sequence_parallel=shape.sequence_parallel, ep=shape.ep, etp=shape.etp
    )
    per_layer = {}
    for name, numel, _ in specs:
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + numel
    # q/k/v's gradient
    qkv = tokens * (m.num_attention_heads * m.head_dim // tp + 2 * kv_features(m, tp)) * e
    gathered = tokens * m.hidden_size * e if shape.sequence_parallel and tp > 1 else 0
    attention = int(not m.features.latent_attention)  # a fused block (fused_blocks)
    widest = 0.0
    for i, numel in per_layer.items():
        moe = m.is_moe_layer(i)
        if moe:  # each token's k assignments (tokens / tp on this rank, balanced)
            act = tokens / tp * m.moe_router_topk * m.moe_ffn
        else:
            act = tokens * m.ffn / tp
        regather = 0 if fp8_layer(cfg, m, i) else gathered
        mlp = act * e * (2 if m.features.gated_mlp else 1)
        mlp += regather * (fused_blocks(m, moe) - attention)  # gate/up (a shared expert's)
        attn = (qkv + regather) * attention
        widest = max(widest, numel * e + max(mlp, attn))
    vocab = m.padded_vocab_size(tp) // tp
    if kw["has_head"]:
        widest = max(widest, (tokens * vocab + vocab * m.hidden_size) * e)
        if t.kernels == "torch" and tp == 1:  # F.cross_entropy in fp32: the log-softmax's
            widest = max(widest, 2 * tokens * m.vocab_size * max(e, 4))  # and its input's grads
    if kw["has_embedding"]:  # the word embedding's gradient, and its output's (masked with TP)
        widest = max(widest, (vocab + tokens) * m.hidden_size * e)
    return widest


def forward_working(cfg: Config, shape: RunShape, kw: dict) -> float:
    """Bytes one forward of this chunk holds for a moment on top of what it keeps, at its widest
    layer: with sequence parallelism a fused block's all-gathered input, (b, s, h) (it keeps only
    its local rows: tensor_parallel._JoinedLinear; FP8 keeps it, counted as an activation), and
    the MLP's activation output before the down projection takes it (SwiGLU's silu(gate), GeLU's
    output; an expert's per routed token). The vocab-parallel loss streams its vocabulary (no
    fp32 logits). A backward's working memory (`backward_working`) is wider at every layer this
    counts; these show where a forward is the step's widest moment (a stage's first forwards)."""
    m, t = cfg.model, cfg.training
    e, tp = BYTES[t.precision], shape.tp
    tokens = m.seq_length // shape.cp * t.micro_batch_size
    gathered = tokens * m.hidden_size * e if shape.sequence_parallel and tp > 1 else 0
    widest = 0.0
    for i in kw["layers"]:
        moe = m.is_moe_layer(i)
        act = tokens / tp * m.moe_router_topk * m.moe_ffn if moe else tokens * m.ffn / tp
        regather = 0 if fp8_layer(cfg, m, i) else gathered
        # the gathered input is gone (the matmul done) before the activation runs
        widest = max(widest, act * e, regather * (fused_blocks(m, moe) > 0))
    return widest
