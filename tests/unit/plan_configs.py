"""Model configs the planner's tests share."""

from megalite.config import Config, ModelConfig
from megalite.training.flops import hardware_flops_per_token


def tiny(flavour="gpt2", layers=2, **kw) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=layers, hidden_size=64,
                            num_attention_heads=4, seq_length=64, vocab_size=500,
                            make_vocab_size_divisible_by=8, **kw)  # fmt: skip
    cfg.training.micro_batch_size, cfg.training.kernels = 2, "torch"
    return cfg


def big(flavour, layers, hidden, heads, seq, vocab, mbs, gbs, precision="bf16", recompute="none"):
    cfg = Config()
    cfg.model = ModelConfig(flavour=flavour, num_layers=layers, hidden_size=hidden,
                            num_attention_heads=heads, seq_length=seq, vocab_size=vocab)  # fmt: skip
    t = cfg.training
    t.micro_batch_size, t.global_batch_size, t.precision, t.recompute = (
        mbs,
        gbs,
        precision,
        recompute,
    )
    return cfg


def flops(cfg: Config) -> float:
    """The hardware FLOPs per token the layout search ranks by."""
    return hardware_flops_per_token(cfg.model, cfg.training.recompute)
