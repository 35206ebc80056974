"""The GPT model as pipeline chunks: embedding?, a run of layers, head and loss?

The model knows nothing about the pipeline: a chunk is told which global layer indices it holds
and whether it has the embedding and the head. One process holds one chunk with everything.
Parameter names are logical (global layer indices), the same in every layout.
"""

import math
import zlib
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.kernels.fp8_linear import layer_ops
from megalite.model.env import LayerEnv
from megalite.model.layers import Norm, TransformerLayer
from megalite.model.mtp import MTPModule, mtp_loss
from megalite.model.rope import RotaryTables
from megalite.parallel import comm
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.specs import mark, name_parameters, spec_of, update
from megalite.parallel.tensor_parallel import (
    SequenceParallel,
    VocabParallelEmbedding,
    enter_tp_region,
    shard_spec,
)

# Logical names other modules need (HF conversion, checkpoints): the tensors whose rows are
# the vocabulary, and the two ends of a tied word embedding.
WORD_EMBEDDING = "embedding.word.weight"
OUTPUT = "output.weight"
VOCAB_TENSORS = (WORD_EMBEDDING, OUTPUT)


class Output(nn.Module):
    """The head's weight (`output.weight`: this rank's vocabulary rows) and its matmul: a module
    called on the final norm's output, so that whatever must happen before the weight is read
    (an overlapped ZeRO gather, parallel/param_gather.py) is a pre-hook of its own."""

    def __init__(self, weight: nn.Parameter, ops):
        super().__init__()
        self.weight, self.ops = weight, ops

    def forward(self, x):  # (b, s, h) -> (b, s, V_padded/t)
        return self.ops.linear(x, self.weight)


