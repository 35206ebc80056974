"""The Qwen3 / Qwen2.5 / Llama 3.x / Mistral features sharded, against one process (fp64).

- Layers: forward logits, loss and every gradient of tp2 chunks (with and without sequence
  parallelism) equal the single-process chunk's within 1e-10: Qwen3's q_norm and k_norm (their
  gradient is each rank's heads' part, summed over TP) with split and with replicated k/v
  heads, Qwen2's q/k/v biases, Llama 3's scaled RoPE, Mistral's sliding window, gpt-oss's
  attention sinks (each rank's heads' sinks: their gradient needs no TP reduction).
- Context parallelism: Mistral's sliding window and gpt-oss's sinks with alternating windows at
  cp2 (ring and all-to-all, with and without packed documents) and cp2*tp2 give one process's
  loss and gradients (the sinks' included).
- Generation: random transformers Qwen3, Llama 3 (llama3 rope scaling), Mistral (a window of
  8), Qwen3-MoE (a dense layer among MoE ones) and gpt-oss (attention sinks, alternating
  windows) models converted to megalite and loaded at
  tp2*pp2 give transformers' greedy tokens and the one-process sampled ones; the MoE ones also
  at tp2*pp2*ep2 as tools/generate.py loads them (each rank reading only its experts), Qwen3-MoE
  at tp1*pp2*dp2*ep2 too (experts over the replicas), and the tool refuses an ep the experts,
  the ranks or a dense model cannot take.
"""

import re

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.checkpoint import mapped
from megalite.checkpoint.checkpointer import load_model
from megalite.cli import generate as gen_tool
from megalite.config import ModelConfig
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.model.moe import moe_layers
from megalite.parallel import comm
from megalite.parallel.groups import build_groups
from megalite.parallel.specs import spec_of
from megalite.parallel.topology import Topology
from megalite.pipeline.partition import rank_chunks
from megalite.testing import spawn
from tests.distributed import test_context_parallel
from tests.distributed.test_generation import NEW, PROMPTS, _chunks, _one_process, _run

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

CASES = [
    dict(flavour="qwen3", kv_channels=16, num_query_groups=2),  # k/v heads split over TP
    dict(flavour="qwen3", kv_channels=16, num_query_groups=1),  # one k/v head on every rank
    dict(flavour="qwen2", num_query_groups=2),
    dict(flavour="llama", rope_scaling="llama3", rope_original_max_position_embeddings=4,
         rotary_base=5e5),
    dict(flavour="mistral", sliding_window=3),
    dict(flavour="gpt_oss", num_query_groups=2),  # attention sinks, split with the heads
    dict(flavour="gpt_oss", num_query_groups=1, sliding_window=3, window_attn_skip_freq=2),
]  # fmt: skip


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= 1e-10, f"{what}: max abs diff {err}"


def _layers(rank, world):
    tp = build_groups(Topology(tp=world), torch.device("cpu")).tp
    for case in CASES:
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                          vocab_size=301, make_vocab_size_divisible_by=8, **case)  # fmt: skip
        ids = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
        tokens, labels = ids[:, :-1], ids[:, 1:]
        ref = GPTChunk(cfg, LayerEnv(seed=11, dtype=torch.float64))
        expected = ref(tokens, labels)
        expected.backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for sequence_parallel in (False, True):
            model = GPTChunk(
                cfg,
                LayerEnv(tp=tp, sequence_parallel=sequence_parallel, seed=11, dtype=torch.float64),
            )
            what = f"{case} sequence_parallel={sequence_parallel}"
            with torch.no_grad():
                _close(model(tokens), ref(tokens), f"{what} logits")
            loss = model(tokens, labels)
            _close(loss, expected, f"{what} loss")
            loss.backward()
            for name, p in model.named_parameters():
                grad, full, spec = p.grad.clone(), grads[name], spec_of(p)
                if "tp" in spec.grad_sum:
                    comm.all_reduce(grad, tp)
                if name in ("embedding.word.weight", "output.weight"):  # padded further
                    full = F.pad(full[: cfg.vocab_size], (0, 0, 0, model.vocab - cfg.vocab_size))
                if spec.split_dim is not None:
                    full = full.chunk(tp.size, spec.split_dim)[tp.rank]
                _close(grad, full, f"{what} grad of {name}")
    return True


def test_tp2_layers_match_one_process():
    assert all(spawn(_layers, 2))


WINDOW_CASES = [
    dict(flavour="mistral", sliding_window=5, num_query_groups=2),
    # gpt-oss: attention sinks (added once to the ring's merged blocks) and alternating windows
    dict(flavour="gpt_oss", sliding_window=5, window_attn_skip_freq=2, num_query_groups=2),
]


def _cp_window(rank, world, tp, comm_type):
    # this spawned process's copy only; gpt-oss's ring at cp2*tp2 and its all-to-all at cp2
    cheap = (tp, comm_type) == (1, "p2p")
    test_context_parallel.MODEL_CASES = WINDOW_CASES[:1] if cheap else WINDOW_CASES
    return test_context_parallel._cp_model(rank, world, tp, comm_type)


@pytest.mark.parametrize("tp,world,comm_type", [(1, 2, "p2p"), (1, 2, "a2a"), (2, 4, "p2p")])
def test_sliding_window_with_context_parallelism_matches_one_process(tp, world, comm_type):
    for rank_out in spawn(_cp_window, world, tp, comm_type):
        for _, documents, _, errs in rank_out:
            bad = {k: v for k, v in errs.items() if v > 1e-10}
            assert not bad, (comm_type, documents, bad)


