"""Draw a timeline written by --profile-steps A:B (DIR/timeline.json) as a Gantt chart PNG.

    python tools/plot_timeline.py runs/tiny/timeline.json -o timeline.png

One row per rank; forwards in blue, backwards in green (chunk 0) and orange (chunk 1), each
labelled with its micro-batch (and chunk); time blocked in send/recv cross-hatched, idle time
hatched; the measured bubble of the first stage in the title.
"""

import argparse

from megalite.training.timeline import load, plot_timeline


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("timeline", help="timeline.json")
    ap.add_argument("-o", "--output", default="timeline.png", help="PNG to write [timeline.png]")
    ap.add_argument("--title", help="title (default: the run's)")
    args = ap.parse_args()
    plot_timeline(load(args.timeline), args.output, title=args.title)
    print(args.output)


if __name__ == "__main__":
    main()
