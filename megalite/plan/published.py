"""Published training runs with their throughput: the rows the planner's time model is
calibrated on (CALIBRATION) and the rows it is only checked against (HELD_OUT), each with its
model, GPUs, batch, layout and the per-GPU TFLOP/s its authors report (docs/planner.md,
"Calibration"). `estimate(row, ...)` plans the row's published layout and gives the planner's
TFLOP/s for it, counted as the source counts them (`Row.counts`: model FLOPs, or with
recompute's; training/flops.py gives both, to the caller: planning sits below training)."""

from dataclasses import dataclass, field

from megalite.config import Config, ModelConfig
from megalite.plan import layouts
from megalite.plan.ranking import Cluster


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    flavour: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    gpus: int
    batch: int  # sequences per step
    tp: int
    cp: int
    pp: int
    tflops: float  # per GPU, as published
    counts: str = "model"  # the FLOPs the source counts: "model", or "hardware" (recompute's too)
    precision: str = "bf16"
    recompute: str = "none"
    gpu: str = "h100"
    model: dict = field(default_factory=dict)  # other ModelConfig fields
    overlap: bool = False  # --tp-comm-overlap
    zero: tuple = (1,)  # the ZeRO stages it may use
    mbs: tuple = (1, 2, 4, 8)  # micro-batch sizes searched (the source gives none)
    links: tuple = (450.0, 50.0)  # GB/s per GPU inside / across nodes


_README = "Megatron-LM README, images/model_table.png (Megatron-Core r0.8.0, H100 80 GB)"
_UNTIED = {"untie_embeddings_and_output_weights": True}
# name, heads, hidden, layers, tp, pp, GPUs, batch, per-GPU TFLOP/s (MFU 41-49%)
_README_ROWS = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]
CALIBRATION = [
    Row(f"GPT {n}", _README, "gpt2", layers, h, heads, 4096, 131072, gpus, batch, tp, 1, pp,
        tflops, model=_UNTIED, overlap=True)
    for n, heads, h, layers, tp, pp, gpus, batch, tflops in _README_ROWS
]  # fmt: skip

_LLAMA = {"num_query_groups": 8, "ffn_hidden_size": 53248}
_LLAMA_SRC = "Llama 3 paper (Dubey et al. 2024), Table 4: H100 80 GB, 16M tokens a step"
_NARAYANAN = "Narayanan et al. 2021, Table 1: A100 80 GB, 8 per node, 200 Gb/s HDR per GPU"
# name, heads, hidden, layers, tp, pp, GPUs, batch, per-GPU TFLOP/s (with recompute's)
_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
HELD_OUT = [
    Row("Llama 3 405B, 8K, 8,192 GPUs", _LLAMA_SRC, "llama", 126, 16384, 128, 8192, 128256,
        8192, 2048, 8, 1, 16, 430, recompute="full", model=_LLAMA, mbs=(1,)),
    Row("Llama 3 405B, 8K, 16,384 GPUs", _LLAMA_SRC, "llama", 126, 16384, 128, 8192, 128256,
        16384, 2048, 8, 1, 16, 400, recompute="full", model=_LLAMA, mbs=(1,)),
    Row("Llama 3 405B, 128K, 16,384 GPUs", _LLAMA_SRC, "llama", 126, 16384, 128, 131072,
        128256, 16384, 128, 8, 16, 16, 380, recompute="full", model=_LLAMA, mbs=(1,)),
] + [
    Row(f"GPT {n} (2021)", _NARAYANAN, "gpt2", layers, h, heads, 2048, 51200, gpus, batch, tp,
        1, pp, tflops, counts="hardware", precision="fp16", recompute="full", gpu="a100",
        zero=(0,), mbs=(1, 2), links=(300.0, 25.0))
    for n, heads, h, layers, tp, pp, gpus, batch, tflops in _TABLE_1
]  # fmt: skip


def config(row: Row) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(flavour=row.flavour, num_layers=row.layers, hidden_size=row.hidden,
                            num_attention_heads=row.heads, seq_length=row.seq,
                            vocab_size=row.vocab, **row.model)  # fmt: skip
    t = cfg.training
    t.global_batch_size, t.micro_batch_size = row.batch, row.mbs[0]
    t.precision, t.recompute = row.precision, row.recompute
    cfg.parallel.tp_comm_overlap = row.overlap
    return cfg


def cluster(row: Row) -> Cluster:
    from megalite.plan.compute import GPUS

    return Cluster(row.gpus, gpu=row.gpu, peak_tflops=GPUS[row.gpu].peak_tflops,
                   intra_node_gbps=row.links[0], inter_node_gbps=row.links[1])  # fmt: skip


def estimate(row: Row, hardware: float, counted: float, plans=None):
    """(the plan of the published layout: the fastest of its (tp, cp, pp), the TFLOP/s per GPU
    the planner estimates for it, the plans searched). `hardware`: the model's hardware FLOPs
    per token at the row's recompute (what the search ranks by); `counted`: as the source
    counts them."""
    cfg = config(row)
    if plans is None:
        plans = layouts.search(cfg, cluster(row), hardware, zero_stages=list(row.zero),
                               micro_batch_sizes=row.mbs)  # fmt: skip
    key = (row.tp, row.cp, row.pp)
    p = next((q for q in plans if (q.layout.tp, q.layout.cp, q.layout.pp) == key), None)
    if p is None:
        return None, None, plans
    return p, counted * row.batch * row.seq / p.step_time / row.gpus / 1e12, plans