def _generate(rank, world, paths, over_replicas=()):
    """Each model at tp2*pp2 (chunks as the trainer builds them, experts whole); an MoE model
    also at tp2*pp2*ep2 as tools/generate.py lays it out and loads it (experts over the TP
    ranks), and those in `over_replicas` at tp1*pp2*dp2*ep2 (experts over the two replicas),
    with the expert rows each rank read from the checkpoint."""
    groups = build_groups(Topology(tp=2, pp=2, dp=1), torch.device("cpu"))
    out, ep_groups = {}, {}
    for path in paths:
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        chunks = _chunks(cfg, groups, 2, 1, sequence_parallel=True)
        assert len(chunks) == len(rank_chunks(cfg.num_layers, 2, 1, groups.pp.rank))
        load_model(chunks, groups.tp, fmt.Checkpoint(path))
        out[path] = _run(chunks, groups)
        for tp in [2, 1] if path in over_replicas else [2] if cfg.num_experts else []:
            ckpt = fmt.Checkpoint(path)
            shape = gen_tool.layout(ckpt, world, tp=tp, pp=2, ep=2)
            if tp not in ep_groups:
                ep_groups[tp] = build_groups(shape.topology(), torch.device("cpu"))
            g = ep_groups[tp]
            rows = _track_expert_reads(ckpt, cfg.num_experts)
            chunks = gen_tool.load_chunks(ckpt, cfg, shape, g, dtype="fp64")
            sizes = sorted({m.ep.ep for _, m in moe_layers(chunks)})  # [] on a dense stage
            out[path, "ep2", tp] = (*_run(chunks, g), g.ep.rank, sizes, sorted(rows))
    return out


def _track_expert_reads(ckpt, num_experts) -> set:
    """The ranges of experts (dim 0) that `ckpt.read` or the mapped loader
    (checkpoint/mapped.py `_slice`) is asked for, filled as they read."""
    rows, read, mapped_slice = set(), ckpt.read, mapped._slice

    def tracked(name, region=None):
        if ".experts." in name:
            rows.add(tuple(region[0]) if region else (0, num_experts))
        return read(name, region)

    def tracked_slice(c, name, region):
        if c is ckpt and ".experts." in name:
            rows.add(tuple(region[0]))
        return mapped_slice(c, name, region)

    ckpt.read, mapped._slice = tracked, tracked_slice
    return rows


def _refuses_bad_ep(dense, moe):
    """tools/generate.py's layout refuses, in one line and before any process group, an ep the
    experts or the ranks of a stage cannot take, and ep on a dense model."""
    for path, ep, why in [(moe, 3, "num_experts=4 is not divisible by ep=3"),
                          (moe, 4, "ep=4 does not divide tp*dp=2*1, the ranks of a pipeline"),
                          (dense, 2, "--ep 2 needs a mixture-of-experts model")]:  # fmt: skip
        with pytest.raises(MegaliteError, match=re.escape(why)):
            gen_tool.layout(fmt.Checkpoint(path), 4, tp=2, pp=2, ep=ep)


def _check_ep2(results, path, cfg, greedy, sampled, tp=2):
    """The ep2 run at tp gave the one-process tokens, and each rank holding MoE layers split
    them over ep2 and read only its half of the experts (ep rank r: global experts
    [r E/2, (r+1) E/2); the ep groups are ranks {0, 1} and {2, 3}, the two pipeline stages)."""
    half, stages = cfg.num_experts // 2, set()
    for rank in range(4):
        g, s, _, ep_rank, sizes, rows = results[rank][path, "ep2", tp]
        assert (g, s) == (greedy, sampled), (path, rank, "ep2", tp)
        assert ep_rank == rank % 2 and sizes in ([], [2]), (rank, ep_rank, sizes)
        assert rows == ([(ep_rank * half, (ep_rank + 1) * half)] if sizes else []), (rank, rows)
        stages |= {rank // 2} if sizes else set()
    assert stages, "no rank holds an MoE layer"


def test_qwen3_llama3_mistral_generate_at_tp2_pp2_what_transformers_does(tmp_path):
    from tests.unit.test_checkpoint_gpt_oss import gpt_oss
    from tests.unit.test_checkpoint_hf import convert, hf_greedy
    from tests.unit.test_checkpoint_qwen3_moe import qwen3_moe
    from tests.unit.test_hf_families import hf_family

    models, paths = [], []
    makers = {name: lambda name=name: hf_family(name, seed=5) for name in ("qwen3", "llama3")}
    makers["mistral"] = lambda: hf_family("mistral", seed=5)  # a window of 8 in the KV cache
    makers["qwen3-moe"], makers["gpt-oss"] = qwen3_moe, gpt_oss  # sinks, alternating windows
    for name, make in makers.items():
        m = make()
        m.save_pretrained(tmp_path / name, safe_serialization=True)
        convert.main([str(tmp_path / name), str(tmp_path / f"{name}-ml"), "--to", "megalite"])
        # transformers' MoE routing runs in fp32 only (its router casts to float): keep it there
        models.append(m if name in ("qwen3-moe", "gpt-oss") else m.double())
        paths.append(str(tmp_path / f"{name}-ml"))
    _refuses_bad_ep(paths[0], paths[3])  # qwen3 (dense), qwen3-moe (4 experts)
    results = spawn(_generate, 4, paths, [paths[3]])  # qwen3-moe's experts over dp too
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        for rank in range(4):
            g, s, fed = results[rank][path]
            assert (g, s) == (greedy, sampled), (path, rank)
            assert fed == [[max(map(len, PROMPTS))] + [1] * (NEW - 1)], (path, rank)
        if cfg.num_experts:
            _check_ep2(results, path, cfg, greedy, sampled)
        if path == paths[3]:
            _check_ep2(results, path, cfg, greedy, sampled, tp=1)
