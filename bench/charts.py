"""Draws the chart of each benchmark in `docs/benchmarks.md` from `docs/benchmarks.json`.

`docs/benchmarks.json` holds the latest figures of each benchmark, one value per repeat, as the
benchmark's script printed them; each chart shows the medians as bars and every repeat as a dot,
so the spread is on the page.

    python bench/charts.py          # writes docs/charts/<benchmark>.png
"""

import argparse
import json
import os

import plots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "charts"),
                        help="folder of the charts (default docs/charts)")
    args = parser.parse_args(argv)
    with open(os.path.join(ROOT, "docs", "benchmarks.json")) as f:
        benchmarks = json.load(f)
    out = args.out
    os.makedirs(out, exist_ok=True)
    for name, figure in benchmarks.items():
        path = os.path.join(out, f"{name}.png")
        plots.spread_chart(path, figure["series"], f"{figure['title']} ({figure['date']})",
                           figure["unit"], reference=figure.get("reference"))
        print(path)


if __name__ == "__main__":
    main()
