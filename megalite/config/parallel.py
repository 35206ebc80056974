"""The parallel section of the config (`Config.parallel`): the layout flags and the default rank
order."""

from dataclasses import dataclass

from megalite.model_config import opt

# The rank order of the parallel axes, fastest-varying first; parallel/topology.py takes its
# default from here. An axis of size 1 takes no place: tp-dp-pp ranks unchanged. dpr (the copies
# of a ZeRO shard group, --dp-replicate) after dp: a shard group stays inside a node.
DEFAULT_ORDER = "tp-cp-dp-dpr-pp"


@dataclass
class ParallelConfig:
    tp: int = opt(1, "tensor-parallel size", "--tensor-model-parallel-size")
    pp: int = opt(1, "pipeline-parallel size", "--pipeline-model-parallel-size")
    vpp: int = opt(
        1,
        "virtual pipeline chunks per rank (interleaved 1F1B when >= 2)",
        "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size",
    )
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "layers on the first pipeline rank (the rest split evenly over the others)"
    )
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "layers on the last pipeline rank (the rest split evenly over the others)"
    )
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the embedding as a layer: the first virtual stage one layer short"
    )
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the head and loss as a layer: the last virtual stage one layer short"
    )
    pipeline_model_parallel_layout: str | None = opt(
        None,
        'every virtual stage spelled out, Megatron\'s layout string: "Et*3|(tt|)*29,m|L" (E '
        "embedding, t layer, m MTP, L loss, | between stages, (...)*n repeats)",
        "--pp-layout",
    )
    dp: int | None = opt(
        None, "data-parallel size (default: world size / (tp*cp*pp))", "--data-parallel-size"
    )
    dp_replicate: int = opt(
        1,
        "hybrid sharding (HSDP): the dp ranks form this many copies of a ZeRO shard group of "
        "dp/dp_replicate ranks; gradients are reduce-scattered inside a group, then each shard "
        "all-reduced over the copies (needs --zero-stage >= 1)",
        "--num-distributed-optimizer-instances",
    )
    cp: int = opt(
        1,
        "context-parallel size: each sample's sequence split over cp ranks (long contexts)",
        "--context-parallel-size",
    )
    cp_comm_type: str = opt(
        "p2p",
        "context-parallel attention: p2p (ring: K/V blocks passed round the cp ranks) or a2a "
        "(all-to-all: heads exchanged for the sequence, Ulysses) or a2a+p2p (all-to-all within "
        "groups of adjacent cp ranks, the ring across them: --hierarchical-context-parallel-sizes)",
        choices=("p2p", "a2a", "a2a+p2p"),
    )
    hierarchical_context_parallel_sizes: list[int] | None = opt(
        None,
        "a2a+p2p's two levels A P of cp = A*P: all-to-all among A adjacent cp ranks (a node's), "
        "the ring over the P groups of them",
    )
    order: str = opt(
        DEFAULT_ORDER,
        "rank order of the parallel axes, fastest-varying first (TP adjacent keeps it in a node)",
    )
    sequence_parallel: bool = opt(
        False, "shard norm/dropout activations along the sequence over TP"
    )
    tp_comm_overlap: bool = opt(
        False,
        "with --sequence-parallel: the q/k/v and gate/up matmuls run chunk by chunk behind their "
        "input's all-gather, the row-parallel ones ahead of their output's reduce-scatter "
        "(tp chunks along the sequence; docs/architecture.md)",
    )
    ep: int = opt(
        1,
        "expert-parallel size: experts split over ep ranks of tp*dp (it divides tp*dp, not the "
        "world)",
        "--expert-model-parallel-size",
    )
    etp: int = opt(
        1,
        "expert tensor-parallel size: each expert's width split over etp ranks of an ep slot "
        "(ep*etp divides the ranks of a stage)",
        "--expert-tensor-parallel-size",
    )
    pp_schedule: str | None = opt(
        None,
        # the names are the pipeline registry's; validate() refuses an unknown one, naming them
        "pipeline schedule, by its registered name (default: interleaved when vpp >= 2, else 1f1b)",
    )
    distributed_timeout_minutes: float = opt(
        10.0, "collectives waiting longer than this fail the run"
    )
