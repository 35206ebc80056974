"""Megatron-LM checkpoints written by megatron-core itself on several ranks, both ways.

A Megatron GPTModel is built on gloo ranks (tests/megatron_oracle.py) at tp=2 (GPT-2 style:
LayerNorm, biases, tied), at pp=2 with two virtual stages each (Llama style: GQA, SwiGLU, RoPE,
untied), at ep=2 (Llama style with 4 experts, top-2) and at pp=2 with uneven stages (6 layers
as 1 | 5, --decoder-first-pipeline-num-layers 1; exported as 2 | 4 over two virtual stages
each, --decoder-last-pipeline-num-layers 4), and saved as Megatron-LM saves it
(legacy mp_rank_* files and torch_dist). Each imports into megalite (`megalite-convert --from
megatron`) with Megatron's logits (fp32, 1e-5), also under TransformerEngine's names. Exported
back at the source layout, every rank file holds Megatron's own tensors and args; exported at
another layout (both formats), megatron-core loads it on its own ranks with the same logits.
Read directly (--load MEGATRON_DIR), each gives the import's tensors, bitwise.
Bad input (args that contradict the tensors, a missing mp_rank directory) is one line and
writes nothing. Training on from the import at another layout:
tests/e2e/test_megatron_workflows.py.
"""

import shutil
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.errors import MegaliteError
from tests import megatron_oracle as mo
from tests import megatron_oracle_files as mf

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# (architecture, the layout Megatron saved it at, the layout megalite exports it back to)
CASES = {
    "gpt2-tp2": (mo.GPT2, mo.Layout(tp=2), mo.Layout(pp=2, vpp=2)),
    "llama-pp2vpp2": (mo.LLAMA, mo.Layout(pp=2, vpp=2), mo.Layout(tp=2)),
    "moe-ep2": (mo.MOE, mo.Layout(ep=2), mo.Layout(tp=2)),
    # uneven stages: 1 | 5 layers saved, exported as rank 0's 2 | rank 1's 4 over two chunks each
    "llama6-pp2first1": (mo.LLAMA6, mo.Layout(pp=2, first=1), mo.Layout(pp=2, vpp=2, last=4)),
}
FORMATS = ("legacy", "torch_dist")


def convert(*argv):
    from megalite.cli import convert as cli

    cli.main([str(a) for a in argv])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case saved by megatron-core (root/legacy, root/torch_dist) and imported into
    megalite from each format (root/ml-legacy, root/ml-torch_dist): {case: (root, x, logits)}."""
    roots = {name: tmp_path_factory.mktemp(name) for name in CASES}
    jobs = [(arch, layout, str(roots[name]), mo.tokens(arch), 0)
            for name, (arch, layout, _) in CASES.items()]  # fmt: skip
    out = {}
    for name, (arch, layout, _, x, _), logits in zip(CASES, jobs, mo.run(mo.save_ranks, jobs)):
        assert logits.shape == (*x.shape, layout.padded_vocab(arch))
        for form in FORMATS:
            convert(roots[name] / form, roots[name] / f"ml-{form}", "--to", "megalite",
                    "--from", "megatron")  # fmt: skip
        out[name] = (roots[name], x, logits)
    return out


@pytest.fixture(scope="module", params=list(CASES))
def source(request, saved):
    """One case: (arch, its Megatron layout, the export target layout, root, tokens, logits)."""
    arch, layout, target = CASES[request.param]
    return (arch, layout, target, *saved[request.param])


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    """Every case's import exported back at its target layout (legacy; torch_dist padded for
    the target's tp) and loaded by megatron-core there: {(case, format): (dir, logits)}."""
    jobs, dirs = [], []
    for name, (arch, _, target) in CASES.items():
        root, x, _ = saved[name]
        flags = target.convert_flags()
        for form in FORMATS:
            out = tmp_path_factory.mktemp(f"{name}-{form}") / "out"
            convert(root / "ml-legacy", out, "--to", "megatron", "--format", form, *flags)
            jobs.append((arch, target, str(out), form, x))
            dirs.append(((name, form), out))
    return {key: (d, logits) for (key, d), logits in zip(dirs, mo.run(mo.load_ranks, jobs))}


