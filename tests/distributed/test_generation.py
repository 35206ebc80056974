"""Generation at tp2, pp2 and tp2*pp2 (four gloo ranks) against one process and transformers.

Random HF GPT-2 and Llama models (tests/unit/test_checkpoint_hf.py) are converted to megalite and
loaded in fp64 by every layout from the same checkpoint, each rank reading its slices. Greedy
tokens must equal transformers' `generate`, sampled tokens the one-process run with the same
seed, and every rank must feed the prompt once, then one token per step (the cache is used at
every stage). One spawn runs all layouts: tp2 (dp2), pp2 (dp2), tp2*pp2, and an interleaved
pp2*vpp2 4-layer model.

Context parallelism (generation.CPKVCache) in the same spawn, at cp2 (dp2), cp2*tp2 and
cp2*pp2: random transformers Mistral (a window of 8, shorter than the prompts), Llama 3 (llama3
rope scaling) and gpt-oss (attention sinks, alternating windows of 6) models give transformers'
greedy tokens and the one-process sampled ones. The prompts differ in length, so the left
padding (widened to 16 slots, four chunks of 4) ends inside another rank's chunk; each rank
feeds its 8 slots of the prompt once, then every new token.
"""

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config import ModelConfig
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.generation import generate, generate_scored
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import build_groups, single_process_groups
from megalite.parallel.sampling import Sampling
from megalite.parallel.topology import Topology
from megalite.pipeline.partition import rank_chunks
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
NEW = 8
SAMPLING = Sampling(temperature=0.9, top_k=40, top_p=0.9)
LAYOUTS = [(2, 1, 1), (1, 2, 1), (2, 2, 1)]  # (tp, pp, vpp) on four ranks
CP_LAYOUTS = [dict(cp=2, dp=2), dict(tp=2, cp=2), dict(cp=2, pp=2)]
# 13, 6 and 10 tokens: padded to 16 at cp2, row 1's ten padding slots span chunks 0, 1 and 2
CP_PROMPTS = [list(range(20, 33)), [7, 3, 9, 4, 8, 2], [40, 41, 5, 44, 6, 46, 47, 9, 49, 50]]
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


def _scored(chunks, groups, prompts=PROMPTS):
    """Log-probabilities of the prompts (echo) and of 3 new tokens, with the top 3 (a dict:
    what a spawned rank returns is loaded with weights_only)."""
    return vars(generate_scored(chunks, groups, prompts, 3, logprobs=3, echo=True))


def _same_scores(a, b, what):
    """Equal tokens and top ids; log-probabilities within fp64 rounding."""

    def ids(tops):
        return [[[i for i, _ in t] for t in row] for row in tops]

    def values(tops):
        return [[v for _, v in t] for row in tops for t in row]

    for key in ("top", "prompt_top"):
        assert ids(a[key]) == ids(b[key]), (what, key)
        torch.testing.assert_close(values(a[key]), values(b[key]), rtol=0, atol=1e-10)
    assert a["tokens"] == b["tokens"], what
    for key in ("logprobs", "prompt_logprobs"):
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-10, msg=f"{what} {key}")


def _chunks(cfg, groups, pp, vpp, sequence_parallel):
    return [
        GPTChunk(
            cfg,
            LayerEnv(tp=groups.tp, sequence_parallel=sequence_parallel, dtype=torch.float64),
            **kw,
        ).train()
        for kw in rank_chunks(cfg.num_layers, pp, vpp, groups.pp.rank)
    ]


