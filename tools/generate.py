"""Generate text from a checkpoint in one process.

    python tools/generate.py --load DIR --prompt TEXT [--max-new-tokens N]
        [--greedy | --temperature T --top-k K --top-p P] [--seed S] [--tokenizer-model M]

DIR is a megalite checkpoint (a --save directory or one iter_* folder, or the output of
tools/convert_checkpoint.py --to megalite). The whole model is loaded into one GPTChunk from
the checkpoint's logical tensors, whatever layout saved it. The tokenizer is the one stored in
the checkpoint unless --tokenizer-model is given. Generation stops after N tokens or at EOS;
each token re-runs the (cropped) context: simple, and fine for the small models this serves.
"""

import argparse
import json
import sys

import torch

from megalite.checkpoint import format as fmt
from megalite.checkpoint.checkpointer import load_model
from megalite.config import Config
from megalite.data.tokenizer import Tokenizer
from megalite.errors import MegaliteError, run_main
from megalite.model.gpt import LOCAL, GPTChunk


def load(path, tokenizer_model=None) -> tuple[GPTChunk, Tokenizer]:
    ckpt = fmt.Checkpoint(path)
    ckpt.verify()
    cfg = Config.from_dict({"model": ckpt.model_config}).model
    if tokenizer_model is None:
        if fmt.TOKENIZER not in ckpt.files:
            raise MegaliteError(
                f"checkpoint {ckpt.dir} holds no tokenizer; pass its sentencepiece model to "
                "--tokenizer-model"
            )
        tokenizer_model = ckpt.dir / fmt.TOKENIZER
    tok = Tokenizer(tokenizer_model)
    if tok.vocab_size != cfg.vocab_size:
        raise MegaliteError(
            f"tokenizer {tok.model_path} has {tok.vocab_size} pieces but the model in {ckpt.dir} "
            f"has a {cfg.vocab_size}-token vocabulary; pass the tokenizer it was trained with"
        )
    chunk = GPTChunk(cfg)
    load_model([chunk], LOCAL, ckpt)
    return chunk.eval(), tok


def next_token(logits, greedy, temperature, top_k, top_p, generator) -> int:
    """One token id from the last position's logits (V,)."""
    if greedy or temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        # drop a token when the more likely ones already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits[order[drop]] = float("-inf")
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(chunk, ids, max_new_tokens, eos_id=None, greedy=True, temperature=1.0, top_k=0,
             top_p=1.0, seed=0) -> list[int]:  # fmt: skip
    """The new token ids after the prompt `ids`."""
    generator = torch.Generator().manual_seed(seed)
    ids, new = list(ids), []
    window = chunk.cfg.seq_length
    for _ in range(max_new_tokens):
        logits = chunk(torch.tensor([ids[-window:]]))[0, -1]  # (V,)
        t = next_token(logits, greedy, temperature, top_k, top_p, generator)
        ids.append(t)
        new.append(t)
        if t == eos_id:
            break
    return new


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-model", help="sentencepiece model (default: the checkpoint's)")
    p.add_argument("--json", action="store_true", help="print prompt and new token ids as JSON")
    p.add_argument("--debug", action="store_true", help="full tracebacks")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    chunk, tok = load(a.load, a.tokenizer_model)
    prompt = tok.encode(a.prompt) if a.prompt else [tok.bos_id]
    new = generate(chunk, prompt, a.max_new_tokens, tok.eos_id, a.greedy, a.temperature,
                   a.top_k, a.top_p, a.seed)  # fmt: skip
    if a.json:
        print(json.dumps({"prompt_ids": prompt, "new_ids": new, "text": tok.decode(new)}))
    else:
        sys.stdout.write(a.prompt + tok.decode(new) + "\n")


if __name__ == "__main__":
    run_main(main)
