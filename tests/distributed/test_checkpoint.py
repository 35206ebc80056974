"""Checkpoints across processes: the sharded load at tp=2 pp=2 and saves that fail safely.

HF models converted to megalite are loaded by four ranks (tp=2 pp=2), each reading only its
slices, and run forward across the pipeline: the logits must be the transformers model's.
"""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint import format as fmt
from megalite.checkpoint import shard_io
from megalite.checkpoint.checkpointer import load_model
from megalite.config import Config
from megalite.config_read import from_dict
from megalite.errors import MegaliteError
from megalite.model.env import LayerEnv
from megalite.model.gpt import GPTChunk
from megalite.parallel.groups import build_groups
from megalite.parallel.topology import Topology
from megalite.pipeline.partition import rank_chunks
from megalite.shape import validate
from megalite.testing import spawn

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def _sharded_logits(rank, world, paths, ids):
    groups = build_groups(Topology(tp=2, pp=2, dp=1), torch.device("cpu"))
    out = []
    for path in paths:
        ckpt = fmt.Checkpoint(path)
        cfg = from_dict({"model": ckpt.model_config}).model
        (kw,) = rank_chunks(cfg.num_layers, 2, 1, groups.pp.rank)
        chunk = GPTChunk(cfg, LayerEnv(tp=groups.tp), **kw).eval()
        load_model([chunk], groups.tp, ckpt)
        with torch.no_grad():
            if groups.pp.rank == 0:
                dist.send(chunk(ids), groups.topo.next_stage(groups.rank))
                out.append(None)
            else:
                h = torch.empty(*ids.shape, cfg.hidden_size)
                dist.recv(h, groups.topo.prev_stage(groups.rank))
                out.append(chunk(h))  # gathered over TP, real vocabulary
    return out


def test_hf_models_load_sharded_at_tp2_pp2(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "hf_tests", ROOT / "tests/unit/test_checkpoint_hf.py"
    )
    hf_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_tests)
    models, paths = [], []
    for kind in ("gpt2", "llama"):
        m = hf_tests.hf_model(kind, seed=3)
        m.save_pretrained(tmp_path / kind, safe_serialization=True)
        dst = tmp_path / f"{kind}-ml"
        hf_tests.convert.main([str(tmp_path / kind), str(dst), "--to", "megalite"])
        models.append(m)
        paths.append(str(dst))
    ids = torch.randint(
        0, hf_tests.VOCAB, (2, hf_tests.SEQ), generator=torch.Generator().manual_seed(0)
    )
    results = spawn(_sharded_logits, 4, paths, ids)
    for k, m in enumerate(models):
        with torch.no_grad():
            ref = m(ids).logits
        for rank in (2, 3):  # both TP ranks of the last stage hold the gathered logits
            assert (results[rank][k] - ref).abs().max() <= 1e-4, (k, rank)


# ---- the Trainer's saves, with a toy dataset ------------------------------------------------------