class GPTChunk(nn.Module):
    def __init__(self, cfg: ModelConfig, env: LayerEnv | None = None, layers=None,
                 has_embedding=True, has_head=True):  # fmt: skip
        """`env` (model/env.py): how this rank runs the layers: groups (TP, sequence
        parallelism, CP, experts), kernels, recompute, seed, dtype, device; default one
        process. With `env.meta` the parameters and buffers are on the meta device (shapes,
        names and specs, no memory, nothing initialised), for a model about to be loaded:
        model/materialize.py then gives them memory on `env.device`. With context parallelism
        forward takes the tokens' `shard`."""
        super().__init__()
        # this chunk's own dropout stream and sequence-parallel switch, held by every layer as
        # its env's `sequence_parallel`: full_sequences() turns it off for all of them at once
        env = (env or LayerEnv()).fresh()
        self.sequence_parallel = SequenceParallel(env.sequence_parallel)
        self.env = env = env.replace(sequence_parallel=self.sequence_parallel)
        layers = range(cfg.num_layers) if layers is None else layers
        tp, ops = env.tp, env.ops
        self.cfg, self.tp, self.ops = cfg, tp, ops
        self.rng = env.rng
        self.has_embedding, self.has_head = has_embedding, has_head
        self.vocab = cfg.padded_vocab_size(tp.size)
        kw = env.tensor_kw
        if has_embedding:
            self.embedding = nn.Module()
            self.embedding.word = VocabParallelEmbedding(
                self.vocab, cfg.hidden_size, tp, self.sequence_parallel, **kw
            )
            if cfg.features.learned_positions:
                positions = cfg.max_position_embeddings or cfg.seq_length
                self.embedding.position = nn.Embedding(positions, cfg.hidden_size, **kw)
                # with sequence parallelism each rank adds positions to its own rows only
                mark(
                    self.embedding.position.weight,
                    **shard_spec(tp, partial_grad=self.sequence_parallel),
                )
        # one cos/sin table for every layer (per head dim), sized to the training sequence
        # and grown by generation to the positions its cache holds
        self.rotary = RotaryTables(cfg.seq_length, kw["device"])
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(cfg.layer_config(i),
                                      env.replace(ops=layer_ops(ops, i, cfg.num_layers)),
                                      cfg.is_moe_layer(i), self.rotary)
             for i in layers}
        )  # fmt: skip
        if has_head:
            self.final_norm = Norm(cfg, env)
            if not (cfg.tied and has_embedding):
                w = torch.empty(self.vocab // tp.size, cfg.hidden_size, **kw)
                # tied: the last stage's copy of the first stage's embedding
                spec = shard_spec(tp, 0, vocab_dim=0)
                if cfg.tied:  # the first stage's embedding, summed with it over `embed`
                    spec.update(tied_to=WORD_EMBEDDING, grad_sum=("embed",))
                self.output = Output(mark(nn.Parameter(w), **spec), ops)
            if cfg.mtp_num_layers:  # multi-token prediction (model/mtp.py) after the head
                self._build_mtp(cfg, env)
        name_parameters(self, cfg.vocab_size)
        twin = cfg.tied or cfg.mtp_num_layers  # the head's stage holds a copy of the embedding
        if twin and has_embedding and not has_head:  # its twin is on the head's stage
            update(self.embedding.word.weight, grad_sum=("embed",))
        if torch.device(kw["device"] or "cpu").type != "meta":  # the planner: shapes only
            self.init_parameters(env.seed)

    def _build_mtp(self, cfg, env):
        """The MTP modules, and the embedding they read when this chunk lacks it: a copy of
        the first stage's (the tied output layer itself when there is one)."""
        L = cfg.num_layers
        self.mtp = nn.ModuleDict(
            {str(k): MTPModule(cfg, env, cfg.is_moe_layer(L + k), self.rotary)
             for k in range(cfg.mtp_num_layers)}
        )  # fmt: skip
        if self.has_embedding:
            return
        self.mtp_embedding = VocabParallelEmbedding(
            self.vocab, cfg.hidden_size, self.tp, self.sequence_parallel, **env.tensor_kw
        )
        if hasattr(self, "output") and cfg.tied:  # already the embedding's copy: share it
            self.mtp_embedding.weight = self.output.weight
        else:
            update(self.mtp_embedding.weight, tied_to=WORD_EMBEDDING, grad_sum=("embed",))

    def mtp_embed(self, ids):
        """The word embedding of ids (b, s) for the MTP modules, on the head's stage."""
        if self.has_embedding:
            return self.embedding.word(ids)
        return self.mtp_embedding(ids)

    # ---- initialisation: every logical tensor drawn whole from (seed, name), then sliced ------

    def init_parameters(self, seed: int):
        std = self.cfg.init_method_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p.data)
                continue
            if name.endswith(".bias"):
                nn.init.zeros_(p.data)
                continue
            spec = spec_of(p)
            s = (
                std / math.sqrt(2 * self.cfg.num_layers)
                if name.endswith(("attention.out.weight", "down.weight"))  # MLPs and experts
                else std
            )
            # padding rows (never a target) stay zero: only the real vocabulary is drawn
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.source.encode()))
            full = torch.randn(spec.shape, generator=g) * s
            p.data.copy_(spec.local(full))

    def load_full_state(self, state: dict):
        """Copy in whole logical tensors (any vocabulary padding): pad or trim the vocabulary to
        this model's, keep this rank's TP slice. Missing names are an error, but for the expert
        biases (buffers, whole): a state without them leaves them as they are."""
        from megalite.model.moe import expert_biases

        for p in self.parameters():
            spec = spec_of(p)
            with torch.no_grad():
                p.copy_(spec.local(state[spec.source]))
        for name, bias in expert_biases([self]):
            if name in state:
                bias.copy_(state[name])

    def moe_stats(self) -> dict:
        """{global layer index: (E + 4,) float64 device tensor} of each MoE layer on this rank:
        running sums since `megalite.model.moe.moe_metrics` last read them (assignments per
        expert, load-balancing loss, z-loss, dropped assignments, passes). Device tensors: read
        them on logging steps only; `moe_metrics` reduces them over the ranks and resets them."""
        from megalite.model.moe import moe_layers

        return {i: m.stats for i, m in moe_layers([self])}

    # ---- forward ----------------------------------------------------------------------------

    def embed(self, ids, positions=None):  # (b, s) -> (b, s, h) or (b, s/t, h)
        """`positions` (b, s): each token's position (inference with a cache, context
        parallelism, documents), else 0..s-1."""
        x = self.embedding.word(ids)
        if self.cfg.features.learned_positions:
            pos = positions
            if pos is None:
                pos = torch.arange(ids.shape[1], device=ids.device)
            if self.sequence_parallel and pos.shape[-1] == ids.shape[1]:  # this TP rank's rows
                pos = pos.chunk(self.tp.size, -1)[self.tp.rank]
            x = x + self.embedding.position(pos)
        if self.cfg.hidden_dropout and self.training:
            if self.sequence_parallel:  # rows sharded over TP: different masks per rank
                with self.rng.fork():
                    return F.dropout(x, self.cfg.hidden_dropout)
            x = F.dropout(x, self.cfg.hidden_dropout)
        return x

    def logits(self, x, norm=None):
        """(b, s[/t], h) -> this rank's vocabulary slice of the logits (b, s, V_padded/t);
        `norm`: another final norm than the model's (an MTP module's)."""
        x = enter_tp_region((norm or self.final_norm)(x), self.tp, self.sequence_parallel)
        if hasattr(self, "output"):  # the untied head (or the last stage's tied copy)
            return self.output(x)
        return self.ops.linear(x, self.embedding.word.weight)

    def _token_loss(self, logits, labels):
        """Per-token cross entropy (b, s) of this rank's vocabulary slice of the logits."""
        if self.tp.size > 1:
            return vocab_parallel_cross_entropy(
                logits, labels, self.tp, self.cfg.vocab_size, ops=self.ops
            )
        return self.ops.cross_entropy(logits[..., : self.cfg.vocab_size], labels)

    def forward(self, x, labels=None, cache=None, shard=None):
        """Training and whole-sequence inference; with `cache` (a megalite.generation.KVCache),
        inference on the new tokens only: x is their ids (b, s) or hidden states (b, s, h),
        their keys and values join the cache, and the head returns the last position's logits
        as this rank's vocabulary slice (b, V_padded/t), ungathered (every position's,
        (b, s, V_padded/t), when `cache.every_position`). `shard`
        (context_parallel.Shard): this rank's positions, documents and loss mask, when the
        tokens are a context-parallel share or packed documents."""
        if cache is not None:
            return self._forward_cached(x, cache)
        if self.has_embedding:
            x = self.embed(x, None if shard is None else shard.positions)
        for layer in self.layers.values():
            x = layer(x, shard=shard)
        if not self.has_head:
            return x
        if labels is None:  # whole logits over the real vocabulary (generation, conversion checks)
            logits = self.logits(x)
            return comm.gather_from_group(logits, self.tp, dim=-1)[..., : self.cfg.vocab_size]
        # the logits go with the loss: not held (a logits-sized tensor) while MTP runs
        loss = self._token_loss(self.logits(x), labels)
        if shard is not None and shard.loss_mask is not None:  # (b, s): per-token losses
            # the step's mean over the tokens with a loss, once averaged over micro-batches and cp
            loss = (loss * shard.loss_mask).sum() * shard.loss_weight
        else:
            loss = loss.mean()
        if hasattr(self, "mtp"):  # the main loss plus the scaled mean MTP loss
            loss = loss + mtp_loss(self, x, labels, shard, self._token_loss)
        return loss

    def _forward_cached(self, x, cache):
        if self.sequence_parallel:
            raise RuntimeError("a KV cache needs whole sequences: use chunk.full_sequences()")
        cache.extend(x.shape[1])  # slots and positions of the new tokens
        if self.has_embedding:
            x = self.embed(x, cache.positions)
        for name, layer in self.layers.items():
            x = layer(x, cache.layer(name))
        if not self.has_head:
            return x
        return self.logits(x if cache.every_position else x[:, -1])  # echo: every position's

    @contextmanager
    def full_sequences(self):
        """Sequence parallelism off (every TP rank holds whole (b, s, h) activations), restored
        on exit: inference feeds one token at a time, which cannot be split over TP. The
        weights and the results are the same; only activation memory differs. Every layer holds
        this chunk's one `SequenceParallel` switch (its env's `sequence_parallel`), so flipping
        it reaches them all."""
        saved, self.sequence_parallel.on = self.sequence_parallel.on, False
        try:
            yield self
        finally:
            self.sequence_parallel.on = saved
