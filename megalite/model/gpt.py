"""The GPT model as pipeline chunks: embedding?, a run of layers, head and loss?

The model knows nothing about the pipeline: a chunk is told which global layer indices it holds
and whether it has the embedding and the head. One process holds one chunk with everything.
Parameter names are logical (global layer indices), the same in every layout.
"""

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.kernels import TORCH_OPS
from megalite.model.layers import Norm, TransformerLayer
from megalite.parallel import comm
from megalite.parallel.comm import Group
from megalite.parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.random import ShardedRNG
from megalite.parallel.tensor_parallel import VocabParallelEmbedding, enter_tp_region, mark

LOCAL = Group("tp", [0], 0)  # a TP group of one: the single-process model


class GPTChunk(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: Group = LOCAL,
        layers=None,
        has_embedding=True,
        has_head=True,
        sequence_parallel=False,
        ops=TORCH_OPS,
        recompute="none",
        seed=1234,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        layers = range(cfg.num_layers) if layers is None else layers
        self.cfg, self.tp, self.sp, self.ops = cfg, tp, sequence_parallel and tp.size > 1, ops
        self.has_embedding, self.has_head = has_embedding, has_head
        self.vocab = cfg.padded_vocab_size(tp.size)
        self.rng = rng = ShardedRNG(seed, tp.rank, torch.device(device or "cpu"))
        kw = {"dtype": dtype, "device": device}
        if has_embedding:
            self.embedding = nn.Module()
            self.embedding.word = VocabParallelEmbedding(
                self.vocab, cfg.hidden_size, tp, self.sp, **kw
            )
            if cfg.flavour == "gpt2":
                positions = cfg.max_position_embeddings or cfg.seq_length
                self.embedding.position = nn.Embedding(positions, cfg.hidden_size, **kw)
                # with sequence parallelism each rank adds positions to its own rows only
                mark(self.embedding.position.weight, grad_sync_tp=self.sp)
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(cfg, tp, ops, self.sp, rng, recompute, **kw) for i in layers}
        )
        if has_head:
            self.final_norm = Norm(cfg, ops, self.sp, **kw)
            if not (cfg.tied and has_embedding):
                self.output = nn.Module()
                w = torch.empty(self.vocab // tp.size, cfg.hidden_size, **kw)
                self.output.weight = mark(nn.Parameter(w), partition_dim=0)
                self.output.weight.tied_copy = cfg.tied  # the last stage's copy of the embedding
        self.init_parameters(seed)

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
            source = "embedding.word.weight" if getattr(p, "tied_copy", False) else name
            s = (
                std / math.sqrt(2 * self.cfg.num_layers)
                if name.endswith(("attention.out.weight", "mlp.down.weight"))
                else std
            )
            shape = list(p.shape)
            dim = getattr(p, "partition_dim", None)
            if dim is not None:
                shape[dim] *= self.tp.size
            if source == "embedding.word.weight":
                shape[0] = self.cfg.vocab_size  # padding rows (never a target) stay zero
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(source.encode()))
            full = torch.randn(shape, generator=g) * s
            if source == "embedding.word.weight":
                full = F.pad(full, (0, 0, 0, self.vocab - self.cfg.vocab_size))
            if dim is not None:
                full = full.chunk(self.tp.size, dim)[self.tp.rank]
            p.data.copy_(full)

    def load_full_state(self, state: dict):
        """Copy in whole logical tensors (any vocabulary padding): pad or trim the vocabulary to
        this model's, keep this rank's TP slice. Missing names are an error."""
        for name, p in self.named_parameters():
            source = "embedding.word.weight" if getattr(p, "tied_copy", False) else name
            full = state[source]
            if source in ("embedding.word.weight", "output.weight"):
                full = full[: self.cfg.vocab_size]
                full = F.pad(full, (0, 0, 0, self.vocab - full.shape[0]))
            dim = getattr(p, "partition_dim", None)
            if dim is not None:
                full = full.chunk(self.tp.size, dim)[self.tp.rank]
            with torch.no_grad():
                p.copy_(full)

    # ---- forward ----------------------------------------------------------------------------

    def embed(self, ids):  # (b, s) -> (b, s, h) or (b, s/t, h)
        x = self.embedding.word(ids)
        if self.cfg.flavour == "gpt2":
            pos = torch.arange(ids.shape[1], device=ids.device)
            if self.sp:
                pos = pos.chunk(self.tp.size)[self.tp.rank]
            x = x + self.embedding.position(pos)
        if self.cfg.hidden_dropout and self.training:
            if self.sp:  # rows sharded over TP: different masks per rank
                with self.rng.fork():
                    return F.dropout(x, self.cfg.hidden_dropout)
            x = F.dropout(x, self.cfg.hidden_dropout)
        return x

    def head_weight(self):
        return self.embedding.word.weight if not hasattr(self, "output") else self.output.weight

    def logits(self, x):
        """(b, s[/t], h) -> this rank's vocabulary slice of the logits (b, s, V_padded/t)."""
        x = enter_tp_region(self.final_norm(x), self.tp, self.sp)
        return F.linear(x, self.head_weight())

    def forward(self, x, labels=None):
        if self.has_embedding:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if not self.has_head:
            return x
        logits = self.logits(x)
        if labels is None:  # whole logits over the real vocabulary (generation, conversion checks)
            return comm.gather_from_group(logits, self.tp, dim=-1)[..., : self.cfg.vocab_size]
        if self.tp.size > 1:
            loss = vocab_parallel_cross_entropy(logits, labels, self.tp, self.cfg.vocab_size)
        else:
            loss = self.ops.cross_entropy(logits[..., : self.cfg.vocab_size], labels)
        return loss.mean()
