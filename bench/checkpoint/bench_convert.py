"""Checkpoint conversion at real size: wall time, peak RSS and anonymous RSS, beside transformers.

    python bench/checkpoint/bench_convert.py [--scratch DIR] [--layers 28 --hidden 3072 ...] [--summary PATH]

A random Hugging Face Llama of Llama-3.2-3B's shape (28 layers, h 3072, ffn 8192, 24 heads, 8
key/value heads, the 128,256-token vocabulary, tied, llama3 RoPE scaling, bf16: 6.4 GB) is
written straight to safetensors (megalite.checkpoint.hf_random, no transformers model built),
then each operation runs in its own process while /proc of its process tree is polled (VmRSS:
peak RSS; RssAnon: the anonymous part, i.e. without the mapped files' pages):

  peer          transformers: from_pretrained(bf16) + save_pretrained
  hf -> ml      tools/convert_checkpoint.py --to megalite
  ml -> hf      --to hf
  ml -> dist    --to megatron --format torch_dist --tp 2 --pp 2
  ml -> legacy  --to megatron --format legacy --tp 2 --pp 2
  dist -> ml, legacy -> ml

Every round trip is checked tensor for tensor (byte-equal), and the Megatron files' sizes
against the bytes of the tensors they hold. Ratios are against the peer of the same run. The
files go under --scratch and are deleted at the end. Generation at real size is
bench/model/bench_generate.py's.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._common import machine, measured_run, timed, write_summary  # noqa: E402

GIB = 2**30
PEER = """
import sys
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
m.save_pretrained(sys.argv[2])
"""


def config(a) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": a.hidden, "intermediate_size": a.ffn, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.groups,
        "head_dim": a.hidden // a.heads, "vocab_size": a.vocab,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "bos_token_id": 128000, "eos_token_id": 128001,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }  # fmt: skip


def _same(a: dict, b: dict, what: str) -> bool:
    import torch

    same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"{what}: {'byte-equal' if same else 'DIFFERENT'}")
    return same


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scratch",
        default=tempfile.gettempdir(),
        help="where the files go (about 3x the checkpoint)",
    )
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--keep", action="store_true", help="leave the files under --scratch")
    ap.add_argument("--summary", default=None)
    a = ap.parse_args(argv)

    import torch

    from megalite.checkpoint import format as fmt
    from megalite.checkpoint import writing
    from megalite.checkpoint.hf_random import write_random_hf
    from megalite.cli.convert_hf import read_hf_weights

    root = Path(a.scratch) / f"bench-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    print(machine())
    try:
        with timed() as t:
            hf = write_random_hf(root / "hf", config(a), torch.bfloat16)
        size = (hf / "model.safetensors").stat().st_size
        print(f"wrote {size / 1e9:.2f} GB of random weights in {t.wall:.0f} s")
        conv = [sys.executable, "tools/convert_checkpoint.py"]
        mt = ["--to", "megatron", "--tp", "2", "--pp", "2", "--format"]
        ops = {
            "transformers load + save (peer)": [sys.executable, "-c", PEER, hf, root / "peer"],
            "hf -> megalite": conv + [hf, root / "ml", "--to", "megalite"],
            "megalite -> hf": conv + [root / "ml", root / "hf2", "--to", "hf"],
            "megalite -> torch_dist tp2 pp2": conv + [root / "ml", root / "dist"] + mt + ["torch_dist"],
            "megalite -> legacy tp2 pp2": conv + [root / "ml", root / "legacy"] + mt + ["legacy"],
            "torch_dist -> megalite": conv + [root / "dist", root / "ml-dist", "--to", "megalite"],
            "legacy -> megalite": conv + [root / "legacy", root / "ml-legacy", "--to", "megalite"],
        }  # fmt: skip
        rows = {}
        for what, cmd in ops.items():
            rows[what] = measured_run(cmd, cwd=ROOT)
            r = rows[what]
            print(f"  {what}: {r['wall_s']:.0f} s, peak {r['peak_rss'] / GIB:.2f} GiB "
                  f"(anon {r['peak_anon'] / GIB:.2f})", flush=True)  # fmt: skip
        ok = _same(read_hf_weights(hf), read_hf_weights(root / "hf2"), "hf -> megalite -> hf")
        ml = fmt.Checkpoint(root / "ml")
        want = {n: ml.read(n) for n in ml.names()}
        for form in ("dist", "legacy"):
            back = fmt.Checkpoint(root / f"ml-{form}")
            ok &= _same(
                want, {n: back.read(n) for n in back.names()}, f"megalite -> {form} -> megalite"
            )
        tensor_bytes = sum(t.nbytes for t in want.values())
        # legacy at pp 2: the last stage holds Megatron's copy of the tied embedding too
        copy = want["embedding.word.weight"].nbytes
        for form, held in (("dist", tensor_bytes), ("legacy", tensor_bytes + copy)):
            files = [f for f in (root / form).rglob("*") if f.is_file()]
            on_disk = sum(f.stat().st_size for f in files if f.suffix in (".distcp", ".pt")
                          and f.name != "common.pt")  # fmt: skip
            print(f"{form} files / the tensor bytes they hold: {on_disk / held:.4f}")
        config_out = json.loads((root / "hf2" / "config.json").read_text())
        print(f"exported config: rope_scaling {config_out.get('rope_scaling')}, bos "
              f"{config_out.get('bos_token_id')}, eos {config_out.get('eos_token_id')}")  # fmt: skip
        # the design's bound: one output file (--max-shard-size) plus one layer
        layer = (2 * a.hidden * a.hidden + 2 * a.hidden * a.groups * (a.hidden // a.heads)
                 + 3 * a.hidden * a.ffn) * 2  # fmt: skip
        bound = writing.SHARD_BYTES + layer
        peer = rows["transformers load + save (peer)"]
        print(f"\n| operation | wall | peak RSS (anon) | peak / peer | anon <= shard + layer "
              f"({bound / GIB:.2f} GiB) |\n| --- | --- | --- | --- | --- |")  # fmt: skip
        figures = []
        for what, r in rows.items():
            ratio = r["peak_rss"] / peer["peak_rss"]
            print(f"| {what} | {r['wall_s']:.0f} s | {r['peak_rss'] / GIB:.2f} GiB "
                  f"({r['peak_anon'] / GIB:.2f}) | {ratio:.2f}x | {'yes' if r['peak_anon'] <= bound else 'no'} |")  # fmt: skip
            if what != "transformers load + save (peer)":
                figures.append({"what": f"{what}: peak RSS / peer", "value": round(ratio, 2),
                                "unit": "x", "target": "<= 1.2", "met": ratio <= 1.2})  # fmt: skip
        write_summary(a.summary, "bench_convert.py", figures, " ".join(sys.argv))
        if not ok:
            raise SystemExit("a round trip was not byte-equal")
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
