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
  tp2*pp2 give transformers' greedy tokens and the one-process sampled ones.
"""

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config import ModelConfig
from megalite.config_read import from_dict
from megalite.model.gpt import GPTChunk
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
        ref = GPTChunk(cfg, seed=11, dtype=torch.float64)
        expected = ref(tokens, labels)
        expected.backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for sp in (False, True):
            model = GPTChunk(cfg, tp, sequence_parallel=sp, seed=11, dtype=torch.float64)
            what = f"{case} sp={sp}"
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


def _generate(rank, world, paths):
    groups = build_groups(Topology(tp=2, pp=2, dp=1), torch.device("cpu"))
    out = {}
    for path in paths:
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        chunks = _chunks(cfg, groups, 2, 1, sp=True)
        assert len(chunks) == len(rank_chunks(cfg.num_layers, 2, 1, groups.pp.rank))
        load_model(chunks, groups.tp, fmt.Checkpoint(path))
        out[path] = _run(chunks, groups)
    return out


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
    results = spawn(_generate, 4, paths)
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        for rank in range(4):
            g, s, fed = results[rank][path]
            assert (g, s) == (greedy, sampled), (path, rank)
            assert fed == [[max(map(len, PROMPTS))] + [1] * (NEW - 1)], (path, rank)
