"""Generation with a KV cache at any tensor/pipeline layout: the cache, sampling over vocabulary
shards, and the loop that walks the pipeline once per new token.

    g = torch.Generator().manual_seed(0)  # its own: no other RNG is touched
    tokens = generate(chunks, groups, [[1, 5, 9], [1, 7]], 32,
                      Sampling(temperature=0.8, top_k=50, top_p=0.95), g, eos_id=2)

`chunks` are this rank's model chunks (the trainer's, or those tools/generate.py loads), `groups`
its ProcessGroups; every rank of the (tp, pp) replica calls it with the same arguments and gets
the same token lists back. Prompts of different lengths are left-padded into one batch: row i
has pad[i] padding slots, then its tokens; a token's position is its slot minus pad[i], and
padding is masked out of attention (its document id is -1), so each row is generated exactly as
it would be alone. One forward over the prompts fills the cache (prefill), then each step feeds
one token per row through the pipeline: stage after stage (p2p), the head's TP ranks sample from
their vocabulary slices, and the head's pipeline rank broadcasts the tokens to the others. The
host reads the tokens once per step (to stop at EOS or a stop condition); nothing else waits.
With a context-parallel group (groups.cp) the prompt and the cache are split over its ranks
(CPKVCache: the prefill is training's ring attention, each decode step merges every rank's
partial attention over its share of the cache).

Sampling over the head's vocabulary shards is parallel/sampling.py's.
"""

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from megalite.errors import MegaliteError
from megalite.kernels.attention_sinks import add_sink
from megalite.parallel import comm
from megalite.parallel.comm import Group
from megalite.parallel.context_parallel import chunk_positions, ring_attention
from megalite.parallel.p2p import exchange
from megalite.parallel.sampling import GREEDY, Sampling, gathered, logprobs, sample

# ---- the cache -----------------------------------------------------------------------------


class KVCache:
    """The keys and values of the tokens one model chunk has seen, for a left-padded batch.

    `pad` (b,): padding slots at the start of each row; `capacity`: slots per row (`span`:
    a bound on the positions, the rows the model's RoPE table grows to). The chunk
    calls `extend(s)` before a forward of s new tokens, then each attention layer appends to
    `layer(name)`: buffers (b, kv heads, capacity, hd), allocated at the first write (latent
    attention caches its compressed latent and RoPE key there instead).
    """

    cp = None  # a CPKVCache's group: attention layers then call its layers' `attend`
    every_position = False  # the head returns every new position's logits, not the last's

    def __init__(self, pad: torch.Tensor, capacity: int, padded: bool = True):
        self.pad, self.capacity, self.padded = pad, capacity, padded  # padded: any pad > 0
        self.length = 0  # slots written (a host int: known without asking the device)
        self.span = capacity  # positions stay below it: the rows the RoPE table needs
        self.layers: dict[str, LayerKV] = {}

    def extend(self, s: int):
        """Slots, positions and document ids of the next s tokens (every row)."""
        start, end = self.length, self.length + s
        if end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} slots cannot take {end}")
        slots = torch.arange(end, device=self.pad.device)
        self.q_slot, self.k_slot = slots[start:], slots  # (s,), (end,)
        self.positions = (slots[start:] - self.pad[:, None]).clamp(min=0)  # (b, s)
        self.q_doc = self.k_doc = None  # no padding: causal by slot is all the mask there is
        if self.padded:
            doc = -(slots < self.pad[:, None]).long()  # (b, end): -1 padding, 0 tokens
            self.q_doc, self.k_doc = doc[:, start:], doc  # (b, s), (b, end)
        self.start, self.length = start, end

    def layer(self, name: str) -> "LayerKV":
        if name not in self.layers:
            self.layers[name] = LayerKV(self)
        return self.layers[name]


class LayerKV:
    """One layer's buffers; reads the step's positions and mask ids from its cache."""

    def __init__(self, cache: KVCache):
        self.cache, self.k, self.v = cache, None, None

    def __getattr__(self, name):  # positions, q_slot, k_slot, q_doc, k_doc
        return getattr(self.__dict__["cache"], name)

    def append(self, k, v):
        """k, v (b, kv heads, s, hd) of the new tokens -> every slot so far (b, kvh, length, hd).
        Latent attention (model/mla.py) appends its latent (b, 1, s, r) as k and its RoPE key
        (b, 1, s, dr) as v: each buffer takes its own last dim."""
        c = self.cache
        if self.k is None:
            self.k = k.new_empty((*k.shape[:2], c.capacity, k.shape[3]))
            self.v = v.new_empty((*v.shape[:2], c.capacity, v.shape[3]))
        self.k[:, :, c.start : c.length] = k
        self.v[:, :, c.start : c.length] = v
        return self.k[:, :, : c.length], self.v[:, :, : c.length]