class _Tokens:
    def __init__(self, n, seq, vocab):
        self.x = np.random.default_rng(0).integers(0, vocab, (n, seq + 1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def _trainer(root, hidden=32, vocab=100, tp=2):
    from megalite.training.trainer import Trainer

    cfg = Config()
    m, t = cfg.model, cfg.training
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = (
        2,
        hidden,
        4,
        16,
        vocab,
    )
    t.micro_batch_size, t.global_batch_size, t.train_iters = 1, 4, 2
    cfg.parallel.tp = tp
    cfg.checkpoint.save = str(root)
    cfg.logging.wandb_mode = "disabled"
    shape = validate(cfg, dist.get_world_size())
    groups = build_groups(shape.topology(), torch.device("cpu"))
    data = SimpleNamespace(train=_Tokens(64, 16, vocab), valid=None, tokenizer=None)
    return Trainer(cfg, shape, groups, data=data)


def _failing_saves(rank, world, root):
    tr = _trainer(root)
    tr.train()  # two steps, then the final save
    assert (Path(root) / fmt.LATEST).read_text() == "iter_0000002"
    errors = []
    real = shard_io.write_shard

    def broken(d, name, tensors):  # one rank's disk fills up half way
        real(d, name, tensors)
        raise OSError(28, "No space left on device")

    tr.iteration = 3
    shard_io.write_shard = broken if rank == 1 else real
    try:
        tr.save()
    except MegaliteError as e:
        errors.append(str(e))
    shard_io.write_shard = real
    dist.barrier()
    for kw in ({"hidden": 64}, {"vocab": 120}):
        try:
            _trainer(root, **kw).resume()
        except MegaliteError as e:
            errors.append(str(e))
    return errors


def test_failed_save_keeps_the_previous_and_mismatches_are_named(tmp_path):
    errors = spawn(_failing_saves, 2, str(tmp_path))
    for e in errors:  # every rank stops with the same line
        assert len(e) == 3
        assert "No space left on device" in e[0] and "previous checkpoints are intact" in e[0]
        assert "tensor embedding.word.weight has shape [100, 32]" in e[1] and "[100, 64]" in e[1]
        assert "vocab_size=100 but this run has 120" in e[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "latest"]
    ck = fmt.Checkpoint(tmp_path)
    ck.verify()
    assert ck.iteration == 2 and ck.index["consumed_samples"] == 8
    assert len(ck.index["rng"]) == 2 and ck.index["optimizer"]["step"] == 2


def _layouts():
    from megalite.testing import tiny_config
    from tests.distributed.test_moe_training import config as moe_config

    def tiny(**kw):
        cfg = tiny_config()
        cfg.optimizer.bucket_size_mb = 0.004  # a few buckets: shards cut parameters mid-row
        for k, v in kw.items():
            setattr(cfg.training if k == "precision" else cfg.optimizer if k == "zero_stage"
                    else cfg.parallel, k, v)  # fmt: skip
        return cfg

    return {
        "tp2 dp2 zero1 bf16": tiny(tp=2, zero_stage=1, precision="bf16"),
        "dp4 zero2": tiny(zero_stage=2),
        "pp2 dp2 zero3": tiny(pp=2, zero_stage=3),
        "moe ep2 over dp4 zero1": moe_config(ep=2, zero_stage=1),  # experts held by edp rank 0
    }


def _optimizer_elements_read(fn, *args) -> int:
    """Elements of optimizer-state tensors read from checkpoints while `fn(*args)` runs."""
    real, read = fmt.Checkpoint.read, []

    def counted(ck, name, region=None):
        t = real(ck, name, region)
        read.append(t.numel() if name.startswith("optimizer.") else 0)
        return t

    fmt.Checkpoint.read = counted
    try:
        fn(*args)
    finally:
        fmt.Checkpoint.read = real
    return sum(read)


def _written_where_held(rank, world, root):
    from megalite.checkpoint.regions import rank_params
    from megalite.testing import tiny_trainer

    out = {}
    for name, cfg in _layouts().items():
        cfg.checkpoint.save = f"{root}/{name.replace(' ', '_')}"
        tr = tiny_trainer(cfg, samples=64)
        for _ in range(2):
            tr.train_step(log=False)
        tr.groups.ledger.reset()
        tr.checkpointer.save(tr.state())
        traffic = sorted(tr.groups.ledger.bytes)
        gathered = tr.opt.state_tensors()  # the reference: the whole state, gathered over DP
        ck, wrong = fmt.Checkpoint(cfg.checkpoint.save), []
        with tr.opt.gathered_params():
            for n, p, spec in rank_params(tr.chunks):
                region = spec.region()
                rows = region[0][1] - region[0][0]
                want = {n: p, **{fmt.opt_name(k, n): t for k, t in gathered.get(n, {}).items()}}
                for key, t in want.items():
                    if not torch.equal(ck.read(key, region), t[:rows]):
                        wrong.append(key)
        # no element is stored twice: the slices of each tensor add up to it
        twice = [n for n, e in ck.tensors.items()
                 if sum(np.prod([b - a for a, b in s["slice"]]) for s in e["shards"]) != np.prod(e["shape"])]  # fmt: skip
        holds_state = {s["file"] for n in ck.names(optimizer=True) for s in ck.tensors[n]["shards"]}
        # a fresh run of the same layout loads it back, each rank reading its shard only
        fresh = tiny_trainer(cfg, samples=64)
        read = _optimizer_elements_read(fresh.checkpointer.load, cfg.checkpoint.save)
        again = fresh.opt.state_tensors()
        lost = [n for n in gathered for k in gathered[n] if not torch.equal(again[n][k], gathered[n][k])]  # fmt: skip
        total = sum(int(np.prod(ck.shape(n))) for n in ck.names(optimizer=True))
        out[name] = (traffic, wrong, twice, len(holds_state), lost, read, total)
    return out


def test_each_rank_writes_the_shard_it_holds(tmp_path):
    """Every rank writes its own ZeRO shard of the weights and the optimizer state (no DP
    gather, ZeRO-3 included), and the checkpoint holds exactly the whole model and the gathered
    state: no element twice, none missing (experts over DP were lost before)."""
    results = spawn(_written_where_held, 4, str(tmp_path))
    for name, (traffic, wrong, twice, writers, lost, _, total) in results[0].items():
        assert traffic == ["world"], (name, traffic)  # the index and RNG states only
        assert not wrong, (name, wrong)
        assert not twice, (name, twice)
        assert writers == 4, (name, writers)  # every rank writes a part of the state
        assert not lost, (name, lost)  # loaded back exactly
        if name == "dp4 zero2":  # no TP replicas, no tied copy: each element is read once
            assert sum(r[name][5] for r in results) == total, name
