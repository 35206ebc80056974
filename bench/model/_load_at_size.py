"""Time to the first token and peak memory of a real-size model: megalite's generation load
against transformers' `from_pretrained` + one `generate` step (bench_generate.py --real-size).

A random Llama-3.2-3B-shaped bf16 model (3.21B parameters, 128,256-token vocabulary, llama3
rope scaling, tied embeddings) is written straight to safetensors twice, tensor by tensor
(a 64 MB pool of N(0, 0.02) values repeated: nothing of model size is ever in memory): as a
Hugging Face directory and as a megalite checkpoint (index.json with its sha256). Each
measurement is a fresh process (`python bench/model/_load_at_size.py child KIND DIR T0`), so its
peak RSS (VmHWM) is its own; a thread polls its anonymous RSS (RssAnon). Time to the first
token is from the parent's spawn (T0: interpreter, imports, load, prefill of a 16-token prompt
and one sampled token), so both pay their imports. megalite loads as tools/generate.py does
(`load_chunks`: sha256 of the files, meta build, the mapped bytes), once more without the
sha256 to show its share.
"""

import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench._common import memory  # noqa: E402

LLAMA_3B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072,
    "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}  # fmt: skip
PROMPT = [128000, *range(1000, 1015)]  # 16 tokens


def _write_random(path: Path, tensors: list[tuple[str, list[int]]]) -> dict:
    """A bf16 safetensors file of `tensors` (key, shape), values from a repeated random pool;
    returns {sha256, bytes} as a megalite index lists them."""
    import torch

    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 25, generator=g) * 0.02).bfloat16().view(torch.uint8).numpy()
    pool = memoryview(pool)  # 64 MB
    header, at = {}, 0
    for key, shape in tensors:
        n = 2 * math.prod(shape)
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    digest, k = hashlib.sha256(head), 0
    with open(path, "wb") as fh:
        fh.write(head)
        for _, shape in tensors:
            left = 2 * math.prod(shape)
            while left:
                part = pool[k : k + left]
                fh.write(part)
                digest.update(part)
                left -= len(part)
                k = (k + len(part)) % len(pool)
    return {"sha256": digest.hexdigest(), "bytes": len(head) + at}


def write_models(root: Path) -> tuple[Path, Path]:
    """(HF directory, megalite checkpoint) of the random 3B model under `root`."""
    import torch
    import transformers

    from megalite.checkpoint import format as fmt
    from megalite.checkpoint.hf import model_config_from_hf
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk
    from megalite.parallel.specs import spec_of

    hf, ml = root / "hf", root / "ml"
    hf.mkdir(parents=True, exist_ok=True)
    ml.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(LLAMA_3B, indent=1))
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3B))
    names = [(k, list(t.shape)) for k, t in m.state_dict().items() if k != "lm_head.weight"]
    _write_random(hf / "model.safetensors", names)
    cfg = model_config_from_hf(LLAMA_3B)
    chunk = GPTChunk(cfg, LayerEnv(dtype=torch.bfloat16, meta=True))
    specs = [spec_of(p) for p in chunk.parameters()]
    shapes = [(s.name, list(s.shape)) for s in specs]
    files = {"model.safetensors": _write_random(ml / "model.safetensors", shapes)}
    whole = {"file": "model.safetensors"}
    tensors = {
        name: {"shape": shape, "dtype": "bfloat16",
               "shards": [{**whole, "slice": [[0, n] for n in shape]}]}
        for name, shape in shapes
    }  # fmt: skip
    index = {"format": fmt.FORMAT, "iteration": 0, "tensors": tensors, "files": files,
             "config": {"model": dataclasses.asdict(cfg)}}  # fmt: skip
    (ml / fmt.INDEX).write_text(json.dumps(index))
    return hf, ml


# ---- one measurement, in its own process ------------------------------------------------------


def child(kind: str, path: str, t0: float):
    peak_anon = [0]

    def poll():
        while True:
            peak_anon[0] = max(peak_anon[0], memory()["RssAnon"])
            time.sleep(0.02)

    threading.Thread(target=poll, daemon=True).start()
    import torch

    if kind == "hf":
        import transformers

        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        out = m.generate(torch.tensor([PROMPT]), max_new_tokens=1, do_sample=False)
        token = int(out[0, -1])
    else:
        from megalite.checkpoint import format as fmt
        from megalite.cli import generate as gen_tool
        from megalite.config_read import from_dict
        from megalite.generation import generate
        from megalite.parallel.groups import single_process_groups

        ckpt = fmt.Checkpoint(path)
        if kind == "megalite-nosha":
            ckpt.verify = lambda files=None: None
        cfg = from_dict({"model": ckpt.model_config}).model
        groups = single_process_groups()
        chunks = gen_tool.load_chunks(ckpt, cfg, gen_tool.layout(ckpt, 1), groups)
        token = generate(chunks, groups, [PROMPT], 1)[0][0]
    ttft = time.time() - t0
    peak_anon[0] = max(peak_anon[0], memory()["RssAnon"])
    print(json.dumps({"ttft_s": ttft, "peak_rss": memory()["VmHWM"], "peak_anon": peak_anon[0],
                      "token": token}), flush=True)  # fmt: skip


def measure(kind: str, path: Path) -> dict:
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, "child", kind, str(path), repr(t0)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__" and sys.argv[1] == "child":
    child(sys.argv[2], sys.argv[3], float(sys.argv[4]))
