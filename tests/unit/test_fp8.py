"""FP8 linear layers (megalite.kernels.fp8): tensorwise and rowwise against torchao's
Float8Linear(emulate=True), delayed scaling and MXFP8 against fp32 emulations written here."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
from megalite.kernels.fp8 import E4M3, E5M2, make_recipe
from megalite.kernels.fp8_linear import Fp8Linear, end_step

from megalite.testing import resume_config, tiny_trainer


def _torchao_linear(linear: nn.Linear, recipe: str, pow2: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True,
                              round_scales_to_power_of_2=pow2)  # fmt: skip
    return Float8Linear.from_float(linear, config=cfg)


def _run(fn, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize(
    "recipe,fmt,pow2",
    [("tensorwise", "hybrid", True), ("tensorwise", "hybrid", False), ("rowwise", "e4m3", True)],
)  # fmt: skip
def test_tensorwise_and_rowwise_equal_torchao(recipe, fmt, pow2):
    """torchao's tensorwise recipe takes gradients in e5m2 (our `hybrid`), rowwise in e4m3;
    our power-of-two tensorwise scales (the default) are its round_scales_to_power_of_2, and
    --no-fp8-scale-pow2 its default. Rowwise scales are powers of two in both."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 16, 64) * 3, torch.randn(48, 64) * 0.02
    g = torch.randn(3, 16, 48) * 1e-3
    ao = _torchao_linear(nn.Linear(64, 48, bias=False), recipe, pow2)
    with torch.no_grad():
        ao.weight.copy_(w)
    xa = x.clone().requires_grad_()
    ya = ao(xa)
    ya.backward(g)
    ref = (ya.detach(), xa.grad, ao.weight.grad)
    mine = _run(Fp8Linear(make_recipe(recipe, fmt, pow2=pow2)), x, w, g)
    exact = _run(lambda x, w: x @ w.t(), x, w, g)
    for a, b, e in zip(mine, ref, exact):
        # the same FP8 values: equal up to fp32 summation order, far inside fp8's round-off
        assert (a - b).abs().max() <= 1e-5 * e.abs().max()
        assert (a - e).abs().max() > 1e-3 * e.abs().max()  # and it is FP8, not fp32


def _q(t, amax, dtype, margin=0, pow2=True):
    """fp32 emulation of one per-tensor cast: scale to the format's max (rounded down to a
    power of two), round, scale back."""
    s = torch.finfo(dtype).max / amax / 2**margin
    s = 2.0 ** torch.floor(torch.log2(s)) if pow2 else s
    return (t * s).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / s


@pytest.mark.parametrize("algo,margin,pow2", [("max", 0, True), ("most_recent", 1, True),
                                             ("max", 0, False)])  # fmt: skip
