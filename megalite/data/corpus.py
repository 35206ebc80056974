"""Documents: the built-in corpus (the standard library's own source) and reading user inputs.

The built-in corpus needs no download: every machine that runs megalite has a Python standard
library. Its `.py` files are taken in sorted path order (tests, site-packages and generated or
table-only modules left out) until `MAX_CORPUS_BYTES`, each file one document, so on a given
Python installation it is the same corpus every time.
"""

import gzip
import io
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megalite.errors import MegaliteError

CORPUS_VERSION = 1  # bump when the file selection changes: it is part of the cache key
CORPUS_NAME = "stdlib_corpus.jsonl"
MAX_CORPUS_BYTES = 8 * 2**20  # ~2.5M tokens: a few seconds to tokenize, plenty for a CPU demo
# Directories of tests, third-party code and binaries; `encodings` and `pydoc_data` are mostly
# character tables and prose that would spend the vocabulary on rare characters.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SKIP_DIRS |= {"lib-dynload", "encodings", "pydoc_data"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_bytes: int = MAX_CORPUS_BYTES) -> list[Path]:
    """The standard library's source files of the corpus: the longest sorted prefix that fits."""
    root = stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place makes os.walk skip them; sorting makes the walk order deterministic.
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "."))
        )
        for name in sorted(filenames):
            # _sysconfigdata* describes this particular build of Python, not code.
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                found.append(Path(dirpath) / name)
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    files, total = [], 0
    for path in found:
        total += path.stat().st_size
        if total > max_bytes:
            break
        files.append(path)
    return files


def build_corpus(out_dir: str | os.PathLike, max_bytes: int = MAX_CORPUS_BYTES) -> Path:
    """Write the built-in corpus to `out_dir/stdlib_corpus.jsonl` and return its path.

    One JSON object per line, `{"name": relative path, "text": source}`: JSON keeps each
    file's newlines inside one document. Written aside and renamed, so it is never half there.
    """
    files = stdlib_files(max_bytes)
    if not files:
        raise MegaliteError(
            f"no Python source files found under {stdlib_root()}; "
            "pass your own data with --data-path and --tokenizer-model"
        )
    root = stdlib_root()
    out = Path(out_dir) / CORPUS_NAME
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as fh:
        for path in files:
            # The stdlib is UTF-8, but a file in another PEP 263 coding must not stop the build:
            # decode with replacement so the file list alone defines the corpus.
            text = path.read_bytes().decode("utf-8", errors="replace")
            doc = {"name": path.relative_to(root).as_posix(), "text": text}
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def input_files(paths: list[str]) -> list[Path]:
    """Expand the inputs: files as given, directories walked in sorted order (hidden skipped)."""
    if not paths:
        raise MegaliteError("no input given; pass text files, directories or JSONL to --input")
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )
            if not found:
                raise MegaliteError(f"input directory {p} holds no files; point --input at text")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise MegaliteError(f"input {p} does not exist; check the path given to --input")
    return files


def text_bytes(paths: list[str]) -> int | None:
    """The inputs' size as text (progress's estimate of the time left), or None when some are
    compressed or Parquet, whose file sizes do not say how much text they hold."""
    files = input_files(paths)
    if any(f.suffix in COMPRESSED or _kind(f) == "parquet" for f in files):
        return None
    return sum(f.stat().st_size for f in files)


COMPRESSED = (
    ".gz",
    ".zst",
)  # decompressed as they are read: gzip, Zstandard (the Pile's .jsonl.zst)


def _kind(path: Path) -> str:
    """'jsonl', 'parquet' or 'text', from the name (a trailing .gz or .zst is looked through)."""
    name = path.name.removesuffix(path.suffix) if path.suffix in COMPRESSED else path.name
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith(".parquet") and name == path.name:
        return "parquet"
    return "text"


def is_jsonl(path: Path) -> bool:
    return _kind(path) == "jsonl"


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """Every document of the inputs, in order; empty documents are skipped.

    A `.jsonl`/`.json` file holds one document per line (`{json_key: text, ...}`), a `.parquet`
    file one per row (its `json_key` column); any other file is one document. A `.gz` or `.zst`
    suffix is decompressed first (`.jsonl.gz`, `.jsonl.zst`, `.txt.gz`). Raises MegaliteError on unreadable input or
    when there is none.
    """
    count = 0
    for path in input_files(paths):
        kind = _kind(path)
        if kind == "jsonl":
            docs = _jsonl_documents(path, json_key)
        elif kind == "parquet":
            docs = _parquet_documents(path, json_key)
        else:
            docs = iter([_read_text(path)])
        for doc in docs:
            if doc:
                count += 1
                yield doc
    if count == 0:
        raise MegaliteError(f"the inputs {' '.join(paths)} hold no text; pass non-empty files")


