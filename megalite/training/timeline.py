"""A measured pipeline diagram: what each rank did, and when, during the profiled steps.

`--profile-steps A:B` records steps A..B-1 (numbered as the console and the metrics file number
them, from 1). During those steps the executor records one span per compute (forward or
backward of a chunk and micro-batch) and per batch of point-to-point operations (the time this
rank was blocked sending/receiving), the trainer one span for the optimizer step. After step
B-1 every rank's spans are gathered to rank 0, which writes DIR/timeline.json and draws
DIR/timeline.png (DIR: the metrics file's directory, else the W&B directory).

Times are seconds on each rank's own clock, measured from the start of its first profiled
schedule. Ranks are aligned at that start: every step ends with collectives over the whole
world (gradient norm, parameter gathers), so the ranks start a step within a collective's
latency of each other, and no cross-host clock is needed.

timeline.json: {"version": 1, "steps": [A, B], "meta": {...}, "ranks": [{"rank", "coords":
{"tp", "pp", "dp"}, "spans": [{"kind", "step", "start", "end", "chunk"?, "mb"?, "ops"?}]}]}
with kind one of forward, backward, send, recv, send+recv (a p2p batch), cp (a ring hop of
context parallelism waited for, inside a compute span), schedule (the whole run_schedule of a
step), optimizer.
"""

import json
import os

from megalite.clock import Clock
from megalite.errors import MegaliteError
from megalite.training.run_settings import wandb_setting

COMPUTE = ("forward", "backward", "backward-input", "backward-weight")
P2P = ("send", "recv", "send+recv")


def parse_steps(spec: str) -> tuple[int, int]:
    """Parse "A:B" into (A, B), checking 1 <= A < B."""
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        a = b = None
    if a is None or not 1 <= a < b:
        raise MegaliteError(
            f"--profile-steps {spec!r} must be A:B with 1 <= A < B (steps A..B-1 are recorded)"
        )
    return a, b


class Timeline:
    """The spans of one rank over steps [first, last]."""

    def __init__(self, steps: tuple[int, int], rank: int = 0, coords=None, out_dir: str = ".",
                 clock: Clock | None = None):  # fmt: skip
        self.first, self.last = steps[0], steps[1] - 1
        self.rank, self.coords = rank, coords or {"tp": 0, "pp": 0, "dp": 0}
        self.out_dir = out_dir
        self.spans: list[dict] = []
        self.clock = clock or Clock("cpu")
        self.origin = None  # a mark before the first profiled step: every span is after it
        self.step: int | None = None
        self.saved = False

    @classmethod
    def from_config(cls, cfg, groups) -> "Timeline | None":
        """None unless cfg.training.profile_steps is set."""
        spec = cfg.training.profile_steps
        if not spec:
            return None
        log = cfg.logging
        out_dir = os.path.dirname(os.path.abspath(log.metrics_file)) if log.metrics_file else None
        return cls(parse_steps(spec), groups.rank, groups.topo.coords(groups.rank),
                   out_dir or wandb_setting(log, "dir"), Clock(groups.device))  # fmt: skip

    def at(self, iteration: int) -> "Timeline | None":
        """This timeline while `iteration` (numbered from 1) is profiled, else None."""
        if not self.first <= iteration <= self.last:
            return None
        if self.origin is None:
            self.origin = self.clock.mark()
        self.step = iteration
        return self

    def record(self, kind: str, start, end, **fields):
        """A span between two marks of the clock (megalite.clock); fields: chunk, mb, ops."""
        self.spans.append({"kind": kind, "step": self.step, "start": start, "end": end, **fields})

    def relative_spans(self) -> list[dict]:
        """The spans in time order, in seconds from the first one's start (reading the marks: a
        GPU waits for them here, after the profiled steps)."""
        if not self.spans:
            return []
        sec = self.clock.seconds
        spans = [{**s, "start": sec(self.origin, s["start"]), "end": sec(self.origin, s["end"])}
                 for s in self.spans]  # fmt: skip
        first = min(s["start"] for s in spans)
        spans = [{**s, "start": s["start"] - first, "end": s["end"] - first} for s in spans]
        return sorted(spans, key=lambda s: (s["start"], s["kind"] != "schedule"))

    # ---- gather and write -------------------------------------------------------------------

    def step_done(self, iteration: int, groups, meta: dict, wandb_run=None) -> str | None:
        """Call on every rank after every step. After the last profiled step, gather to rank 0,
        write timeline.json and timeline.png; returns the PNG path on rank 0."""
        if self.saved or iteration < self.last:
            return None
        self.saved = True
        from megalite.parallel import comm

        mine = {"rank": self.rank, "coords": self.coords, "spans": self.relative_spans()}
        ranks = comm.gather_object(mine, groups.world)
        if self.rank != 0:
            return None
        data = {"version": 1, "steps": [self.first, self.last + 1], "meta": meta, "ranks": ranks}
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, "timeline.json")
        with open(path, "w") as fh:
            json.dump(data, fh)
        png = os.path.join(self.out_dir, "timeline.png")
        try:
            plot_timeline(data, png)
        except ImportError:  # matplotlib is optional: the JSON is the record
            print(f"timeline written to {path} (install matplotlib for the chart)", flush=True)
            return None
        print(f"timeline written to {path} and {png}", flush=True)
        if wandb_run is not None:
            log_timeline(wandb_run, png, step=self.last)
        return png


