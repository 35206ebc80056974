"""Megatron-LM's own GPT-style example scripts (their flags, tests/e2e/megatron_examples/*.txt:
layouts scaled to 8 ranks, models to a tiny width, data to --mock-data) through megalite: every
flag is handled (its meaning, a note, or a refusal that docs/megatron.md lists as unsupported),
and what remains passes --dry-run, in process. One of them trains (tiny, CPU)."""

import math
import re
import shlex
from pathlib import Path

import pytest

from megalite.config_read import build_parser, parse_args
from megalite.errors import MegaliteError
from megalite.megatron_flags import MEGATRON
from megalite.megatron_translate import Translation
from tests.e2e.conftest import ROOT, pretrain

EXAMPLES = Path(__file__).parent / "megatron_examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.txt"))

# What each script is refused (the first words of each line), pinned: a flag newly refused, or
# one no longer refused, shows here.
REFUSED = {
    "deepseek_v3_fsdp": ["--recompute-modules", "--moe-router-load-balancing-type seq_aux_loss",
                         "--moe-router-force-load-balancing",
                         "--log-num-zeros-in-grad", "--log-params-norm",
                         "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype"],
    "gptoss_20b": ["--export-force-local-attention", "--enable-gpt-oss",
                   "Megatron's architecture flags"],
    "llama3_8b_fsdp_fp8": ["--record-memory-history"],
}  # fmt: skip
# What --dry-run still refuses once the refused flags are dropped (validate's one line)
DRY_RUN_REFUSED = {
    "deepseek_v3_fsdp": "--zero-stage 3 does not shard mixture-of-experts models yet",
    "gptoss_20b": "Megatron's architecture flags",
}

# The layout each plans (the first line of --dry-run's plan) and the flavour its flags describe
PLANNED = {
    "docs_custom_llama": ("layout tp=1 pp=1 dp=8 zero=0:", "gpt2"),
    "docs_gpt3": ("layout tp=2 pp=2 dp=2 zero=0:", "gpt2"),
    "gpt3_175b": ("layout tp=2 pp=4 dp=1 zero=0:", "gpt2"),
    "llama3_8b_fp8": ("layout tp=1 pp=1 dp=8 zero=1:", "llama"),
    "llama3_8b_fsdp_fp8": ("layout tp=1 pp=1 dp=8 zero=3:", "llama"),
    "mixtral_8x7b": ("layout tp=1 pp=2 dp=4 ep=4 zero=1:", "llama"),
}


def script(name: str, tmp: Path) -> list[str]:
    text = (EXAMPLES / f"{name}.txt").read_text().replace("$TMP", str(tmp))
    return shlex.split(text, comments=True)


def documented_refusals() -> set[str]:
    """The flags docs/megatron.md's flag table marks refused."""
    text = (ROOT / "docs" / "megatron.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| `--") and "| refused |" in r]
    return {f for r in rows for f in re.findall(r"`(--[a-z0-9-]+)", r.split("|")[1])}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_of_the_script_is_handled(name, tmp_path):
    """Each flag is megalite's own or in the Megatron table; the refusals are the pinned ones,
    each naming a flag the docs table lists as refused; docs/megatron.md lists every flag."""
    argv = script(name, tmp_path)
    known = {s for a in build_parser()._actions for s in a.option_strings}
    flags = [a for a in argv if a.startswith("--")]
    assert [f for f in flags if f not in known and f not in MEGATRON] == []
    tr = Translation(argv, collect=True)
    tr.run()
    pinned = REFUSED.get(name, [])
    assert len(tr.refused) == len(pinned), tr.refused
    for line, start in zip(tr.refused, pinned):
        assert line.startswith(start), (line, start)
    documented = documented_refusals()
    for line in tr.refused:
        if not line.startswith("Megatron's architecture flags"):
            assert line.split()[0] in documented, line
    docs = (ROOT / "docs" / "megatron.md").read_text()
    assert [f for f in flags if f"`{f}" not in docs] == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_script_passes_dry_run(name, tmp_path, monkeypatch, capsys):
    """The script's flags (its refused ones dropped) plan at 8 ranks with --dry-run."""
    from megalite.training.launch import main

    kept = script(name, tmp_path)
    tr = Translation(kept, collect=True)
    tr.run()
    for line in tr.refused:  # drop each refused flag and its values
        flag = line.split()[0]
        if flag in kept:
            i = kept.index(flag)
            n = MEGATRON[flag].nargs
            j = i + 1
            while n == "+" and j < len(kept) and not kept[j].startswith("--"):
                j += 1
            del kept[i : j if n == "+" else i + 1 + n]
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    if name in DRY_RUN_REFUSED:
        with pytest.raises(MegaliteError, match=re.escape(DRY_RUN_REFUSED[name])):
            main([*kept, "--dry-run"])
        return
    main([*kept, "--dry-run"])
    out = capsys.readouterr()
    layout, flavour = PLANNED[name]
    assert out.out.startswith(layout), out.out.splitlines()[0]
    assert parse_args(kept).model.flavour == flavour
    assert all(line.startswith("megalite:") for line in out.err.splitlines()), out.err


