"""Generation at tp2, pp2 and tp2*pp2 (four gloo ranks) against one process and transformers.

Random HF GPT-2 and Llama models (tests/unit/test_checkpoint_hf.py) are converted to megalite and
loaded in fp64 by every layout from the same checkpoint, each rank reading its slices. Greedy
tokens must equal transformers' `generate`, sampled tokens the one-process run with the same
seed, and every rank must feed the prompt once, then one token per step (the cache is used at
every stage). One spawn runs all layouts: tp2 (dp2), pp2 (dp2), tp2*pp2, and an interleaved
pp2*vpp2 4-layer model.
"""

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config import ModelConfig
from megalite.config_read import from_dict
from megalite.generation import Sampling, generate
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import build_groups, single_process_groups
from megalite.parallel.topology import Topology
from megalite.pipeline.partition import rank_chunks
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW = 8
SAMPLING = Sampling(temperature=0.9, top_k=40, top_p=0.9)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1)]  # (tp, pp, vpp) on four ranks
DEEP = ModelConfig(flavour="llama", num_layers=4, hidden_size=32, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=64, seq_length=32, vocab_size=300)  # fmt: skip


def _run(chunks, groups, prompts=PROMPTS):
    """(greedy, sampled, tokens fed per forward to each chunk's first layer)."""
    fed = [[] for _ in chunks]
    hooks = [
        next(iter(c.layers.values())).register_forward_pre_hook(
            lambda m, args, f=f: f.append(args[0].shape[1])
        )
        for c, f in zip(chunks, fed)
    ]
    greedy = generate(chunks, groups, prompts, NEW)
    for h in hooks:
        h.remove()
    sampled = generate(chunks, groups, prompts, NEW, SAMPLING, torch.Generator().manual_seed(7))
    return greedy, sampled, fed


def _chunks(cfg, groups, pp, vpp, sp):
    return [
        GPTChunk(cfg, groups.tp, **kw, sequence_parallel=sp, dtype=torch.float64).train()
        for kw in rank_chunks(cfg.num_layers, pp, vpp, groups.pp.rank)
    ]


def _layouts(rank, world, paths):
    out = {}
    for tp, pp, vpp in LAYOUTS:
        groups = build_groups(Topology(tp=tp, pp=pp, dp=world // (tp * pp)), torch.device("cpu"))
        for path in paths:
            ckpt = fmt.Checkpoint(path)
            cfg = from_dict({"model": ckpt.model_config}).model
            chunks = _chunks(cfg, groups, pp, vpp, sp=tp > 1)  # as the trainer builds them
            load_model(chunks, groups.tp, ckpt)
            out[(tp, pp, vpp, path)] = _run(chunks, groups)
            # the trainer's chunks come back as they were: training mode, sequence parallel
            assert all(c.training and c.sp == (tp > 1) for c in chunks)
    groups = build_groups(Topology(tp=1, pp=2, dp=2), torch.device("cpu"))
    out["deep"] = _run(_chunks(DEEP, groups, 2, 2, sp=False), groups)
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The one-process references: tiny models, where a second thread only adds waits."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests.unit.test_checkpoint_hf import convert, hf_model

    d = tmp_path_factory.mktemp("gen")
    models, paths = [], []
    for kind in ("gpt2", "llama"):
        m = hf_model(kind, seed=5)
        m.save_pretrained(d / kind, safe_serialization=True)
        convert.main([str(d / kind), str(d / f"{kind}-ml"), "--to", "megalite", "--tp", "2"])
        models.append(m.double())
        paths.append(str(d / f"{kind}-ml"))
    return models, paths


def _one_process(cfg, path=None, prompts=PROMPTS):
    chunk = GPTChunk(cfg, dtype=torch.float64)
    if path:
        load_model([chunk], single_process_groups().tp, fmt.Checkpoint(path))
    return _run([chunk], single_process_groups(), prompts)


def test_every_layout_generates_what_one_process_and_transformers_do(checkpoints):
    from tests.unit.test_checkpoint_hf import hf_greedy

    models, paths = checkpoints
    results = spawn(_layouts, 4, paths)
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        for tp, pp, vpp in LAYOUTS:
            for rank in range(4):
                g, s, fed = results[rank][(tp, pp, vpp, path)]
                assert g == greedy, (tp, pp, rank)
                assert s == sampled, (tp, pp, rank)
                # each chunk saw the padded prompts once, then one token per step
                assert fed == [[max(map(len, PROMPTS))] + [1] * (NEW - 1)], (tp, pp, rank)
    greedy, sampled, _ = _one_process(DEEP)
    for rank in range(4):
        g, s, fed = results[rank]["deep"]
        assert (g, s) == (greedy, sampled), rank
        assert fed == [[9] + [1] * (NEW - 1)] * 2, rank  # both chunks of every rank
