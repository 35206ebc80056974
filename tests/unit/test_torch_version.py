"""setup.py's oldest torch has every torch.distributed API megalite calls, with the keyword
arguments it passes. The installed torch shows only itself, so the versions come from a table
(torch's release notes), and the test fails when megalite calls something the table lacks or
when setup.py allows a torch older than something megalite needs."""

import re
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

# torch.distributed name -> the first torch release that has it as megalite calls it
SINCE = {
    "HashStore": (1, 8),
    "PrefixStore": (1, 8),
    "Store": (1, 8),
    "TCPStore": (1, 8),
    "ReduceOp": (1, 8),
    "P2POp": (1, 8),
    "batch_isend_irecv": (1, 8),
    "isend": (1, 8),
    "irecv": (1, 8),
    "recv": (1, 0),
    "all_reduce": (1, 8),
    "broadcast": (1, 8),
    "barrier": (1, 8),
    "all_to_all_single": (1, 8),
    "all_gather_object": (1, 8),
    "gather_object": (1, 8),
    "new_group": (1, 8),
    "distributed_c10d": (2, 1),  # _world.pg_names (groups.py: a fresh world?)
    "get_rank": (1, 8),
    "get_world_size": (1, 8),
    "get_backend": (1, 8),
    "is_initialized": (1, 8),
    "destroy_process_group": (1, 8),
    "group": (1, 8),
    "init_process_group": (2, 3),  # device_id=
    "all_gather_into_tensor": (2, 0),
    "reduce_scatter_tensor": (2, 0),
    "get_process_group_ranks": (2, 0),
    # renamed in 2.13: called only through comm.py's fallback to the names above
    "all_gather_single": (2, 13),
    "reduce_scatter_single": (2, 13),
}
KEYWORDS = {"group_peer=": (2, 6)}  # P2POp(group_peer=): pytorch/pytorch#141054, torch 2.6
FALLBACK = {"all_gather_single": "all_gather_into_tensor",
            "reduce_scatter_single": "reduce_scatter_tensor"}  # fmt: skip


def _min_torch() -> tuple:
    line = re.search(r'"torch>=([\d.]+)"', (ROOT / "setup.py").read_text())
    assert line, "setup.py names no minimum torch"
    return tuple(int(x) for x in line.group(1).split(".")[:2])


def _sources():
    for d in ("megalite", "kernels", "bench"):
        yield from (ROOT / d).rglob("*.py")


def _needed() -> dict:
    """{api: first version} of what megalite (and bench/) calls, a renamed API by its fallback."""
    out = {}
    for f in _sources():
        text = f.read_text()
        for name in set(re.findall(r"\bdist\.([A-Za-z_]\w*)", text)):
            assert name in SINCE, f"{f.relative_to(ROOT)} calls dist.{name}: add it to SINCE"
            if name in FALLBACK:
                assert f'getattr(dist, "{name}", None) or dist.{FALLBACK[name]}' in text, (
                    f"{f.relative_to(ROOT)}: dist.{name} without a fallback"
                )
                name = FALLBACK[name]
            out[name] = SINCE[name]
        for kw, since in KEYWORDS.items():
            if kw in text:
                out[kw] = since
    return out


def test_setup_py_allows_no_torch_older_than_what_megalite_calls():
    need = _needed()
    assert "group_peer=" in need and "all_gather_into_tensor" in need  # the scan sees them
    low = _min_torch()
    old = {api: v for api, v in need.items() if v > low}
    assert not old, f"setup.py allows torch {low}, older than these need: {old}"


def test_the_table_names_real_apis_of_the_installed_torch():
    missing = [name for name in SINCE if not hasattr(dist, name)]
    assert not missing
    assert "group_peer" in dist.P2POp.__init__.__code__.co_varnames


def test_a_planted_too_old_minimum_fails():
    need = _needed()
    assert any(v > (2, 4) for v in need.values())  # torch>=2.4, main's line, is too old
