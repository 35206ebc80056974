"""Megatron's pickled files read safely: `torch.load(weights_only=True)` with argparse.Namespace
and plain value types allow-listed and any other class in the file (megatron's enums, numpy's
RNG arrays, TE's BytesIO) replaced by an inert stand-in (`Opaque`) that runs no code. Pickle is
read only here, in the offline converter (legacy files and torch_dist's common.pt)."""

import argparse
import pickle
from pathlib import Path

import torch

from megalite.errors import MegaliteError

# value types that are safe to rebuild for real (a TE extra state's bytes, say)
SAFE_BUILTINS = {f"builtins.{t.__name__}": t for t in (bytes, bytearray, set, frozenset, complex,
                                                       slice, range)}  # fmt: skip


class Opaque:
    """What an unknown class in a legacy pickle becomes: it keeps its arguments, runs nothing."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state):
        self.state = state


def load_pickle(path: Path, mmap: bool = False) -> dict:
    """A Megatron .pt file, unpickled with weights_only=True (see the module docstring);
    `mmap`: its tensors over the mapped file (no copy; their pages are the page cache's)."""
    try:
        unknown = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        known = {"argparse.Namespace": argparse.Namespace, **SAFE_BUILTINS}
        allowed = [known[n] if n in known else (Opaque, n) for n in unknown]
        with torch.serialization.safe_globals(allowed):
            obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
        raise MegaliteError(f"{path} is not a readable Megatron checkpoint file ({e})") from None
    if not isinstance(obj, dict):
        raise MegaliteError(f"{path} does not hold a Megatron checkpoint dict")
    return obj


def args_of(obj: dict, path: Path) -> dict:
    args = obj.get("args")
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    raise MegaliteError(
        f"{path} holds no Megatron `args`; megalite takes the model config from them"
    )