def load(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


# ---- reading a timeline ----------------------------------------------------------------------


def busy_fraction(spans: list[dict]) -> tuple[float, float]:
    """(compute seconds, schedule seconds) of one rank over its profiled steps."""
    compute = sum(s["end"] - s["start"] for s in spans if s["kind"] in COMPUTE)
    total = sum(s["end"] - s["start"] for s in spans if s["kind"] == "schedule")
    return compute, total


def exposed_share(data: dict, kind: str = "cp") -> float:
    """Seconds blocked in `kind` waits over the seconds of the schedules, averaged over ranks:
    the share of the step that communication left exposed (not hidden behind compute)."""
    shares = []
    for r in data["ranks"]:
        total = sum(s["end"] - s["start"] for s in r["spans"] if s["kind"] == "schedule")
        waited = sum(s["end"] - s["start"] for s in r["spans"] if s["kind"] == kind)
        shares.append(waited / total if total > 0 else 0.0)
    return sum(shares) / len(shares) if shares else 0.0


def measured_bubble(data: dict) -> float | None:
    """The first stage's idle time over its compute time, as the metrics file's
    `bubble_measured` (comparable with Megatron's (pp-1)/(vpp*m), `bubble_theory`), for the
    rank at pp=0, tp=0, dp=0: its compute against each step's longest schedule among the
    ranks of its pipeline (`executor.first_stage_times`)."""
    pipeline = [r for r in data["ranks"]
                if not any(v for k, v in r["coords"].items() if k != "pp")] or data["ranks"]  # fmt: skip
    first = next((r for r in pipeline if not r["coords"].get("pp")), pipeline[0])
    compute = busy_fraction(first["spans"])[0]
    per_rank = {}  # (rank, step) -> its schedule seconds
    for r in pipeline:
        for s in r["spans"]:
            if s["kind"] == "schedule":
                key = r["rank"], s["step"]
                per_rank[key] = per_rank.get(key, 0.0) + s["end"] - s["start"]
    longest = {}  # step -> the longest of the pipeline's ranks
    for (_, step), seconds in per_rank.items():
        longest[step] = max(longest.get(step, 0.0), seconds)
    return None if compute <= 0 else (sum(longest.values()) - compute) / compute


# ---- drawing ---------------------------------------------------------------------------------

# Forward in blues, backward (or its input half, I) in greens then oranges (one shade per
# chunk), the weight half (W) in greys, p2p waits hatched.
FORWARD = ["#1f5fa8", "#6fa8dc", "#0b3866", "#9fc5e8"]
BACKWARD = ["#38a34a", "#f0912c", "#1e6b2b", "#c4620f"]
WEIGHT = ["#7a7a7a", "#b0b0b0", "#4d4d4d", "#d0d0d0"]


LETTER = {"forward": "F", "backward": "B", "backward-input": "I", "backward-weight": "W"}


def _label(span: dict, chunks: int) -> str:
    letter = LETTER[span["kind"]]
    return f"{letter}{span['mb']}" + (f".{span['chunk']}" if chunks > 1 else "")


def plot_timeline(data: dict, path: str, title: str | None = None):
    """Gantt chart of a timeline (the dict of timeline.json) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(data["ranks"], key=lambda r: (r["coords"]["pp"], r["rank"]))
    meta = data.get("meta", {})
    chunks = max(
        [1 + s.get("chunk", 0) for r in ranks for s in r["spans"] if s["kind"] in COMPUTE] or [1]
    )
    end = max(s["end"] for r in ranks for s in r["spans"])
    scale, unit = (1e3, "ms") if end < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(12, 1.3 + 0.55 * len(ranks)), dpi=100)
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        for s in r["spans"]:
            x0, w = s["start"] * scale, (s["end"] - s["start"]) * scale
            kind = s["kind"]
            if kind == "schedule":  # the step's extent: idle wherever nothing else is drawn
                ax.barh(y, w, left=x0, height=0.8, color="white", edgecolor="#bbbbbb",
                        hatch="///", linewidth=0.5)  # fmt: skip
            elif kind in COMPUTE:
                shades = {"forward": FORWARD, "backward-weight": WEIGHT}.get(kind, BACKWARD)
                color = shades[s.get("chunk", 0) % len(shades)]
                ax.barh(y, w, left=x0, height=0.8, color=color, edgecolor="black", linewidth=0.4)
                if w > end * scale / 60:  # label where it fits
                    ax.text(x0 + w / 2, y, _label(s, chunks), ha="center", va="center",
                            fontsize=7, color="white", clip_on=True)  # fmt: skip
            elif kind in P2P or kind == "cp":
                ax.barh(y, w, left=x0, height=0.5, color="#dddddd", edgecolor="#888888",
                        hatch="xx", linewidth=0.4)  # fmt: skip
            elif kind == "optimizer":
                ax.barh(y, w, left=x0, height=0.8, color="#8e63b5", edgecolor="black",
                        linewidth=0.4)  # fmt: skip
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(
        [f"rank {r['rank']} (pp {r['coords']['pp']})" for r in reversed(ranks)],
        fontsize=8,
    )
    ax.set_xlabel(f"time ({unit}) from the start of step {data['steps'][0]}")
    ax.set_xlim(0, end * scale * 1.01)
    bubble = measured_bubble(data)
    parts = [title or meta.get("title") or "pipeline timeline"]
    if bubble is not None:
        parts.append(f"bubble (first stage idle / compute) {bubble:.1%}")
    if meta.get("bubble_theory") is not None:
        parts.append(f"theory (pp-1)/(vpp*m) {meta['bubble_theory']:.1%}")
    if any(s["kind"] == "cp" for r in ranks for s in r["spans"]):
        parts.append(f"cp ring hops exposed {exposed_share(data):.1%} of the schedule")
    ax.set_title("   ".join(parts), fontsize=10)
    legend = [
        Patch(color=FORWARD[0], label="forward (chunk 0)"),
        Patch(color=BACKWARD[0], label="backward (chunk 0)"),
    ]
    if chunks > 1:
        legend += [
            Patch(color=FORWARD[1], label="forward (chunk 1)"),
            Patch(color=BACKWARD[1], label="backward (chunk 1)"),
        ]
    if any(s["kind"] == "backward-weight" for r in ranks for s in r["spans"]):
        legend.append(Patch(color=WEIGHT[0], label="weight gradients (W)"))
    legend += [
        Patch(
            facecolor="#dddddd",
            edgecolor="#888888",
            hatch="xx",
            label="blocked in send/recv (or a cp ring hop)",
        ),
        Patch(facecolor="white", edgecolor="#bbbbbb", hatch="///", label="idle"),
    ]
    if any(s["kind"] == "optimizer" for r in ranks for s in r["spans"]):
        legend.append(Patch(color="#8e63b5", label="optimizer"))
    ax.grid(axis="x", alpha=0.3)
    height = fig.get_size_inches()[1]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))  # leave the bottom 0.3 inch to the legend
    fig.savefig(path)
    plt.close(fig)


def log_timeline(run, png_path: str, step: int | None = None):
    """Log a timeline PNG to a W&B run (`wandb.init()`'s return) as the image "timeline"."""
    import wandb

    run.log({"timeline": wandb.Image(png_path)}, step=step)
