"""Plot columns of one or several metrics files (--metrics-file) into one PNG, to compare runs.

    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --labels tp1 tp2 \\
        --columns loss tokens_per_s grad_norm comm_bytes.tp -o metrics.png

A column is a field of the metrics objects; `a.b` reads a nested one (comm_bytes.tp). `loss`
also draws `eval_loss` where present (dashed). Rows without the column are skipped.
"""

import argparse
import json
import math
import os


def read(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def value(row: dict, column: str):
    for key in column.split("."):
        if not isinstance(row, dict) or row.get(key) is None:
            return None
        row = row[key]
    return row if isinstance(row, int | float) else None


def series(rows: list[dict], column: str) -> tuple[list, list]:
    pts = [(r["iteration"], value(r, column)) for r in rows]
    pts = [(x, y) for x, y in pts if y is not None]
    return [x for x, _ in pts], [y for _, y in pts]


def plot(files: list[str], labels: list[str], columns: list[str], output: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read(f) for f in files]
    cols = min(len(columns), 2)
    rows = math.ceil(len(columns) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3 * rows), dpi=100, squeeze=False)
    for ax, column in zip(axes.flat, columns):
        for i, (data, label) in enumerate(zip(runs, labels)):
            color = f"C{i}"
            ax.plot(*series(data, column), color=color, label=label, linewidth=1.2)
            if column == "loss":
                x, y = series(data, "eval_loss")
                if x:
                    ax.plot(x, y, "o--", color=color, markersize=3, label=f"{label} (eval)")
        ax.set_title(column, fontsize=10)
        ax.set_xlabel("iteration", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if column in ("loss", "grad_norm") and all(
            y > 0 for r in runs for y in series(r, column)[1]
        ):
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(columns) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="metrics files (JSON lines)")
    ap.add_argument("--labels", nargs="+", help="one per file (default: the file's directory)")
    ap.add_argument("--columns", nargs="+", default=["loss", "tokens_per_s", "grad_norm", "lr"])
    ap.add_argument("-o", "--output", default="metrics.png", help="PNG to write [metrics.png]")
    args = ap.parse_args()
    labels = args.labels or [
        os.path.basename(os.path.dirname(os.path.abspath(f))) for f in args.files
    ]
    if len(labels) != len(args.files):
        ap.error(f"{len(args.files)} files but {len(labels)} labels")
    plot(args.files, labels, args.columns, args.output)
    print(args.output)


if __name__ == "__main__":
    main()
