"""Which layers each pipeline stage gets: the work of a stage (its layers, and the embedding and
the output layer where it holds them, at their true cost) and the splits the layout search tries,
each one Megatron's flags describe (pipeline/partition.py reads them):

- even: num_layers / (pp·vpp) layers per virtual stage, where that divides;
- `--account-for-embedding-in-pipeline-split` and/or `--account-for-loss-in-pipeline-split`: the
  embedding, the head counted as a layer, the first/last virtual stage one layer short;
- `--decoder-first-pipeline-num-layers F --decoder-last-pipeline-num-layers L`: F and L layers
  on the first and last rank, the rest even over the others (each rank's layers a multiple of
  vpp).

The work of a layer, of the output layer (the logits' matmul, `6 V h` FLOPs per token, `8 V h`
under full recompute; each MTP module's head and layer again) and of the embedding (a lookup:
no FLOPs) are shares of the model's hardware FLOPs per token (training/flops.py: layers all cost
the same, exact for dense models; an MoE model's dense layers count as an average layer). The
pipeline runs at its slowest rank's pace, so the search prefers the split whose busiest rank has
the least work, and of those the one whose fullest rank holds the fewest layers' activations
(rank r keeps pp - r micro-batches in flight under 1F1B: the first rank the most), then the
shortest flags."""

from functools import lru_cache

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.pipeline.partition import Partition

FIRST, LAST = "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"
EMBEDDING, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"
SPLIT_FLAGS = (FIRST, LAST, EMBEDDING, LOSS, "pipeline_model_parallel_layout")
NO_SPLIT = {FIRST: None, LAST: None, EMBEDDING: False, LOSS: False,
            "pipeline_model_parallel_layout": None}  # fmt: skip


def shares(cfg: Config, flops_per_token: float) -> tuple[float, float]:
    """(one transformer layer, the head) as shares of the FLOPs per token: the head is the output
    layer's logits for the model and for each MTP module, and the MTP modules' layers."""
    m, t = cfg.model, cfg.training
    d = m.mtp_num_layers or 0
    logits = (8 if t.recompute == "full" else 6) * (1 + d) * (m.vocab_size or 0) * m.hidden_size
    logits /= flops_per_token
    layer = (1 - logits) / (m.num_layers + d)
    return layer, logits + d * layer


def rank_work(partition: Partition, layer: float, head: float) -> list[float]:
    """Each pipeline rank's share of the step's FLOPs (they sum to 1; the embedding adds none)."""
    work = []
    for r in range(partition.pp):
        kws = partition.rank_chunks(r)
        n = sum(len(kw["layers"]) for kw in kws)
        work.append(n * layer + head * sum(kw["has_head"] for kw in kws))
    return work


def slowest(partition: Partition, layer: float, head: float) -> float:
    """The busiest rank's work over the average rank's: the pipeline's pace against even work."""
    return partition.pp * max(rank_work(partition, layer, head))


def in_flight(partition: Partition) -> int:
    """The most layers' activations a rank holds at 1F1B's peak: rank r keeps pp - r
    micro-batches of its layers (the first rank the most: a layer less there saves pp)."""
    pp = partition.pp
    return max(partition.rank_layers(r) * (pp - r) for r in range(pp))


@lru_cache(maxsize=4096)
def splits(num_layers: int, pp: int, vpp: int, layer: float, head: float) -> tuple:
    """The splits the search tries at (pp, vpp), best first (module docstring): tuples of
    (flag name, value) for ParallelConfig, () for even; one per distinct split."""
    if pp == 1:
        return ((),) if num_layers >= vpp else ()
    found = {}
    cands = [(), ((LOSS, True),), ((EMBEDDING, True),), ((EMBEDDING, True), (LOSS, True))]
    top = num_layers if pp == 2 else min(num_layers, 2 * -(-num_layers // pp))
    for first in range(0, top + 1):
        for last in range(0, top + 1):
            rest = num_layers - first - last
            if rest < 0 or (pp == 2 and rest) or (pp > 2 and rest % (pp - 2)):
                continue
            middle = rest // (pp - 2) if pp > 2 else 0
            if first % vpp or last % vpp or middle % vpp or (pp > 2 and middle == 0):
                continue
            cands.append(((FIRST, first), (LAST, last)))
    for flags in cands:
        try:
            part = Partition.from_flags(num_layers, pp, vpp, **_kwargs(dict(flags)))
        except MegaliteError:  # these flags cannot split this pipeline
            continue
        if part.counts in found:
            continue
        key = (round(slowest(part, layer, head), 9), in_flight(part), len(flags))
        found[part.counts] = (key, flags)
    return tuple(flags for _, flags in sorted(found.values()))


def _kwargs(flags: dict) -> dict:
    return {"first": flags.get(FIRST), "last": flags.get(LAST),
            "embedding": flags.get(EMBEDDING, False), "loss": flags.get(LOSS, False)}  # fmt: skip


def flag_text(flags) -> str:
    """Megatron's command-line flags of a split: `--decoder-first-pipeline-num-layers 7 ...`."""
    out = []
    for name, value in flags:
        if value is True:
            out.append("--" + name.replace("_", "-"))
        elif value not in (None, False):
            out.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(out)
