#!/usr/bin/python3
"""plot-scale.py - draws docs/scale.svg from bench_scale's table.

    KVR_SCALE_TSV=/tmp/scale.tsv build/bench/bench_scale
    /usr/bin/python3 scripts/plot-scale.py /tmp/scale.tsv docs/scale.svg

Three panels against the store's size in cached tokens, log-log: latency
(prefix match p50 / p99 warm and with cold caches; cover lookup p99),
metadata bytes per cached token, and the resident set over what the store
accounts (a flat line at 1 is the goal's middle; 0.95 and 1.05 its edges).
One line style per model shape (the table's first column). Needs matplotlib
(Debian's /usr/bin/python3 has it); the Agg backend, no display.
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STYLES = ["-", "--", ":", "-."]


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    shapes = {}
    for r in rows:
        shapes.setdefault(r["shape"], []).append(r)
    return shapes


def col(rows, name):
    return [float(r[name]) for r in rows]


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot-scale.py TABLE.tsv OUT.svg")
    shapes = read(sys.argv[1])
    if not shapes:
        sys.exit("plot-scale.py: no rows in %s" % sys.argv[1])
    plt.rcParams["svg.hashsalt"] = "kvrope-scale"   # the same SVG for the same table
    fig, (lat, meta, rss) = plt.subplots(1, 3, figsize=(15, 4.8))
    lines = [("match_p50_us", "match p50 (warm)", "C0"),
             ("match_p99_us", "match p99 (warm)", "C1"),
             ("cold_p50_us", "match p50 (cold caches)", "C9"),
             ("cold_p99_us", "match p99 (cold caches)", "C3"),
             ("cover_p99_us", "cover p99 (CPU)", "C2")]
    for i, (shape, rows) in enumerate(shapes.items()):
        ls = STYLES[i % len(STYLES)]
        x = col(rows, "tokens")
        for key, label, color in lines:
            lat.plot(x, col(rows, key), ls, color=color, marker="o", ms=3,
                     label="%s, %s" % (label, shape))
        meta.plot(x, col(rows, "meta_b_per_token"), ls, color="C4", marker="o", ms=3,
                  label="metadata B / token, %s" % shape)
        rss.plot(x, col(rows, "rss_over_accounted"), ls, color="C5", marker="o", ms=3,
                 label="RSS / accounted, %s" % shape)
    lat.set_title("latency")
    lat.set_ylabel("microseconds")
    meta.set_title("metadata per cached token (outside the K/V)")
    meta.set_ylabel("bytes")
    rss.set_title("resident set / accounted bytes")
    rss.axhspan(0.95, 1.05, color="0.9", label="goal: within 5%")
    for ax in (lat, meta, rss):
        ax.set_xscale("log")
        ax.set_xlabel("cached tokens in the store")
        ax.grid(True, which="both", lw=0.3)
    lat.set_yscale("log")
    meta.set_yscale("log")
    rss.set_yscale("log")
    lat.legend(fontsize=6.5, loc="upper left")
    meta.legend(fontsize=7)
    rss.legend(fontsize=7)
    fig.suptitle("kvrope: costs as the store grows (build/bench/bench_scale)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], metadata={"Date": None})


if __name__ == "__main__":
    main()
