"""What checkpoints hold of a run, rank by rank: agreement between ranks, the regions of
the parameters a rank reads and writes, reading them (any layout), RNG states as text.

Used by the Checkpointer (checkpointer.py) and by tools that load a model at a layout
(megalite/cli/generate.py); every rank reads exactly the slices its parameters need.
"""

import base64
import math
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megalite.checkpoint import format as fmt
from megalite.checkpoint.format import Checkpoint, opt_name
from megalite.errors import MegaliteError
from megalite.kernels.fp8_linear import Fp8Linear
from megalite.model.moe import expert_biases
from megalite.parallel import comm
from megalite.parallel.specs import spec_of

# ---- agreement between ranks ---------------------------------------------------------------------


def _world():
    """The world as a counted group (a world of one without torch.distributed)."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if dist.is_initialized() else 0
    return comm.Group("world", list(range(n)), r, dist.group.WORLD if n > 1 else None)


def all_gather(obj, group=None) -> list:
    # Small Python objects (messages, index entries, RNG states as base64) between our own
    # processes; nothing read from disk is ever unpickled.
    return comm.all_gather_object(obj, group or _world())


@contextmanager
def agreed_errors(group=None):
    """Run a block on every rank; if any rank raises MegaliteError, every rank raises it."""
    error = None
    try:
        yield
    except MegaliteError as e:
        error = str(e)
    errors = [e for e in all_gather(error, group) if e]
    if errors:
        raise MegaliteError(errors[0])


# ---- the parameters of a rank and the regions they hold ----------------------------------------


def rank_params(chunks):
    """(logical tensor, parameter, spec) for every parameter of this rank's chunks; the last
    stage's tied copy reads the first stage's embedding."""
    for chunk in chunks:
        for p in chunk.parameters():
            spec = spec_of(p)
            yield spec.source, p, spec


def flat_blocks(shape, lo: int, hi: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as rectangular blocks, in
    order: (flat start, (lo, hi) per dim). Each block is a contiguous run of the range: a
    partial first row, whole rows, a partial last row (rows split the same way, dim by dim)."""
    if lo >= hi:
        return []
    if not shape:
        return [(0, [])]
    row = math.prod(shape[1:])

    def in_row(r, a, b):  # the part [a, b) of row r
        return [(r * row + s, [(r, r + 1), *reg]) for s, reg in flat_blocks(shape[1:], a, b)]

    out, at = [], lo
    if at % row:  # the first row, from its middle
        r = at // row
        end = min(hi, (r + 1) * row)
        out += in_row(r, at - r * row, end - r * row)
        at = end
    if (n := (hi - at) // row) > 0:  # whole rows
        out.append((at, [(at // row, at // row + n), *((0, d) for d in shape[1:])]))
        at += n * row
    if at < hi:  # the last row, up to its middle
        out += in_row(at // row, 0, hi - at)
    return out


def piece_blocks(spec, shape, plo: int, phi: int) -> list[tuple[int, int, list]]:
    """The part [plo, phi) of a flattened local parameter of `shape` (a ZeRO shard's part) as
    blocks of the global tensor: (start, end) in the part and the global region of each.
    Vocabulary padding rows (past the global tensor) are left out. A tensor whose cut has
    parts (a gated expert's gate and up rows split over etp) gives a block per part and row."""
    cut = getattr(spec, "cut", None)  # (a ParamSpec; a region alone has none)
    if cut is not None and cut.parts > 1:
        return _part_blocks(spec, shape, plo, phi)
    region, out = spec.region(), []
    for start, block in flat_blocks(shape, plo, phi):
        rows = min(block[0][1], region[0][1] - region[0][0]) - block[0][0] if block else 1
        if rows <= 0:
            continue
        n = rows * math.prod(hi - lo for lo, hi in block[1:])
        block = block and [(block[0][0], block[0][0] + rows), *block[1:]]
        glob = [(lo + r[0], hi + r[0]) for (lo, hi), r in zip(block, region)]
        out.append((start - plo, start - plo + n, glob))
    return out


def _part_blocks(spec, shape, plo: int, phi: int) -> list[tuple[int, int, list]]:
    """piece_blocks of a tensor whose dim d = spec.cut.dim holds parts: each flat block cut to
    single indices along the dims before d and at the part boundaries along d, so that each
    piece is contiguous here and a rectangle of the global tensor."""
    d, m = spec.cut.dim, shape[spec.cut.dim] // spec.cut.parts
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    out = []
    for _, block in flat_blocks(shape, plo, phi):
        heads = [[]]
        for lo, hi in block[:d]:
            heads = [h + [(i, i + 1)] for h in heads for i in range(lo, hi)]
        lo, hi = block[d]
        cuts = [lo, *range((lo // m + 1) * m, hi, m), hi]
        for head in heads:
            for a, b in zip(cuts, cuts[1:]):
                sub = [*head, (a, b), *block[d + 1 :]]
                start = sum(x * s for (x, _), s in zip(sub, strides)) - plo
                n = math.prod(y - x for x, y in sub)
                out.append((start, start + n, spec.to_global(sub)))
    return out


def check_model(chunks, tp, ckpt: Checkpoint):
    """Every parameter of these chunks is in the checkpoint with the global shape it needs."""
    for name, _, spec in rank_params(chunks):
        if not ckpt.has(name):
            raise MegaliteError(
                f"checkpoint {ckpt.dir} has no tensor {name}; it holds another model "
                "(check --num-layers, the flavour and --untie-embeddings-and-output-weights)"
            )
        if list(ckpt.shape(name)) != list(spec.shape):
            raise MegaliteError(
                f"tensor {name} has shape {list(ckpt.shape(name))} in checkpoint {ckpt.dir} but "
                f"{list(spec.shape)} in this model; use the model flags the checkpoint was trained with"
            )


@torch.no_grad()
def load_model(chunks, tp, ckpt: Checkpoint) -> list[str]:
    """Copy this rank's slices of the model weights into the chunks (any layout), and the
    expert biases (whole on every rank). Returns the expert biases the checkpoint lacks (one
    written before they were saved): those start from zero."""
    check_model(chunks, tp, ckpt)
    for name, p, spec in rank_params(chunks):
        p.copy_(FlatRead(ckpt, name, spec, p.shape)[0 : p.numel()].view(p.shape))
    return load_expert_biases(chunks, ckpt)


def load_expert_biases(chunks, ckpt) -> list[str]:
    """Copy the chunks' expert biases (whole on every rank) from `ckpt`; returns those it
    lacks (a checkpoint written before they were saved), which start from zero."""
    missing = []
    for name, bias in expert_biases(chunks):
        if not ckpt.has(name):
            missing.append(name)
            bias.zero_()
        elif list(ckpt.shape(name)) != list(bias.shape):
            raise MegaliteError(
                f"tensor {name} has shape {list(ckpt.shape(name))} in checkpoint {ckpt.dir} but "
                f"{list(bias.shape)} in this model; use the model flags the checkpoint was trained with"
            )
        else:
            bias.copy_(ckpt.read(name))
    return missing


def fp8_histories(chunks):
    """(logical name, recipe, AmaxHistory, device) of every delayed-scaling tensor of these
    chunks' FP8 linears, named after the layer's weight (layers.0.attn.q.fp8_x): whole and
    equal on every rank holding the layer (end_step reduces them over tp and dp+cp), so a
    checkpoint holds them as it holds the expert biases, topology-free."""
    for chunk in chunks:
        for m in chunk.modules():
            lin, w = getattr(getattr(m, "ops", None), "linear", None), getattr(m, "weight", None)
            if isinstance(lin, Fp8Linear) and w is not None:
                base = spec_of(w).name.removesuffix("weight")
                for role, st in lin.named_histories().items():
                    yield f"{base}fp8_{role}", lin.recipe, st, w.device


def fp8_tensors(chunks) -> dict:
    """{name: tensor} of the FP8 state a checkpoint holds: each history (newest first) and the
    number of steps that filled it (int64: whether a first step is still to come)."""
    out = {}
    for name, _, st, _ in fp8_histories(chunks):
        out[name + ".amax_history"] = st.history.float()
        out[name + ".steps"] = torch.tensor(st.steps, dtype=torch.int64)
    return out


@torch.no_grad()
def load_fp8_state(chunks, ckpt: Checkpoint) -> list[str]:
    """The amax histories of this run's delayed-scaling layers from the checkpoint; returns
    the names it lacks (a checkpoint trained without delayed FP8): those start empty, their
    first step scaling by its own amax. A checkpoint's FP8 state that this run has no use
    for (a bf16 run, another recipe) is not read."""
    missing = []
    for name, recipe, st, device in fp8_histories(chunks):
        if not (ckpt.has(name + ".amax_history") and ckpt.has(name + ".steps")):
            missing.append(name)
            continue
        steps = int(ckpt.read(name + ".steps"))
        recipe.restore(st, ckpt.read(name + ".amax_history"), steps, device)
    return missing


class FlatRead:
    """A parameter's tensor in a checkpoint, read by flat range of the local tensor: [lo:hi]
    reads only the blocks of that range (piece_blocks), so a rank loads its ZeRO shard of the
    optimizer state, not the whole ([0:numel]: the whole local tensor, one block); vocabulary
    padding rows read as zeros."""

    def __init__(self, ckpt: Checkpoint, name: str, spec, shape):
        self.ckpt, self.name, self.spec, self.shape = ckpt, name, spec, shape

    def __getitem__(self, s: slice) -> torch.Tensor:
        dtype = getattr(torch, self.ckpt.tensors[self.name]["dtype"])
        out = torch.zeros(s.stop - s.start, dtype=dtype)
        for lo, hi, region in piece_blocks(self.spec, self.shape, s.start, s.stop):
            out[lo:hi] = self.ckpt.read(self.name, region).reshape(-1)
        return out


def load_optimizer(chunks, tp, optimizer, ckpt: Checkpoint, fresh: bool = False):
    """The moments (and masters) of this rank's parameters, only its ZeRO shard of them read
    (FlatRead), or a fresh optimizer whose masters start from the loaded weights when the
    checkpoint has none (e.g. converted from HF) or `fresh` (--finetune, --no-load-optim)."""
    scalars = None if fresh else ckpt.index.get("optimizer")
    state = {}
    for name, p, spec in rank_params(chunks):
        needed = optimizer.state_kinds(name, spec)  # AdamW's moments, or Muon's momentum
        if scalars is None:
            state[name] = {k: torch.zeros_like(p) for k in needed}
            continue
        kinds = [k for k in fmt.OPTIMIZER_KINDS if ckpt.has(opt_name(k, name))]
        if any(k not in kinds for k in needed):
            other = "" if "exp_avg" not in kinds and "momentum" not in kinds else (
                " (saved with another --optimizer; --no-load-optim starts it afresh)"
            )  # fmt: skip
            raise MegaliteError(
                f"checkpoint {ckpt.dir} lacks the optimizer state of {name}"
                + (other or "; the index is incomplete")
            )
        state[name] = {k: FlatRead(ckpt, opt_name(k, name), spec, p.shape) for k in kinds}
    optimizer.load_state_tensors(state)
    if scalars is not None:
        optimizer.load_scalar_state(scalars)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def encode_rng(rng: dict) -> dict:
    return {k: (None if v is None else [_b64(t) for t in v] if isinstance(v, list) else _b64(v))
            for k, v in rng.items()}  # fmt: skip


def decode_rng(d: dict) -> dict:
    return {k: (None if v is None else [_unb64(t) for t in v] if isinstance(v, list) else _unb64(v))
            for k, v in d.items() if k != "rank"}  # fmt: skip
