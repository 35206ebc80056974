"""A random-weight Hugging Face checkpoint of a config.json, written straight to safetensors.

Benchmarks and memory tests need models of real shapes (Llama-3.2-3B: 6.4 GB) without building
them through transformers: the tensor names and shapes come from megalite's own model built on
the meta device and exported (`hf.to_hf` on meta tensors), and each tensor is drawn, written and
freed in turn, the file's header first, so the writer holds one tensor at a time.
"""

import json
from pathlib import Path

import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint import hf
from megalite.checkpoint.safetensors_file import write_safetensors
from megalite.model.gpt import GPTChunk


def write_random_hf(directory, config: dict, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """config.json (as given, plus torch_dtype) and model.safetensors of random weights: norms
    near 1, every other tensor N(0, 0.02). Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf.model_config_from_hf(config)
    with torch.device("meta"):
        shapes = hf.to_hf(GPTChunk(cfg).state_dict(), cfg)
    if cfg.tied:
        shapes.pop("lm_head.weight", None)
    specs = {k: (dtype, tuple(t.shape)) for k, t in shapes.items()}
    g = torch.Generator().manual_seed(seed)

    def make(key):
        t = torch.randn(specs[key][1], generator=g) * 0.02
        return (t + 1 if "norm" in key or "ln_" in key else t).to(dtype)

    write_safetensors(directory / "model.safetensors", specs, {"format": "pt"}, make)
    config = {**config, "torch_dtype": fmt.dtype_name(dtype)}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
