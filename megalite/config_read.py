"""Reading a Config: its defaults, then the YAML of --config, then the flags given; or a plain
dict (`from_dict`, as a checkpoint stores its model). Every field is a flag (`config.opt` gives
its documentation and aliases); an unknown section, field or flag is refused in one sentence
with the closest known name."""

import argparse
import dataclasses
import difflib
import os
import sys
import typing

import yaml

from megalite.config import Config
from megalite.errors import MegaliteError
from megalite.megatron_translate import translate

SECTIONS = [f.name for f in dataclasses.fields(Config)]


def _fields(section_obj):
    hints = typing.get_type_hints(type(section_obj))
    for f in dataclasses.fields(section_obj):
        yield f, hints[f.name]


def _choices(f):
    """A field's fixed set of values, or None; a callable set (the flavour table, which may grow
    after import) is read when asked."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def _base_type(tp):
    """(scalar type, is_list) of an annotation like int, int | None, list[str]."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return args[0], True
    if args:
        return _base_type(args[0])
    return tp, False


def _coerce(value, tp, where):
    scalar, is_list = _base_type(tp)
    if value is None:
        return None
    if is_list:
        items = value if isinstance(value, list) else str(value).split()
        return [_coerce(v, scalar, where) for v in items]  # list[int]: ints
    try:
        if scalar is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if scalar is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return scalar(value)
    except (TypeError, ValueError):
        raise MegaliteError(f"{where}: {value!r} is not a valid {scalar.__name__}") from None


def apply(cfg: Config, d: dict, source: str):
    if not isinstance(d, dict):
        raise MegaliteError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)})")
    for sec, values in d.items():
        if sec not in SECTIONS:
            hint = difflib.get_close_matches(str(sec), SECTIONS, n=1)
            raise MegaliteError(
                f"{source}: unknown section {sec!r}"
                + (
                    f"; did you mean {hint[0]!r}?"
                    if hint
                    else f"; sections are {', '.join(SECTIONS)}"
                )
            )
        obj = getattr(cfg, sec)
        if not isinstance(values, dict):
            raise MegaliteError(f"{source}: section {sec!r} must be a mapping of field: value")
        fields = {f.name: (f, t) for f, t in _fields(obj)}
        for key, value in values.items():
            if key not in fields:
                hint = difflib.get_close_matches(str(key), list(fields), n=1)
                raise MegaliteError(
                    f"{source}: unknown field {sec}.{key}"
                    + (f"; did you mean {hint[0]!r}?" if hint else "")
                )
            f, tp = fields[key]
            v = _coerce(value, tp, f"{source}: {sec}.{key}")
            choices = _choices(f)
            if choices and v not in choices and v is not None:
                raise MegaliteError(
                    f"{source}: {sec}.{key}={v!r} must be one of {', '.join(map(str, choices))}"
                )
            setattr(obj, key, v)


def from_dict(d: dict) -> Config:
    """A Config of the defaults, with the sections and fields of `d` applied (and checked)."""
    cfg = Config()
    apply(cfg, d, source="config")
    return cfg


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise MegaliteError(
            f"config file {path} does not exist; pass an existing YAML file to --config"
        )
    try:
        with open(path) as fh:
            d = yaml.safe_load(fh)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise MegaliteError(
            f"config file {path} is not valid YAML{where}; fix its syntax"
        ) from None
    return d or {}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise MegaliteError(message)


def build_parser(prog="pretrain_gpt.py") -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog,
        usage="torchrun --nproc_per_node N %(prog)s [--config FILE.yaml] [flags]",
        description="megalite: 3D-parallel GPT pretraining. Flags override the YAML, which overrides defaults.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,  # a flag is matched whole: --swiglu is never --swiglu-limit
    )
    p.add_argument("--config", help="YAML preset (sections as in configs/tiny.yaml)")
    defaults = Config()
    for sec in SECTIONS:
        obj = getattr(defaults, sec)
        g = p.add_argument_group(sec)
        for f, tp in _fields(obj):
            names = ["--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
            doc = f.metadata["doc"]
            default = getattr(obj, f.name)
            kw = {"dest": f"{sec}.{f.name}", "help": f"{doc} [{default}]"}
            scalar, is_list = _base_type(tp)
            if scalar is bool:
                g.add_argument(*names, action=argparse.BooleanOptionalAction, **kw)
            else:
                if is_list:
                    kw["nargs"] = "+"
                if _choices(f):
                    kw["choices"] = _choices(f)
                g.add_argument(*names, type=scalar, metavar=f.name.upper(), **kw)
    return p


class Given(set):
    """The fields ("model.vocab_size", ...) a YAML file or a flag set, as opposed to defaults,
    with where each came from (`sources`, read by `where`)."""

    def __init__(self, *names):
        super().__init__(*names)
        self.sources: dict[str, str] = {}


def where(given: set, name: str) -> str:
    """Where field `name` was given, for a message: "model.vocab_size in run.yaml" or the flag
    ("--vocab-size"; the flag's name where `given` does not say)."""
    sources = getattr(given, "sources", {})
    return sources.get(name) or "--" + name.split(".")[-1].replace("_", "-")


def parse_args(argv=None, given: set | None = None) -> Config:
    """Defaults, then the YAML of --config, then the flags given. `given`, when passed, receives
    the fields set by the YAML or a flag ("model.hidden_size", ...), as opposed to defaults; a
    `Given` also where each came from."""
    argv = translate(sys.argv[1:] if argv is None else argv)  # Megatron's flags: megalite's
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        bad = next((u for u in unknown if u.startswith("-")), unknown[0])
        flag = bad.split("=")[0]
        known = [s for a in parser._actions for s in a.option_strings]
        hint = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        raise MegaliteError(
            f"unknown flag {flag}" + (f"; did you mean {hint[0]}?" if hint else "; see --help")
            if bad.startswith("-")
            else f"unexpected argument {bad!r}; flags look like --name value"
        )
    cfg = Config()
    args = vars(ns)
    if "config" in args:
        path = args.pop("config")
        d = load_yaml(path)
        apply(cfg, d, source=f"config file {path}")
        if given is not None:
            given.update(f"{sec}.{k}" for sec, v in d.items() for k in v)
        if isinstance(given, Given):
            given.sources.update({f"{sec}.{k}": f"{sec}.{k} in {path}" for sec, v in d.items()
                                  for k in v})  # fmt: skip
    if given is not None:
        given.update(args)
    if isinstance(given, Given):  # a flag wins over the YAML
        flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
        given.sources.update({dest: flags.get(dest, dest) for dest in args})
    for dest, value in args.items():
        sec, name = dest.split(".")
        setattr(getattr(cfg, sec), name, value)
    return cfg