def test_swiglu_and_profile_reach_their_own_meaning(tmp_path):
    """Flags are matched whole: --swiglu is not --swiglu-limit, --profile not --profile-steps,
    and a prefix of a flag is unknown."""
    cfg = parse_args(["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                      "rope", "--disable-bias-linear", "--hidden-size", "96", "--profile"])  # fmt: skip
    assert cfg.model.flavour == "llama" and cfg.model.swiglu_limit == 7.0
    assert cfg.model.ffn_hidden_size == 256  # Megatron's 8h/3 rounded down to 64
    assert cfg.model.untie_embeddings_and_output_weights is False  # Megatron's tied default
    assert cfg.training.profile and cfg.training.profile_steps is None
    for prefix, line in [("--swiglu-lim", "unknown flag --swiglu-lim"),
                         ("--profile-st", "unknown flag --profile-st")]:  # fmt: skip
        with pytest.raises(MegaliteError, match=line):
            parse_args([prefix, "3"])
    with pytest.raises(MegaliteError, match="nearest is --flavour gpt2, which differs in mlp"):
        parse_args(["--swiglu"])  # SwiGLU with Megatron's LayerNorm and learned positions


@pytest.mark.slow
def test_llama3_fp8_script_trains(tmp_path):
    """examples/llama/train_llama3_8b_h100_fp8.sh's flags, tiny, 20 steps (80 samples) on 2 CPU
    ranks (dp 2 where the script has 8), bf16 with bf16 gradients, with its FP8 flags as megalite's FP8 (hybrid formats, delayed
    scaling, emulated on CPU): the loss is finite and falls; --profile writes its trace."""
    argv = script("llama3_8b_fp8", tmp_path)
    replace = {"--global-batch-size": "4", "--eval-interval": "0", "--save-interval": "0",
               "--lr": "3e-3", "--min-lr": "3e-4", "--profile-step-start": "2",
               "--profile-step-end": "3", "--log-interval": "1", "--train-samples": "80",
               "--lr-warmup-samples": "8", "--lr-decay-samples": "80"}  # fmt: skip
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    i = argv.index("--load")  # a fresh run (--save's directory is still empty)
    del argv[i : i + 2]
    rows, proc = pretrain(2, [*argv, "--wandb-mode", "disabled",
                              "--profile-dir", str(tmp_path / "prof")], tmp_path)  # fmt: skip
    losses = [r["loss"] for r in rows]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0] - 0.3, losses
    assert (tmp_path / "prof" / "trace-rank0.json").stat().st_size > 0
    assert "megalite: note: --fp8-amax-history-len: delayed scaling" in proc.stderr


def test_the_docs_table_says_what_the_flag_table_does():
    """docs/megatron.md gives each flag of megatron_flags.MEGATRON its handling and its words."""
    text = (ROOT / "docs" / "megatron.md").read_text()
    for flag, h in MEGATRON.items():
        row = f"| `{flag}` | {h.kind} | {h.doc.replace('|', chr(92) + '|')} |"
        assert row in text, row