def test_delayed_scaling_equals_an_emulation(algo, margin, pow2):
    """Step 1 scales by the current amax; later steps by the history's max (or newest) of the
    previous steps' amaxes, kept for `history_len` steps."""
    torch.manual_seed(1)
    lin = Fp8Linear(make_recipe("delayed", "hybrid", pow2=pow2, history_len=2, algo=algo,
                                margin=margin))  # fmt: skip
    w = torch.randn(32, 64) * 0.05
    hist = {"x": [], "w": [], "g": []}
    for step in range(4):
        x, g = torch.randn(8, 64) * (step + 1), torch.randn(8, 32) * 10.0**-step
        y, gx, gw = _run(lin, x, w, g)
        cur = {"x": x.abs().max(), "w": w.abs().max(), "g": g.abs().max()}
        if step == 0:
            use, m = cur, 0
        else:
            pick = max if algo == "max" else (lambda h: h[-1])
            use, m = {k: pick(h[-2:]) for k, h in hist.items()}, margin
        qx, qw = _q(x, use["x"], E4M3, m, pow2), _q(w, use["w"], E4M3, m, pow2)
        qg = _q(g, use["g"], E5M2, m, pow2)
        for a, b in ((y, qx @ qw.t()), (gx, qg @ qw), (gw, qg.t() @ qx)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
        for k in hist:
            hist[k].append(cur[k])
        end_step([lin])


def _mx_emulation(t, dtype, emax):
    """Blocks of 32 along the last dim, each scaled by 2^(floor(log2 amax) - emax)."""
    out = torch.empty_like(t)
    for r in range(t.shape[0]):
        for c in range(0, t.shape[1], 32):
            blk = t[r, c : c + 32]
            _, e = torch.frexp(blk.abs().max())  # amax = m 2^e, m in [0.5, 1)
            s = 2.0 ** (e.item() - 1 - emax)
            m = torch.finfo(dtype).max
            out[r, c : c + 32] = (blk / s).clamp(-m, m).to(dtype).float() * s
    return out


def test_mxfp8_equals_an_emulation():
    torch.manual_seed(2)
    x, w, g = torch.randn(8, 64) * 5, torch.randn(32, 64) * 0.03, torch.randn(8, 32) * 1e-4
    y, gx, gw = _run(Fp8Linear(make_recipe("mxfp8", "hybrid")), x, w, g)

    def mx(t, dtype):
        return _mx_emulation(t, dtype, 8 if dtype == E4M3 else 15)

    for a, b in (
        (y, mx(x, E4M3) @ mx(w, E4M3).t()),
        (gx, mx(g, E5M2) @ mx(w.t().contiguous(), E4M3).t()),
        (gw, mx(g.t().contiguous(), E5M2) @ mx(x.t().contiguous(), E4M3).t()),
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_mxfp8_scales_are_e8m0():
    q = make_recipe("mxfp8").quantise(None, torch.randn(4, 96) * 7, "x", E4M3, ())
    assert q.scale.shape == (4, 3)
    assert torch.equal(q.scale.to(torch.float8_e8m0fnu).float(), q.scale)


def test_bad_recipe_and_format_name_the_choices():
    with pytest.raises(ValueError, match="choose one of tensorwise, rowwise, delayed, mxfp8"):
        make_recipe("blockwise")
    with pytest.raises(ValueError, match="choose one of e4m3, hybrid"):
        make_recipe("tensorwise", "e5m2")


BAD_FP8 = [
    (["--fp8-format", "hybrid", "--precision", "fp16"], "needs --precision bf16 or fp32"),
    (["--fp8-format", "hybrid", "--hidden-size", "72", "--num-attention-heads", "4"],
     "--hidden-size=72 is not divisible by 16, which --fp8-recipe tensorwise needs"),
    (["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--hidden-size", "48",
      "--num-attention-heads", "3"], "--hidden-size=48 is not divisible by 32"),
    (["--fp8-format", "hybrid", "--tp", "2", "--hidden-size", "64", "--num-attention-heads",
      "4", "--ffn-hidden-size", "48"], "--ffn-hidden-size / tp=24 is not divisible by 16"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"],
     "--fp8-amax-history-len=0 must be a positive integer"),
]  # fmt: skip


@pytest.mark.parametrize("argv,message", BAD_FP8)
def test_validate_refuses_fp8_it_cannot_run(argv, message):
    from megalite.config_read import parse_args
    from megalite.errors import MegaliteError
    from megalite.shape import validate

    with pytest.raises(MegaliteError, match=message.replace("/", r"\/")):
        validate(parse_args(argv), 2 if "--tp" in argv else 1)


@pytest.mark.parametrize("argv,message", [
    (["--fp8-param-gather", "--zero-stage", "3"], "needs --zero-stage 3 and --fp8-format"),
    (["--fp8-param-gather", "--fp8-format", "hybrid", "--zero-stage", "2"], "needs --zero-stage 3"),
    (["--fp8-param-gather", "--fp8-format", "hybrid", "--zero-stage", "3", "--fp8-recipe",
      "rowwise"], "needs --fp8-recipe tensorwise or delayed: rowwise"),
])  # fmt: skip
def test_fp8_param_gather_is_refused_without_zero3_fp8_or_a_per_tensor_recipe(argv, message):
    from megalite.config_read import parse_args
    from megalite.errors import MegaliteError
    from megalite.shape import validate

    validate(parse_args(["--fp8-param-gather", "--fp8-format", "hybrid", "--zero-stage", "3"]), 1)
    with pytest.raises(MegaliteError, match=message):
        validate(parse_args(argv), 1)


def test_an_unknown_recipe_is_one_line_before_any_group():
    from megalite.config_read import parse_args
    from megalite.errors import MegaliteError

    with pytest.raises(MegaliteError, match="invalid choice: 'blockwise' .choose from 'tensor"):
        parse_args(["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"])


def test_fp8_flags_reach_the_layers_and_the_first_last_stay_high():
    """--fp8-first-last-layers-bf16: layers 0 and n-1 keep ops.linear; the output layer and
    the embedding never run in FP8."""
    from megalite.kernels.fp8_linear import Fp8Maker, fp8_linears

    from megalite import kernels
    from megalite.config import ModelConfig
    from megalite.model.env import LayerEnv
    from megalite.model.gpt import GPTChunk

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=2, vocab_size=64)
    for high, fp8_layers in ((False, {"0", "1", "2"}), (True, {"1"})):
        ops = kernels.override(kernels.TORCH_OPS, fp8_linear=Fp8Maker(make_recipe("delayed"),
                                                                      first_last_high=high))  # fmt: skip
        m = GPTChunk(cfg, LayerEnv(ops=ops))
        assert m.ops.linear is torch.nn.functional.linear  # the output layer's
        got = {n.split(".")[1] for n, mod in m.named_modules()
               if getattr(getattr(mod, "ops", None), "linear", None) in fp8_linears([mod])}  # fmt: skip
        assert got == fp8_layers
        assert len(fp8_linears(m.modules())) == 6 * len(fp8_layers)  # q k v out, up down


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 1979e12), ("NVIDIA H200", 1979e12), ("NVIDIA H200 NVL", 1671e12),
     ("NVIDIA B200", 4500e12), ("NVIDIA A100-SXM4-80GB", None)],
)  # fmt: skip
def test_fp8_peaks(name, peak):
    from megalite.training import flops

    assert flops.peak_flops(name, "fp8") == peak


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    from megalite.config_read import parse_args
    from megalite.errors import MegaliteError
    from megalite.shape import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(MegaliteError, match="NVIDIA A100-SXM4-80GB has 8.0"):
        validate(parse_args(["--fp8-format", "hybrid"]), 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    validate(parse_args(["--fp8-format", "hybrid"]), 1)


def test_delayed_scaling_ignores_evaluation_forwards():
    lin = Fp8Linear(make_recipe("delayed", history_len=3))
    w = torch.randn(16, 32)
    _run(lin, torch.randn(4, 32), w, torch.randn(4, 16))
    with torch.no_grad():
        lin(torch.randn(4, 32) * 100, w)  # an evaluation batch: not in the step's amax
    end_step([lin])
    assert lin.state["x"].history[0] < 10 and lin.state["x"].steps == 1


def _fp8_config(save=None, recipe="delayed", **parallel):
    cfg = resume_config(save, **parallel)
    t = cfg.training
    t.fp8_format, t.fp8_recipe, t.fp8_amax_history_len = recipe and "hybrid", recipe, 3
    return cfg


def _fp8_trainer(cfg, log=None, world=1):
    return tiny_trainer(cfg, 64, world, log)


def _histories(tr) -> dict:
    from megalite.checkpoint.regions import fp8_tensors

    return {n: t.clone() for n, t in fp8_tensors(tr.chunks).items()}


def test_a_delayed_fp8_run_resumes_bitwise(tmp_path):
    """2 + 2 steps resumed from a checkpoint give the 4-step run's losses and amax histories
    bitwise: the histories (and so the next step's scales) are in the checkpoint."""
    from megalite.checkpoint import format as fmt

    ref = _fp8_trainer(_fp8_config())
    losses = [ref.train_step()["loss"] for _ in range(4)]
    want = _histories(ref)
    assert (
        "layers.1.mlp.down.fp8_g.amax_history" in want
        and want["layers.0.attention.q.fp8_x.steps"] == 4
    )
    first = _fp8_trainer(_fp8_config(str(tmp_path / "run")))
    assert [first.train_step()["loss"] for _ in range(2)] == losses[:2]
    first.checkpointer.save(first.state())
    saved = fmt.Checkpoint(tmp_path / "run").read("layers.0.mlp.up.fp8_w.amax_history")
    assert saved.shape == (3,) and saved[:2].min() > 0 and saved[2] == 0  # two steps of three
    log = []
    again = _fp8_trainer(_fp8_config(str(tmp_path / "run")), log)
    again.resume()
    assert [again.train_step()["loss"] for _ in range(2)] == losses[2:]
    got = _histories(again)
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
    assert "amax" not in log[0]


def test_fp8_and_high_precision_checkpoints_load_into_each_other(tmp_path):
    """A delayed-FP8 checkpoint loads into an fp32 run (its FP8 state unread) and an fp32 one
    into a delayed-FP8 run: the histories start empty, said in the load's log line."""
    fp8 = _fp8_trainer(_fp8_config(str(tmp_path / "fp8")))
    fp8.train_step(log=False)
    fp8.checkpointer.save(fp8.state())
    weights = [p.detach().clone() for p in fp8.chunks[0].parameters()]
    log = []
    high = _fp8_trainer(_fp8_config(str(tmp_path / "fp8"), recipe=None), log)
    high.resume()
    assert all(torch.equal(p, w) for p, w in zip(high.chunks[0].parameters(), weights))
    assert "amax" not in log[0] and _histories(high) == {}
    high.train_step(log=False)
    high.checkpointer.save(high.state())
    log = []
    again = _fp8_trainer(_fp8_config(str(tmp_path / "fp8")), log)
    again.resume()
    assert "holds no FP8 amax history (layers.0.attention.q.fp8_x, ...): they start empty" in log[0]
    assert all(t.eq(0).all() for t in _histories(again).values())  # empty: steps and history
    assert again.train_step()["loss"] > 0
