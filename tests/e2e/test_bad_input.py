"""The bad-input matrix: each case ends with one line naming the problem, exit status 2, no traceback.

docs/errors.md lists the same cases. Each case runs pretrain_gpt.py's entry point in a process
of its own, forked from one that imported megalite once (`DRIVER`): 31 interpreters importing
torch cost more than the cases themselves.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, TINY

pytestmark = pytest.mark.slow


def _yaml(tmp, text):
    p = tmp / "c.yaml"
    p.write_text(text)
    return ["--config", str(p)]


def _copy_data(tmp, prefix, drop=None, truncate=None):
    out = tmp / "copy"
    for ext in (".bin", ".idx"):
        if ext != drop:
            shutil.copy(prefix + ext, str(out) + ext)
    if truncate:
        path = str(out) + truncate
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)
    return str(out)


# (id, world size seen by validation, argv builder (tmp, prefix, model) -> flags, expected text in the line)
CASES = [
    ("world-not-divisible", 8, lambda t, p, m: ["--tp", "3"], "world size 8 is not divisible by tp*pp=3*1"),
    ("dp-mismatch", 8, lambda t, p, m: ["--tp", "2", "--dp", "2"], "does not equal the world size 8"),
    ("heads-vs-tp", 4, lambda t, p, m: ["--tp", "4", "--num-attention-heads", "6", "--hidden-size", "48"],
     "num_attention_heads=6 is not divisible by tp=4"),
    ("kv-heads-vs-tp", 4, lambda t, p, m: ["--tp", "4", "--num-attention-heads", "12", "--hidden-size", "96",
                                           "--num-query-groups", "6"], "num_query_groups=6 is not divisible by tp=4"),
    ("tp-above-heads", 8, lambda t, p, m: ["--tp", "8"], "tp=8 is larger than num_attention_heads=4"),
    ("hidden-vs-heads", 1, lambda t, p, m: ["--hidden-size", "30"], "hidden_size=30 is not divisible by num_attention_heads=4"),
    ("layers-vs-pp", 2, lambda t, p, m: ["--pp", "2", "--num-layers", "3"], "num_layers=3 is not divisible by pp*vpp=2*1"),
    ("batch-vs-micro", 2, lambda t, p, m: ["--global-batch-size", "9"],
     "global_batch_size=9 is not divisible by micro_batch_size*dp=1*2"),
    ("interleaved-microbatches", 2, lambda t, p, m: ["--pp", "2", "--vpp", "2", "--global-batch-size", "3"],
     "needs micro-batches per step (3) to be a multiple of pp=2"),
    ("vpp-without-interleaved", 2, lambda t, p, m: ["--pp", "2", "--vpp", "2", "--pp-schedule", "1f1b"],
     "--vpp 2 needs the interleaved schedule"),
    ("zero-size", 1, lambda t, p, m: ["--hidden-size", "0"], "--hidden-size=0 must be a positive integer"),
    ("negative-size", 1, lambda t, p, m: ["--num-layers", "-2"], "--num-layers=-2 must be a positive integer"),
    ("unknown-flag", 1, lambda t, p, m: ["--tensor-paralel-size", "2"], "did you mean --tensor-model-parallel-size"),
    ("bad-number", 1, lambda t, p, m: ["--lr", "fast"], "invalid float value: 'fast'"),
    ("bad-choice", 1, lambda t, p, m: ["--precision", "fp8"], "invalid choice: 'fp8'"),
    ("missing-yaml", 1, lambda t, p, m: ["--config", str(t / "none.yaml")], "does not exist"),
    ("malformed-yaml", 1, lambda t, p, m: _yaml(t, "model:\n  num_layers: [4\n"), "is not valid YAML at line"),
    ("yaml-unknown-field", 1, lambda t, p, m: _yaml(t, "model:\n  hiden_size: 64\n"), "did you mean 'hidden_size'"),
    ("yaml-unknown-section", 1, lambda t, p, m: _yaml(t, "modle:\n  hidden_size: 64\n"), "did you mean 'model'"),
    ("seq-above-positions", 1, lambda t, p, m: ["--max-position-embeddings", "16"],
     "seq_length=32 exceeds max_position_embeddings=16"),
    ("min-lr-above-lr", 1, lambda t, p, m: ["--min-lr", "1.0"], "min_lr=1.0 is larger than lr=0.003"),
    ("missing-data", 1, lambda t, p, m: ["--data-path", str(t / "nope"), "--tokenizer-model", m], "nope"),
    ("data-without-tokenizer", 1, lambda t, p, m: ["--data-path", p], "--tokenizer-model"),
    ("missing-tokenizer", 1, lambda t, p, m: ["--data-path", p, "--tokenizer-model", str(t / "x.model")], "x.model"),
    ("idx-without-bin", 1, lambda t, p, m: ["--data-path", _copy_data(t, p, drop=".bin"), "--tokenizer-model", m],
     ".bin"),
    ("truncated-idx", 1, lambda t, p, m: ["--data-path", _copy_data(t, p, truncate=".idx"), "--tokenizer-model", m],
     "copy.idx"),
    ("vocab-too-small", 1, lambda t, p, m: ["--data-path", p, "--tokenizer-model", m, "--vocab-size", "100"],
     "--vocab-size"),
    ("cp-vs-seq", 2, lambda t, p, m: ["--cp", "2", "--seq-length", "30"],
     "seq_length=30 is not divisible by 2*cp=4"),
    ("cp-a2a-vs-heads", 8, lambda t, p, m: ["--cp", "8", "--cp-comm-type", "a2a"],
     "--cp-comm-type a2a splits each TP rank's 4 query and 4 key/value heads over cp=8"),
    ("cp-a2a+p2p-vs-cp", 4, lambda t, p, m: ["--cp", "4", "--cp-comm-type", "a2a+p2p",
                                             "--hierarchical-context-parallel-sizes", "2", "4"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P with A*P = cp=4"),
    ("blend-weight-negative", 1, lambda t, p, m: ["--data-path", "-0.5", p, "1.5", p, "--tokenizer-model", m],
     "positive"),
]  # fmt: skip


# Runs each case given as JSON [[argv, world, out], ...] on stdin in a forked child (its stdout
# to the file out + ".1", its stderr to out + ".2") and prints [exit status, ...].
DRIVER = """
import json, os, sys
from megalite.train import cli
codes = []
for argv, world, out in json.load(sys.stdin):
    pid = os.fork()
    if pid == 0:
        for stream in (1, 2):
            os.dup2(os.open(f"{out}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), stream)
        os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
        sys.argv = ["pretrain_gpt.py", *argv]
        code = 0
        try:
            cli()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def outcomes(tiny_data, tmp_path_factory):
    """{case id: (exit status, stdout, stderr)} of every case, each run as pretrain_gpt.py
    would."""
    prefix, model = tiny_data
    jobs = []
    for name, world, flags, _ in CASES:
        tmp = tmp_path_factory.mktemp(name)
        argv = [*TINY, *flags(tmp, prefix, model), "--train-iters", "1"]
        jobs.append([argv, world, str(tmp / "out")])
    r = subprocess.run([sys.executable, "-c", DRIVER], cwd=ROOT, input=json.dumps(jobs),
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    codes = json.loads(r.stdout.splitlines()[-1])
    out = {}
    for case, (_, _, path), code in zip(CASES, jobs, codes):
        out[case[0]] = (code, open(f"{path}.1").read(), open(f"{path}.2").read())
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line(case, outcomes):
    name, _, _, expected = case
    code, stdout, stderr = outcomes[name]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, (code, stderr[-2000:])
    assert "Traceback" not in stdout + stderr
    assert len(lines) == 1 and lines[0].startswith("megalite: error: "), lines
    assert expected in lines[0], lines[0]
