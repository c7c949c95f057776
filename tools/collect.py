#!/usr/bin/env python3
"""Paste the benchmark reports into docs/benchmarks.md.

    python tools/collect.py                      # tools/reports/*.md -> docs/benchmarks.md
    python tools/collect.py --readme README.md   # also the README's headline rows

Each tool in tools/ writes <name>.json and <name>.md into tools/reports/ (`--report`);
this joins the Markdown sections, in a fixed order (generation, training, tokenizer, export,
matrix products, profiles, GPU check, then the rest by name), under a short header, each
followed by a link to its JSON. With `--readme`, the block between `<!-- benchmarks:start -->`
and `<!-- benchmarks:end -->` in that file becomes a table of the reports' headline figures.
"""
import argparse
import glob
import os
import re
import sys

try:
    from . import report
except ImportError:  # run as `python tools/collect.py`: this folder is on sys.path
    import report

ORDER = ("generation", "train", "tokenizer", "export", "matmul", "profile", "gpu")
START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
HEADER = """# Benchmarks

This page is generated: each section below is one report, written as Markdown and JSON into
`tools/reports/` by the command it names (with the machine, library versions and date; the JSON
also records the commit), and pasted here by `python tools/collect.py`. To regenerate, run the commands
shown (from the repository root, on an otherwise idle machine), then `python tools/collect.py`.
A figure with a range is the median (min-max) of the runs the section describes. Speed does not
depend on the weights' values: the 124M figures come from random weights of that shape
(`tfgpt2 make-checkpoint 124M`). Figures compare only within one machine; how the speed is
obtained and how to measure it is in [performance.md](performance.md).
"""


def rank(name):
    """The section's place in ORDER, then the name with its numbers in numeric order
    (train-lora-355M before train-lora-1558M)."""
    natural = [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]
    for i, prefix in enumerate(ORDER):
        if name == prefix or name.startswith(prefix + "-") or name.startswith(prefix + "_"):
            return (i, natural)
    return (len(ORDER), natural)


def reports(directory):
    """[(name, JSON dict, Markdown text)] of the reports in `directory`, in page order."""
    found = []
    for path in glob.glob(os.path.join(directory, "*.json")):
        name = os.path.splitext(os.path.basename(path))[0]
        with open(path[:-len(".json")] + ".md", encoding="utf-8") as f:
            found.append((name, report.load(path), f.read()))
    return sorted(found, key=lambda r: rank(r[0]))


def link(directory, name, output):
    """The JSON's path relative to the page, for a Markdown link."""
    target = os.path.join(directory, name + ".json")
    return os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(output))).replace(os.sep, "/")


def page(directory, output):
    """docs/benchmarks.md's text."""
    sections = [HEADER.rstrip("\n")]
    for name, data, text in reports(directory):
        sections.append(text.rstrip("\n") + f"\n\nJSON: [{data['tool']} report `{name}`]({link(directory, name, output)})")
    return "\n\n".join(sections) + "\n"


def headlines(directory, output):
    """The README's block: one row per headline figure, with the report it comes from."""
    lines = ["| measure | result | report |", "|---|---|---|"]
    for name, data, _ in reports(directory):
        for h in data.get("headlines", []):
            lines.append(f"| {h['what']} | {h['figure']} | [{name}]({link(directory, name, output)}) |")
    machines = sorted({data["machine"] for _, data, _ in reports(directory) if data.get("headlines")})
    lines += ["", "On " + "; ".join(machines) + ". Commands, spread and versions: "
              "[docs/benchmarks.md](docs/benchmarks.md)."]
    return "\n".join(lines)


def replace_block(text, block):
    if START not in text or END not in text:
        raise SystemExit(f"no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{block}\n{END}{tail}"


def write(path, text):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reports", default=report.DEFAULT_DIR, help="the reports' folder (default: tools/reports/)")
    p.add_argument("--output", default=os.path.join(report.ROOT, "docs", "benchmarks.md"))
    p.add_argument("--readme", help="also replace the headline block of this file (README.md)")
    args = p.parse_args(argv)
    if not glob.glob(os.path.join(args.reports, "*.json")):
        print(f"{args.reports}: no reports (run the benchmarks first)", file=sys.stderr)
        return 1
    write(args.output, page(args.reports, args.output))
    print(f"wrote {args.output}", file=sys.stderr)
    if args.readme:
        with open(args.readme, encoding="utf-8") as f:
            text = f.read()
        write(args.readme, replace_block(text, headlines(args.reports, args.readme)))
        print(f"updated {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