@pytest.mark.parametrize("form", FORMATS)
def test_import_gives_megatrons_logits(source, form):
    arch, layout, _, root, x, theirs = source
    ours = mo.megalite_logits(root / f"ml-{form}", x)
    assert ours.shape[:2] == x.shape and ours.shape[-1] >= arch.vocab
    assert (ours[..., : arch.vocab] - theirs[..., : arch.vocab]).abs().max() <= 1e-5
    ckpt = fmt.Checkpoint(root / f"ml-{form}")
    assert ckpt.model_config["vocab_size"] == arch.vocab  # the padding stripped
    assert ckpt.model_config["num_layers"] == arch.num_layers


@pytest.mark.parametrize("form", FORMATS)
def test_load_reads_megatron_directly_as_the_import(source, form):
    """--load MEGATRON_DIR (checkpoint/megatron_direct.py) reads what the import wrote: the
    same model config, tensors (bitwise; any region of them) and, beyond a plain import, the
    iteration, consumed samples and LR schedule position; the optimizer state is not mapped
    (one note)."""
    from megalite.checkpoint.megatron_direct import open_checkpoint

    root = source[3]
    direct, imported = open_checkpoint(root / form), fmt.Checkpoint(root / f"ml-{form}")
    assert direct.model_config == imported.model_config
    assert (direct.iteration, direct.index["consumed_samples"]) == (mf.ITERATION, mf.ITERATION * 8)
    assert direct.index["schedule_samples"] == mf.SCHEDULE_SAMPLES  # the LR scheduler's num_steps
    assert direct.index["optimizer"] is None
    assert ("optimizer state is not mapped" in direct.load_note) == (form == "legacy")
    assert sorted(direct.names()) == sorted(imported.names())
    for name in imported.names():
        assert direct.tensors[name] == {k: imported.tensors[name][k] for k in ("shape", "dtype")}
        assert torch.equal(direct.read(name), imported.read(name)), name
        half = [(0, (n + 1) // 2) for n in imported.shape(name)]
        assert torch.equal(direct.read(name, half), imported.read(name, half)), name


def test_transformer_engine_names_import_alike(source, tmp_path):
    """The same run saved with --transformer-impl transformer_engine (its names: norms fused
    into linear_qkv/linear_fc1, --moe-grouped-gemm experts, extra states as BytesIO) imports
    alike."""
    arch, layout, _, root, x, theirs = source
    mf.as_transformer_engine(root / "legacy", tmp_path / "te", grouped_experts=True)
    first = tmp_path / "te" / f"iter_{mf.ITERATION:07d}" / mf.rank_dir(layout, 0, 0)
    names = torch.load(first / "model_optim_rng.pt", weights_only=False)[mf.model_keys(layout)[0]]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    convert(tmp_path / "te", tmp_path / "ml", "--to", "megalite")
    ours = mo.megalite_logits(tmp_path / "ml", x)
    assert (ours[..., : arch.vocab] - theirs[..., : arch.vocab]).abs().max() <= 1e-5


# what a Megatron run's args must say for this model (its checkpoint checks, the model flags)
ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "max_position_embeddings", "padded_vocab_size", "position_embedding_type",
        "normalization", "swiglu", "add_bias_linear", "add_qkv_bias", "num_experts",
        "untie_embeddings_and_output_weights", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "make_vocab_size_divisible_by",
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")  # fmt: skip
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_export_at_the_source_layout_is_megatrons_own_files(source, impl, tmp_path):
    """Back at the layout Megatron saved: every rank file holds Megatron's own tensors under
    its names (the vocabulary padding aside: zeros), and its args say what Megatron's did."""
    arch, layout, _, root, _, _ = source
    theirs_root = root / "legacy"
    if impl == "transformer_engine":
        theirs_root = tmp_path / "te"
        mf.as_transformer_engine(root / "legacy", theirs_root)
    flags = layout.convert_flags()
    convert(root / "ml-legacy", tmp_path / "out", "--to", "megatron", "--format", "legacy",
            "--transformer-impl", impl, *flags)  # fmt: skip
    theirs_dirs = sorted(p.name for p in (theirs_root / f"iter_{mf.ITERATION:07d}").iterdir())
    assert sorted(p.name for p in (tmp_path / "out" / f"iter_{0:07d}").iterdir()) == theirs_dirs
    for rank in theirs_dirs:
        ours = torch.load(tmp_path / "out" / f"iter_{0:07d}" / rank / "model_optim_rng.pt",
                          weights_only=False)  # fmt: skip
        theirs = torch.load(theirs_root / f"iter_{mf.ITERATION:07d}" / rank /
                            "model_optim_rng.pt", weights_only=False)  # fmt: skip
        assert ours["checkpoint_version"] == 3.0
        names = ARGS + (("moe_router_topk", "moe_ffn_hidden_size") if arch.num_experts else ())
        want = {k: getattr(theirs["args"], k) for k in names}
        assert {k: getattr(ours["args"], k, None) for k in names} == want, rank
        for key in mf.model_keys(layout):
            a = {k: v for k, v in ours[key].items() if isinstance(v, torch.Tensor)}
            b = {k: v for k, v in theirs[key].items() if isinstance(v, torch.Tensor)}
            assert sorted(a) == sorted(b), (rank, key)
            for k in b:
                if k in VOCAB_ROWS:  # this rank's rows of the padded vocabulary
                    t = int(rank[len("mp_rank_") :][:2])
                    real = max(0, min(len(b[k]), arch.vocab - t * len(b[k])))
                    assert torch.equal(a[k][:real], b[k][:real]), (rank, key, k)
                    assert not a[k][real:].any(), (rank, key, k)
                else:
                    assert torch.equal(a[k], b[k]), (rank, key, k)


@pytest.mark.parametrize("name", list(CASES))
def test_export_at_another_layout_loads_into_megatron(name, saved, exported):
    """megalite -> Megatron at another layout: megatron-core there loads each format with the
    source's logits."""
    arch, _, target = CASES[name]
    theirs = saved[name][2]
    legacy, _ = exported[name, "legacy"]
    ranks = {p.name for p in (legacy / f"iter_{0:07d}").iterdir()}
    ranks_of = [
        (t, p, e) for t in range(target.tp) for p in range(target.pp) for e in range(target.ep)
    ]
    assert ranks == {mf.rank_dir(target, *r) for r in ranks_of}
    for form in FORMATS:
        logits = exported[name, form][1]
        assert logits.shape[-1] == target.padded_vocab(arch)
        err = (logits[..., : arch.vocab] - theirs[..., : arch.vocab]).abs().max()
        assert err <= 1e-5, (form, err)


# ---- bad input: one line, nothing written ----------------------------------------------------


def _rewrite(path: Path, edit):
    state = torch.load(path, map_location="cpu", weights_only=False)
    edit(state)
    torch.save(state, path)


def test_args_contradicting_tensors_is_one_line(source, tmp_path):
    arch, layout, _, root, _, _ = source
    bad = tmp_path / "bad"
    shutil.copytree(root / "legacy", bad)
    field = "moe_ffn_hidden_size" if arch.num_experts else "ffn_hidden_size"  # every MLP's width
    for f in bad.glob("iter_*/mp_rank_*/model_optim_rng.pt"):  # Megatron's args, one field off
        _rewrite(f, lambda s: setattr(s["args"], field, 2 * arch.ffn))
    with pytest.raises(MegaliteError) as e:
        convert(bad, tmp_path / "out", "--to", "megalite")
    line = str(e.value)
    assert "\n" not in line and "linear_fc1.weight" in line and "contradict" in line, line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_missing_rank_directory_is_one_line(source, tmp_path):
    arch, layout, _, root, _, _ = source
    bad = tmp_path / "bad"
    shutil.copytree(root / "legacy", bad)
    gone = mf.rank_dir(layout, layout.tp - 1, layout.pp - 1)
    shutil.rmtree(bad / f"iter_{mf.ITERATION:07d}" / gone)
    with pytest.raises(MegaliteError) as e:
        convert(bad, tmp_path / "out", "--to", "megalite")
    assert "\n" not in str(e.value) and gone in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
