"""megalite's samples equal megatron-core's, token for token (megatron-core is the oracle).

The same documents are written twice: as Megatron's MMIDIDX files by its IndexedDatasetBuilder
(what its GPTDataset reads) and as megalite's own files (what build_datasets reads). Megatron's
datasets come from its BlendedMegatronDatasetBuilder with the sizes Megatron's training asks for
(train_iters * G, (train_iters // eval_interval + 1) * eval_iters * G, eval_iters * G); sample i
of every split must be the same tokens. Megatron's sampler takes samples in order, so global
batch i is samples [i*G, (i+1)*G) of the train split on both sides.
"""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list

from megalite.config import Config
from megalite.data import gpt_dataset
from megalite.data import sample_order as order
from megalite.data.indexed_dataset import MEGALITE, IndexedDataset, IndexedDatasetWriter
from megalite.data.sampler import BatchSampler, get_batch
from megalite.data.splits import parse_split, split_sequences, split_sizes

SEQ = 16
EOS = 0


class FakeTokenizer:
    """What both builders ask of a tokenizer: its size, EOS, an identity; no text needed."""

    vocab_size = 1000
    eod = EOS
    unique_identifiers = OrderedDict(kind="fake")
    model_path = "fake.model"
    fingerprint = None


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """{name: (Megatron's prefix, the prefix megalite reads)}: 'a' (50 documents of one
    sequence), 'b' (80 documents of one to three sequences, as Megatron's sentence splitting
    writes) read by megalite from Megatron's files, and 'a-own': megalite's own index format
    of 'a'."""
    d = tmp_path_factory.mktemp("order")
    rng = np.random.default_rng(0)
    out, written = {}, {}
    for name, ndocs, most in (("a", 50, 1), ("b", 80, 3)):
        megatron, docs = str(d / f"{name}_text_document"), []
        builder = IndexedDatasetBuilder(megatron + ".bin", dtype=np.uint16)
        for _ in range(ndocs):
            lengths = rng.integers(1, 40, int(rng.integers(1, most + 1))).tolist()
            doc = rng.integers(1, 1000, sum(lengths))
            doc[-1] = EOS  # the writer's EOS ends each document
            builder.add_document(torch.tensor(doc), lengths)
            docs.append(doc)
        builder.finalize(megatron + ".idx")
        out[name], written[name] = (megatron, megatron), docs
    own = str(d / "a_own")
    with IndexedDatasetWriter(own, FakeTokenizer.vocab_size, index_format=MEGALITE) as w:
        for doc in written["a"]:
            w.add_document(doc)
        w.finalize()
    out["a-own"] = (out["a"][0], own)
    return out


def _paths(data, spec, side):
    return [x if x not in data else data[x][side] for x in spec] if spec else []