def _open_text(path: Path):
    """The file as UTF-8 text, decompressed as it is read when it ends in .gz or .zst."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="strict")
    if path.suffix == ".zst":
        return _open_zstd(path)
    return open(path, encoding="utf-8", errors="strict")


def _open_zstd(path: Path):
    """A Zstandard file as UTF-8 text, streamed."""
    try:
        import zstandard  # optional: only .zst inputs need it
    except ImportError:
        raise MegaliteError(
            f"reading {path} needs the zstandard package; pip install zstandard (or megalite[hf])"
        ) from None
    raw = _ZstdFrames(open(path, "rb"), zstandard.ZstdDecompressor(max_window_size=2**31))
    return io.TextIOWrapper(io.BufferedReader(raw, 1 << 16), encoding="utf-8", errors="strict")


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a Zstandard file, one after another (`zstd -c
    a b` concatenates frames), windows up to 2 GiB (`zstd --long=31`, which the default refuses).
    A file that ends inside a frame raises EOFError, as gzip does: a cut download is no corpus."""

    def __init__(self, fh, dctx):
        self._fh, self._dctx = fh, dctx
        self._frame, self._fed = dctx.decompressobj(), False  # fed: the frame has begun
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._pos == len(self._out):
            chunk = self._fh.read(1 << 20)
            if not chunk:
                if self._fed:
                    raise EOFError("the file ends inside a frame")
                return 0
            self._out, self._pos = self._decompress(chunk), 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        parts = []
        while chunk:
            parts.append(self._frame.decompress(chunk))
            self._fed = not self._frame.eof
            chunk = self._frame.unused_data if self._frame.eof else b""
            if self._frame.eof:
                self._frame = self._dctx.decompressobj()
        return b"".join(parts)

    def close(self):
        self._fh.close()
        super().close()


def _bad_compressed(path: Path, e: Exception) -> MegaliteError:
    kind = "Zstandard" if path.suffix == ".zst" else "gzip"
    return MegaliteError(f"input {path} is not a complete {kind} file ({e})")


def _decompress_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a truncated or corrupt compressed input raises while it is read."""
    errors: tuple[type[BaseException], ...] = (gzip.BadGzipFile, EOFError)
    zstandard = sys.modules.get("zstandard")  # imported by _open_zstd when a .zst was opened
    return errors + (zstandard.ZstdError,) if zstandard else errors


def _read_text(path: Path) -> str:
    try:
        with _open_text(path) as fh:
            return fh.read()
    except UnicodeDecodeError:
        raise MegaliteError(f"input {path} is not UTF-8 text; convert it or leave it out") from None
    except _decompress_errors() as e:
        raise _bad_compressed(path, e) from None


def _jsonl_objects(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of a JSONL file."""
    with _open_text(path) as fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError:
                    raise MegaliteError(
                        f"{path} line {lineno} is not valid JSON; JSONL inputs hold one object "
                        "per line"
                    ) from None
        except UnicodeDecodeError:
            raise MegaliteError(f"input {path} is not UTF-8 text; convert it first") from None
        except _decompress_errors() as e:
            raise _bad_compressed(path, e) from None


def _jsonl_documents(path: Path, key: str) -> Iterator[str]:
    for lineno, obj in _jsonl_objects(path):
        if not isinstance(obj, dict) or not isinstance(obj.get(key), str):
            raise MegaliteError(
                f"{path} line {lineno} has no string field {key!r}; pass --json-key with "
                "the field that holds the text"
            )
        yield obj[key]


def iter_records(paths: list[str], keys: list[str]) -> Iterator[tuple[list[str], ...]]:
    """Megatron's preprocessing input: for every line of the JSONL inputs, in order, the fields
    `keys`, each as its list of sentences (a string is one sentence; a list of strings, text
    already split, several). Empty texts are kept: Megatron writes them as empty documents."""
    for path in input_files(paths):
        if not is_jsonl(path):
            raise MegaliteError(
                f"input {path} is not JSONL (.jsonl, .json, .jsonl.gz, .jsonl.zst); Megatron-style "
                "preprocessing (--json-keys, --append-eod) reads JSON lines"
            )
        for lineno, obj in _jsonl_objects(path):
            fields = []
            for key in keys:
                value = obj.get(key) if isinstance(obj, dict) else None
                if isinstance(value, str):
                    value = [value]
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise MegaliteError(
                        f"{path} line {lineno} has no field {key!r} holding text (a string or a "
                        "list of strings); pass --json-keys with the fields that hold it"
                    )
                fields.append(value)
            yield tuple(fields)


def _parquet_documents(path: Path, key: str) -> Iterator[str]:
    """The `key` column of a Parquet file, row by row; null rows are skipped like empty ones.
    Read in record batches, so a file larger than memory streams."""
    try:
        import pyarrow.parquet as pq  # optional: only Parquet inputs need it
    except ImportError:
        raise MegaliteError(
            f"reading {path} needs the pyarrow package; pip install pyarrow (or megalite[hf])"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise MegaliteError(f"input {path} is not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if key not in schema.names:
        raise MegaliteError(
            f"{path} has no column {key!r} (its columns: {', '.join(schema.names)}); pass "
            "--json-key with the column that holds the text"
        )
    kind = schema.field(key).type
    if not _is_text(kind):
        raise MegaliteError(
            f"{path} column {key!r} holds {kind}, not text; pass --json-key with the column that "
            "holds the text"
        )
    for batch in pf.iter_batches(columns=[key], batch_size=1024):
        for doc in batch.column(0).to_pylist():
            if doc is not None:
                yield doc


def _is_text(dtype) -> bool:
    import pyarrow.types as t

    view = getattr(t, "is_string_view", lambda _: False)  # pyarrow >= 16 only
    return t.is_string(dtype) or t.is_large_string(dtype) or view(dtype)