def _layouts(rank, world, paths, cp_paths=()):
    out = {}
    for sizes in CP_LAYOUTS:
        groups = build_groups(Topology(**sizes), torch.device("cpu"))
        for path in cp_paths:
            cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
            chunks = _chunks(cfg, groups, groups.pp.size, 1, sequence_parallel=groups.tp.size > 1)
            load_model(chunks, groups.tp, fmt.Checkpoint(path))
            out[(str(sizes), path)] = _run(chunks, groups, CP_PROMPTS)
            if (sizes, path) == (CP_LAYOUTS[0], cp_paths[0]):  # without the cache: rank alone
                out["no cache"] = generate(chunks, groups, CP_PROMPTS, NEW, use_cache=False)
                out["cp scored"] = vars(generate_scored(chunks, groups, CP_PROMPTS, 3, logprobs=3))
    for tp, pp, vpp in LAYOUTS:
        groups = build_groups(Topology(tp=tp, pp=pp, dp=world // (tp * pp)), torch.device("cpu"))
        for path in paths:
            ckpt = fmt.Checkpoint(path)
            cfg = from_dict({"model": ckpt.model_config}).model
            # as the trainer builds them
            chunks = _chunks(cfg, groups, pp, vpp, sequence_parallel=tp > 1)
            load_model(chunks, groups.tp, ckpt)
            out[(tp, pp, vpp, path)] = _run(chunks, groups)
            out[(tp, pp, vpp, path, "scored")] = _scored(chunks, groups)
            # the trainer's chunks come back as they were: training mode, sequence parallel
            assert all(c.training and bool(c.sequence_parallel) == (tp > 1) for c in chunks)
    groups = build_groups(Topology(tp=1, pp=2, dp=2), torch.device("cpu"))
    out["deep"] = _run(_chunks(DEEP, groups, 2, 2, sequence_parallel=False), groups)
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
    """(models, paths) for the tp/pp layouts (GPT-2, Llama) and for cp (Mistral, Llama 3,
    gpt-oss)."""
    from tests.unit.test_checkpoint_gpt_oss import gpt_oss
    from tests.unit.test_checkpoint_hf import convert, hf_model
    from tests.unit.test_hf_families import hf_family

    d = tmp_path_factory.mktemp("gen")
    models, paths = [], []
    makers = {"gpt2": hf_model, "llama": hf_model, "mistral": hf_family, "llama3": hf_family}
    makers["gpt-oss"] = lambda kind, seed: gpt_oss()  # sinks, alternating windows of 6
    for kind, make in makers.items():
        m = make(kind, seed=5)
        m.save_pretrained(d / kind, safe_serialization=True)
        convert.main([str(d / kind), str(d / f"{kind}-ml"), "--to", "megalite", "--tp", "2"])
        # transformers' MoE routing runs in fp32 only (its router casts to float): keep it there
        models.append(m if kind == "gpt-oss" else m.double())
        paths.append(str(d / f"{kind}-ml"))
    return models[:2], paths[:2], models[2:], paths[2:]


def _one_chunk(cfg, path=None):
    chunk = GPTChunk(cfg, LayerEnv(dtype=torch.float64))
    if path:
        load_model([chunk], single_process_groups().tp, fmt.Checkpoint(path))
    return [chunk], single_process_groups()


def _one_process(cfg, path=None, prompts=PROMPTS):
    return _run(*_one_chunk(cfg, path), prompts)


def test_every_layout_generates_what_one_process_and_transformers_do(checkpoints):
    from tests.unit.test_checkpoint_hf import hf_greedy

    models, paths, cp_models, cp_paths = checkpoints
    results = spawn(_layouts, 4, paths, cp_paths)
    for m, path in zip(models, paths):
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path)
        assert greedy == [hf_greedy(m, p, NEW) for p in PROMPTS], path
        scored = _scored(*_one_chunk(cfg, path))
        for tp, pp, vpp in LAYOUTS:
            for rank in range(4):
                g, s, fed = results[rank][(tp, pp, vpp, path)]
                assert g == greedy, (tp, pp, rank)
                assert s == sampled, (tp, pp, rank)
                # each chunk saw the padded prompts once, then one token per step
                assert fed == [[max(map(len, PROMPTS))] + [1] * (NEW - 1)], (tp, pp, rank)
                _same_scores(results[rank][(tp, pp, vpp, path, "scored")], scored, (tp, pp, rank))
    greedy, sampled, _ = _one_process(DEEP)
    for rank in range(4):
        g, s, fed = results[rank]["deep"]
        assert (g, s) == (greedy, sampled), rank
        assert fed == [[9] + [1] * (NEW - 1)] * 2, rank  # both chunks of every rank
    for m, path in zip(cp_models, cp_paths):  # context parallelism
        cfg = from_dict({"model": fmt.Checkpoint(path).model_config}).model
        greedy, sampled, _ = _one_process(cfg, path, CP_PROMPTS)
        assert greedy == [hf_greedy(m, p, NEW) for p in CP_PROMPTS], path
        for sizes in CP_LAYOUTS:
            for rank in range(4):
                g, s, fed = results[rank][(str(sizes), path)]
                assert (g, s) == (greedy, sampled), (sizes, path, rank)
                assert fed == [[8] + [1] * (NEW - 1)], (sizes, path, rank)
        if path == cp_paths[0]:
            assert all(r["no cache"] == greedy for r in results)
            one = vars(generate_scored(*_one_chunk(cfg, path), CP_PROMPTS, 3, logprobs=3))
            for rank in range(4):  # new tokens' scores at cp2: from cp rank 0, as the tokens
                _same_scores(results[rank]["cp scored"], one, ("cp", rank))


def test_latent_attention_at_cp_is_refused_in_one_line():
    from megalite.parallel.comm import Group

    cfg = ModelConfig(flavour="deepseek_v3", num_layers=1, hidden_size=32, num_attention_heads=4,
                      seq_length=16, vocab_size=64)  # fmt: skip

    class Groups:  # a cp axis of two, without starting torch.distributed
        tp = pp = Group("tp", [0], 0)
        cp = Group("cp", [0, 1], 0)
        device = torch.device("cpu")

    with pytest.raises(MegaliteError, match="latent attention"):
        generate([GPTChunk(cfg)], Groups, [[1, 2]], 2)