def megatron_datasets(data, training, data_path=(), split=None, **per_split):
    if data_path:
        kw = dict(blend=get_blend_from_list(_paths(data, data_path, 0)), split=split)
    else:
        names = ("train_data_path", "valid_data_path", "test_data_path")
        blends = [get_blend_from_list(_paths(data, per_split.get(n), 0) or None) for n in names]
        kw = dict(blend_per_split=blends)
    cfg = GPTDatasetConfig(
        random_seed=training.seed,
        sequence_length=SEQ,
        tokenizer=FakeTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        **kw,
    )
    t = training
    sizes = [
        t.train_iters * t.global_batch_size,
        (t.train_iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size,
        t.eval_iters * t.global_batch_size,
    ]
    assert split_sizes(t) == sizes
    return BlendedMegatronDatasetBuilder(MegatronGPTDataset, sizes, lambda: True, cfg).build()


def megalite_datasets(
    data, monkeypatch, training, data_path=(), split="98,2,0", cache=None, **per_split
):
    monkeypatch.setattr(gpt_dataset, "load_tokenizer", lambda *a: FakeTokenizer())
    cfg = Config()
    cfg.data.data_cache_path = cache
    cfg.model.seq_length, cfg.training = SEQ, training
    cfg.data.tokenizer_model, cfg.data.split = "fake.model", split or "98,2,0"
    cfg.data.data_path = _paths(data, data_path, 1)
    for name, spec in per_split.items():
        setattr(cfg.data, name, _paths(data, spec, 1))
    return gpt_dataset.build_datasets(cfg)


def sample(megatron_ds, i) -> np.ndarray:
    x = megatron_ds[i]  # tokens and labels: the seq + 1 tokens shifted by one
    return np.concatenate([x["tokens"].numpy(), x["labels"].numpy()[-1:]])


def training(iters, gbs=8, eval_interval=10, eval_iters=2, seed=1234):
    t = Config().training
    t.train_iters, t.global_batch_size, t.seed = iters, gbs, seed
    t.eval_interval, t.eval_iters = eval_interval, eval_iters
    return t


CASES = {
    # one prefix over 13 epochs: the last, short one shuffled apart (the 80% rule)
    "epochs": (training(75), dict(data_path=["a"], split="80,15,5")),
    # two epochs, the last one shuffled with the first
    "two-epochs": (training(11, seed=7), dict(data_path=["a"], split="80,15,5")),
    "one-epoch": (training(3), dict(data_path=["a"], split="80,20")),
    "megalite-index": (training(30), dict(data_path=["a-own"], split="80,15,5")),
    "blend": (training(50, seed=3), dict(data_path=["0.3", "a", "0.7", "b"], split="80,15,5")),
    "blend-by-size": (training(50, seed=3), dict(data_path=["a", "b"], split="90,10")),
    "one-weighted": (training(20), dict(data_path=["1", "a"], split="80,15,5")),
    "per-split": (
        training(40, gbs=4, seed=5),
        dict(train_data_path=["2", "a", "1", "b"], valid_data_path=["b"], split=None),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_samples_equal_megatron(data, monkeypatch, case):
    t, spec = CASES[case]
    theirs = megatron_datasets(data, t, **spec)
    ours = megalite_datasets(data, monkeypatch, t, **spec)
    ours = (ours.train, ours.valid, ours.test)
    for name, mine, ref in zip(("train", "valid", "test"), ours, theirs):
        assert (mine is None) == (ref is None), name
        if ref is None:
            continue
        assert len(mine) == len(ref), name
        for i in range(len(ref)):
            assert np.array_equal(mine[i], sample(ref, i)), (case, name, i)
        # what the trainer feeds the model: Megatron's tokens and labels
        tokens, labels = get_batch(mine, [0, len(ref) - 1])
        assert torch.equal(tokens, torch.stack([ref[0]["tokens"], ref[len(ref) - 1]["tokens"]]))
        assert torch.equal(labels, torch.stack([ref[0]["labels"], ref[len(ref) - 1]["labels"]]))
    # global batches: every dp rank's micro-batches of step k are the train samples Megatron's
    # sampler gives it (run by hand: runs of mbs*dp, rank r takes its r-th mbs; a blend by
    # size can be shorter than the run, where Megatron stops and megalite starts over)
    g, mbs, dp, n = t.global_batch_size, 2, 2, len(ours[0])
    sampler = BatchSampler(n, g, mbs, 1, dp)
    for k in range(t.train_iters):
        starts = range(k * g + mbs, (k + 1) * g, mbs * dp)
        assert sampler.next_batch() == [[(s + j) % n for j in range(mbs)] for s in starts]


def test_the_cases_cover_both_last_epoch_rules(data):
    lengths = IndexedDataset(data["a"][1]).sequence_lengths
    start, stop = split_sequences(len(lengths), parse_split("80,15,5"))[0]
    tokens = int(lengths[start:stop].sum())
    rules = []
    for case in ("epochs", "two-epochs"):
        n = CASES[case][0].train_iters * 8
        epochs = order.num_epochs(tokens, n, SEQ)
        rules.append((epochs > 1, order.separate_last_epoch(tokens, epochs, n, SEQ)))
    assert rules == [(True, True), (True, False)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_index_equals_megatrons_helper_with_empty_documents(seed):
    from megatron.core.datasets import helpers

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, 60).astype(np.int32)
    lengths[rng.integers(0, 60, 10)] = 0  # empty sequences never hold a sample boundary
    doc_index = np.tile(np.arange(60, dtype=np.int32), 3)
    rng.shuffle(doc_index)
    tokens = int(lengths.sum())
    num_samples = order.samples_in(3 * tokens, SEQ)
    want = helpers.build_sample_idx(lengths, doc_index, SEQ, 3, tokens, True, True)
    got = order.sample_index(lengths, doc_index, SEQ, num_samples)
    assert got.shape == want.shape and np.array_equal(got, want)


def test_blending_indices_equal_megatrons_helper():
    from megatron.core.datasets import helpers

    for weights in ([0.3, 0.7], [0.1, 0.2, 0.3, 0.4], order.normalise([5, 1, 1])):
        want_ds, want_local = np.zeros(5000, np.int16), np.zeros(5000, np.int64)
        helpers.build_blending_indices(want_ds, want_local, weights, len(weights), 5000, False)
        got_ds, got_local = order.blending_indices(weights, 5000)
        assert np.array_equal(got_ds, want_ds) and np.array_equal(got_local, want_local)