class CPKVCache(KVCache):
    """A KVCache whose slots are shared over the ranks of `cp` (context-parallel generation).

    The prompt (left-padded to `width`, a multiple of 2·cp) is split as the trainer splits a
    sequence: rank r holds slots chunk_positions(width, cp, r), so the prefill is the trainer's
    ring attention. Each later token is fed to every rank (the same queries everywhere) and its
    keys and values stay on one rank, the next in turn (slot - width) mod cp, so the shares stay
    within one token of each other. A decode step's attention is exact: each rank attends to
    its own share (output and log-sum-exp), the partials are all-gathered and merged in rank
    order (the same bits on every rank), and a gpt-oss sink is added once to the merged result.
    """

    def __init__(self, pad: torch.Tensor, width: int, steps: int, cp: Group):
        n = width // cp.size
        super().__init__(pad, n + -(-max(steps - 1, 0) // cp.size), True)
        self.cp, self.width, self.total = cp, width, 0  # total: slots written on every rank
        self.span = width + steps  # every rank's slots together
        dev = pad.device
        self.index = torch.stack([chunk_positions(width, cp.size, r, dev) for r in range(cp.size)])
        self.docs = -(self.index[:, None] < pad[None, :, None]).long()  # (cp, b, n): -1 padding
        self.slots = torch.zeros(self.capacity, dtype=torch.long, device=dev)  # held, global
        self.held_doc = torch.zeros(len(pad), self.capacity, dtype=torch.long, device=dev)
        self.slots[:n], self.held_doc[:, :n] = self.index[cp.rank], self.docs[cp.rank]
        self.every = torch.arange(width + steps, device=dev)  # decode slots, without a copy

    def extend(self, s: int):
        """This rank's new tokens: its share of the prompt (first), then one token (each rank)."""
        if self.total == 0:
            q, self.owner, self.start, self.length = self.index[self.cp.rank], None, 0, s
        else:
            q = self.every[self.total : self.total + 1]
            self.owner = (self.total - self.width) % self.cp.size
            self.start, mine = self.length, self.owner == self.cp.rank
            if mine and self.length >= self.capacity:
                raise ValueError(f"KV cache of {self.capacity} slots cannot take more")
            if mine:
                self.slots[self.length : self.length + 1] = q  # device to device: no host read
            self.length += mine
        self.q_slot, self.positions = q, (q - self.pad[:, None]).clamp(min=0)  # (s,), (b, s)
        self.q_doc = -(q < self.pad[:, None]).long()
        self.k_slot, self.k_doc = self.slots[: self.length], self.held_doc[:, : self.length]
        self.total = self.width if self.total == 0 else self.total + 1

    def layer(self, name: str) -> "CPLayerKV":
        if name not in self.layers:
            self.layers[name] = CPLayerKV(self)
        return self.layers[name]


class CPLayerKV(LayerKV):
    """One layer's share of a CPKVCache; `attend` is its attention (layers.Attention calls it)."""

    def attend(self, q, k, v, ops, sinks=None, **window):
        """q (b, hq, s, hd), k, v (b, kvh, s, hd) of this rank's new tokens -> (b, hq, s, hd)."""
        c = self.cache
        if c.owner is None:  # the prompt: the trainer's ring over every rank's share
            self.append(k, v)
            return ring_attention(q, k, v, c.cp, c.index, c.docs, ops, sinks, **window)
        if c.owner == c.cp.rank:
            k, v = self.append(k, v)
        else:
            k, v = self.k[:, :, : c.length], self.v[:, :, : c.length]
        o, lse = ops.attention_block_fwd(q, k, v, c.q_slot, c.k_slot, c.q_doc, c.k_doc, **window)
        every = gathered(torch.cat([o, lse.to(o.dtype)[..., None]], -1), c.cp)  # (cp, ..., d+1)
        out, lse = every[0, ..., :-1], every[0, ..., -1]
        for part in every[1:]:
            out, lse = ops.merge_attention(out, lse, part[..., :-1], part[..., -1])
        if sinks is not None:
            out, lse = add_sink(out, lse, sinks)
        return out.to(q.dtype)


# ---- the pipeline loop ---------------------------------------------------------------------


def context_length(cfg) -> int:
    """Positions the model has: its learned table (gpt2), else its rotary tables (llama)."""
    if cfg.features.learned_positions and cfg.max_position_embeddings:
        return cfg.max_position_embeddings
    return cfg.seq_length


def check_prompts(prompts, cfg):
    """Bad input, named: an empty prompt, or one the model's context cannot hold."""
    n = context_length(cfg)
    if not prompts:
        raise MegaliteError("no prompt given")
    for i, p in enumerate(prompts):
        if not p:
            raise MegaliteError(f"prompt {i} is empty; give at least one token (e.g. BOS)")
        if len(p) > n:
            raise MegaliteError(
                f"prompt {i} has {len(p)} tokens but the model's context is {n}; shorten it"
            )


def _route(chunks, pp: Group) -> list[tuple[int, int]]:
    """(pipeline rank, chunk index) in the order a token visits them: by the layers they hold,
    whatever the schedule's placement (interleaved, V-shaped)."""
    keys = [(not c.has_embedding, min(map(int, c.layers), default=-1), c.has_head) for c in chunks]
    every = comm.all_gather_object(keys, pp)
    return [(r, i) for _, r, i in sorted((k, r, i) for r, ks in enumerate(every)
                                         for i, k in enumerate(ks))]  # fmt: skip


def _through_pipeline(chunks, route, pp: Group, ids, caches, h_dtype):
    """ids (b, s) through every chunk in pipeline order; the head's local logits on its ranks."""
    x, me = None, pp.rank
    for n, (r, i) in enumerate(route):
        if r != me:
            continue
        chunk = chunks[i]
        if chunk.has_embedding:
            x = ids
        elif route[n - 1][0] != me:  # from the previous stage (else handed over locally)
            x = torch.empty(*ids.shape, chunk.cfg.hidden_size, dtype=h_dtype, device=ids.device)
            exchange([(False, x, route[n - 1][0])], pp)
        x = chunk(x, cache=caches[i])
        if n + 1 < len(route) and route[n + 1][0] != me:
            exchange([(True, x, route[n + 1][0])], pp)
    return x if chunks[route[-1][1]].has_head and route[-1][0] == me else None


def _cp_group(cfg, groups, use_cache: bool) -> Group:
    """The group the prompt and the cache are split over: groups.cp, or this rank alone without
    the cache (the baseline recomputes the whole context on every rank, as before cp)."""
    if not use_cache:
        return Group("cp", [0], 0, device=groups.device)
    if groups.cp.size > 1 and cfg.features.latent_attention:
        raise MegaliteError("generation at cp > 1 cannot cache latent attention (MLA); use cp 1")
    return groups.cp


@dataclass
class Generated:
    """`generate_scored`'s result, per row: the new ids, and with logprobs=k the log-probability
    of each new token with the k likeliest at its step ((id, logprob) pairs, likeliest first);
    with echo the same for each prompt token after the first (the first has none)."""

    tokens: list[list[int]]
    logprobs: list[list[float]] = field(default_factory=list)
    top: list[list[list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list[list[float]] = field(default_factory=list)
    prompt_top: list[list[list[tuple[int, float]]]] = field(default_factory=list)


def _unpack(pack, k: int):
    """Rows of a (..., 1 + 2k) score pack (logprob, k top logprobs, k top ids) -> lists."""
    rows = pack.tolist()
    lp = [[p[0] for p in row] for row in rows]
    top = [[list(zip(map(int, p[1 + k :]), p[1 : 1 + k])) for p in row] for row in rows]
    return lp, top


def _scores(logits, targets, tp, vocab_size, k):
    """(..., 1 + 2k) fp64: the targets' logprobs, the top k logprobs and their ids."""
    chosen, top, ids = logprobs(logits, tp, vocab_size, targets, k)
    return torch.cat([chosen[..., None], top, ids.to(top.dtype)], -1).double()


@torch.no_grad()
def generate(chunks, groups, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
             eos_id: int | None = None, stop=None, use_cache: bool = True,
             pad_id: int = 0) -> list[list[int]]:  # fmt: skip
    """The new token ids of each prompt, on every rank of the (tp, cp, pp) replica.

    A row ends at `eos_id` (kept), when `stop(its new ids)` is true, after `max_new_tokens`, or
    when the model's context is full. `generator` (CPU; default seeded 0) is the only RNG used.
    `use_cache=False` recomputes the whole context at each step (the baseline it replaces).
    The chunks are put in eval mode without sequence parallelism, and restored after.
    With `groups.cp` of size > 1 the prompt and the cache are split over cp (CPKVCache).
    """
    return generate_scored(chunks, groups, prompts, max_new_tokens, sampling, generator, eos_id,
                           stop, use_cache, pad_id).tokens  # fmt: skip


@torch.no_grad()
def generate_scored(chunks, groups, prompts: list[list[int]], max_new_tokens: int,
                    sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
                    eos_id: int | None = None, stop=None, use_cache: bool = True,
                    pad_id: int = 0, logprobs: int | None = None, echo: bool = False,
                    on_step=None) -> Generated:  # fmt: skip
    """`generate`, and log-probabilities under the model's own distribution (temperature 1,
    whatever the sampling): `logprobs`=k (0: only each token's own) for the new tokens; `echo`
    for the prompts' tokens too (k top ones when logprobs is given), from the prefill's logits
    at every position (max_new_tokens may be 0). `on_step(step, ids, pack)`: called on every
    rank after each step with the step's ids (b,) as a list and, with logprobs, its scores
    (b, 1 + 2k) read to the host (else the scores are read once, at the end)."""
    sampling.check()
    cfg = chunks[0].cfg
    check_prompts(prompts, cfg)
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    tp, pp, cp, device = groups.tp, groups.pp, _cp_group(cfg, groups, use_cache), groups.device
    if echo and cp.size > 1:
        raise MegaliteError("prompt log-probabilities (echo) need cp 1")
    k = -1 if logprobs is None else logprobs  # -1: no scores of new tokens
    route = _route(chunks, pp)
    head = route[-1][0]
    b, longest = len(prompts), max(len(p) for p in prompts)
    steps = min(max_new_tokens, context_length(cfg) - longest + 1)  # the last token is not fed
    # with cp, more left padding: the prompt splits into 2·cp equal chunks, as in training
    width = longest if cp.size == 1 else -(-longest // (2 * cp.size)) * 2 * cp.size
    pads = [width - len(p) for p in prompts]
    pad, padded = torch.tensor(pads, device=device), any(pads)
    seq = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    h_dtype = next(chunks[0].parameters()).dtype
    out, done = [[] for _ in prompts], [False] * b
    result, packs = Generated(out), []
    if k >= 0:
        result.logprobs, result.top = [[] for _ in prompts], [[] for _ in prompts]
    with ExitStack() as stack:
        for c in chunks:  # restored on the way out, also on an error
            stack.enter_context(c.full_sequences())
            stack.callback(c.train, c.training)
            c.eval()
        if cp.size == 1:
            caches, new = [KVCache(pad, width + max(steps, 1) - 1, padded) for _ in chunks], seq
        else:  # each rank feeds its share of the prompt, then every new token
            caches = [CPKVCache(pad, width, steps, cp) for _ in chunks]
            new = seq[:, caches[0].index[cp.rank]]
        for step in range(max(steps, int(echo))):  # echo: the prefill at least
            if not use_cache:  # the whole context again, into a fresh cache
                new = seq = seq if step == 0 else torch.cat([seq, new], 1)
                caches = [KVCache(pad, seq.shape[1], padded) for _ in chunks]
            for c in caches:
                c.every_position = echo and step == 0
            logits = _through_pipeline(chunks, route, pp, new, caches, h_dtype)
            if echo and step == 0:  # the prompt tokens' scores, from the position before each
                shape = (b, width - 1, 1 + 2 * max(k, 0))
                if logits is not None:
                    pack = _scores(logits[:, :-1], seq[:, 1:], tp, cfg.vocab_size, max(k, 0))
                    logits = logits[:, -1]
                else:
                    pack = torch.empty(shape, dtype=torch.float64, device=device)
                comm.broadcast(pack, head, pp)
                lp, top = _unpack(pack, max(k, 0))
                result.prompt_top = [r[p:] for r, p in zip(top, pads)]
                result.prompt_logprobs = [r[p:] for r, p in zip(lp, pads)]
                if step == steps:  # max_new_tokens 0: the prompts' scores only
                    break
            if logits is not None:
                tokens = sample(logits, tp, cfg.vocab_size, sampling, generator)
                comm.broadcast(tokens, 0, cp)  # cp rank 0 holds the prompt's last slot
                if k >= 0:
                    pack = _scores(logits, tokens, tp, cfg.vocab_size, k)
                    comm.broadcast(pack, 0, cp)
            else:
                tokens = torch.empty(b, dtype=torch.int64, device=device)
                if k >= 0:
                    pack = torch.empty(b, 1 + 2 * k, dtype=torch.float64, device=device)
            comm.broadcast(tokens, head, pp)
            if k >= 0:
                comm.broadcast(pack, head, pp)
                packs.append(pack)
            ids = tokens.tolist()  # the one host read per step
            if on_step is not None:
                on_step(step, ids, pack.cpu() if k >= 0 else None)
            for i, t in enumerate(ids):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t == eos_id or bool(stop and stop(out[i]))
            if all(done):
                break
            new = tokens[:, None]  # (b, 1)
    if packs:  # each row's scores up to its last token
        lp, top = _unpack(torch.stack(packs, 1), k)
        result.logprobs = [r[: len(o)] for r, o in zip(lp, out)]
        result.top = [r[: len(o)] for r, o in zip(top, out)]
    return result
