"""Conversions stream at a realistic shape: anonymous memory stays near one tensor, not the model.

A random Llama of Llama-3.2-1B's width with the 128,256-token vocabulary and llama3 RoPE scaling
(2 layers, untied: 1.3 GB in bf16, the embedding and the output 0.53 GB each) is converted in
every direction by tools/convert_checkpoint.py in a subprocess whose anonymous RSS (RssAnon in
/proc: the process's own memory, not the mapped files' page cache) is polled. Each must stay
within the design's bound, generously: the largest tensor (0.53 GB: the one tensor being
computed or read), one output file (--max-shard-size 100MB), one layer and 0.3 GB over what the
interpreter holds after its imports (1.0 GiB in all). Before streaming, each direction held the
whole model once or twice over (1.5 GB to 3.5 GB) and failed this. The round trips are checked
tensor for tensor.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.hf_random import write_random_hf

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 2, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
MB = 2**20
LARGEST = 128256 * 2048 * 2  # the embedding (and the output layer), bf16
LAYER = (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192) * 2
SHARD = 100 * 10**6
BOUND = LARGEST + SHARD + LAYER + 300 * MB


def _anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_anon(argv: list) -> int:
    """Run argv, polling its anonymous RSS; the peak (it must exit 0)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        try:
            peak = max(peak, _anon(proc.pid))
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    return peak


def convert(*args) -> int:
    tool = [sys.executable, "tools/convert_checkpoint.py"]
    return peak_anon(tool + [str(a) for a in args] + ["--max-shard-size", str(SHARD)])


@pytest.fixture(scope="module")
def baseline() -> int:
    """What the converter's process holds once its imports are done."""
    code = ("import megalite.cli.convert, torch.distributed.checkpoint, time, sys; "
            "print(flush=True); time.sleep(1.5)")  # fmt: skip
    return peak_anon([sys.executable, "-c", code])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_random_hf(tmp_path_factory.mktemp("conv") / "hf", CONFIG)


@pytest.fixture(scope="module")
def megatron_exports(hf_dir) -> dict:
    """hf -> megalite, then megalite -> Megatron (torch_dist and legacy at tp2 pp2), each
    polled: {direction: (its output directory, its peak anonymous bytes)}. Both tests read
    these: the conversions of 1.3 GB run once."""
    root = hf_dir.parent
    out = {"hf -> megalite": (root / "ml", convert(hf_dir, root / "ml", "--to", "megalite"))}
    for form in ("torch_dist", "legacy"):
        peak = convert(root / "ml", root / form, "--to", "megatron", "--format", form,
                       "--tp", 2, "--pp", 2)  # fmt: skip
        out[f"megalite -> megatron {form}"] = (root / form, peak)
    return out


def _same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_every_direction_streams(hf_dir, baseline, megatron_exports):
    from megalite.cli.convert_hf import read_hf_weights

    root = hf_dir.parent
    peaks = {k: peak for k, (_, peak) in megatron_exports.items()}
    peaks["megalite -> hf"] = convert(root / "ml", root / "hf2", "--to", "hf")
    _same_tensors(read_hf_weights(hf_dir), read_hf_weights(root / "hf2"))
    config = json.loads((root / "hf2" / "config.json").read_text())
    assert config["rope_scaling"]["factor"] == 32.0 and config["eos_token_id"] == 128001
    for form in ("torch_dist", "legacy"):
        peaks[f"megatron {form} -> megalite"] = convert(root / form, root / f"ml-{form}",
                                                        "--to", "megalite")  # fmt: skip
        a, b = fmt.Checkpoint(root / "ml"), fmt.Checkpoint(root / f"ml-{form}")
        _same_tensors({n: a.read(n) for n in a.names()}, {n: b.read(n) for n in b.names()})
        assert b.model_config["rope_scaling"] == "llama3"
    over = {k: (v - baseline) / MB for k, v in peaks.items()}
    assert all(v <= BOUND / MB for v in over.values()), (
        f"anonymous MiB over the {baseline / MB:.0f} MiB baseline: {over} (bound {BOUND / MB:.0f})"
    )


def test_exports_hold_only_their_bytes(hf_dir, megatron_exports):
    """Legacy and torch_dist files are within 1% of the tensor bytes they hold (a tp shard
    saved as a view would carry its whole tensor; a mapped tensor its whole file)."""
    tensor_bytes = sum(e.nbytes for e in _hf_tensors(hf_dir))
    for form in ("torch_dist", "legacy"):
        out, _ = megatron_exports[f"megalite -> megatron {form}"]
        files = [f for f in out.rglob("*") if f.is_file() and f.suffix in (".pt", ".distcp")]
        # the tied-free model: every tensor once (legacy's tp shards add up to the whole)
        on_disk = sum(f.stat().st_size for f in files if f.name != "common.pt")
        assert on_disk <= 1.01 * tensor_bytes, (form, on_disk / tensor_bytes)


def _hf_tensors(d: Path):
    from megalite.cli.convert_hf import read_hf_weights

    return read_hf_weights(d).values()
