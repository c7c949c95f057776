"""The benchmarks' reports: every tool in tools/ writes its figures through `write`.

A report is `<DIR>/<name>.json` and `<DIR>/<name>.md` (`--report DIR`, default
tools/reports/). The JSON holds everything: title, the exact command, the machine
(`machine.describe()`), library versions, date, git commit, the tool's settings, notes and one
or more tables. A table is columns (key, header, format) and rows (dicts by key); a figure
measured several times is a spread, {"median", "min", "max", "n"}, shown as
`median (min-max)`. The Markdown is rendered from the JSON alone (`markdown(data)`): a
self-contained section (heading, notes, tables, then a line with the command, machine, versions,
date and commit), so that `tools/collect.py` can paste the sections into docs/benchmarks.md.
A report may name headline figures (`headlines`: what, figure), which collect.py can list.
"""
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys

try:
    from . import machine
except ImportError:  # run as `python tools/<tool>.py`: this folder is on sys.path
    import machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_DIR = os.path.join(HERE, "reports")
PACKAGES = ("tensorflow", "keras", "numpy", "tiktoken", "keras-hub", "transformers", "torch", "apache-beam")
# what collect.py's command line leaves out of the "local changes" check: the reports themselves
GENERATED = ("tools/reports", "docs/benchmarks.md")


def add_arguments(parser, name):
    """`--report DIR`, `--note TEXT` and `--name NAME` (default `name`) on a tool's parser."""
    parser.add_argument("--report", metavar="DIR", default=DEFAULT_DIR,
                        help="write the report here as <name>.json and <name>.md (default: tools/reports/)")
    parser.add_argument("--note", action="append", default=[], metavar="TEXT",
                        help="a sentence added to the report (what the weights are, ...); repeatable")
    parser.add_argument("--name", default=name, help=f"the report's file name, without extension (default: {name})")
    return parser


# ---- figures ------------------------------------------------------------------------------

def spread(values):
    """{"median", "min", "max", "n"} of repeated measurements."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def is_spread(value):
    return isinstance(value, dict) and {"median", "min", "max"} <= set(value)


def median(value):
    """A cell's central figure: a spread's median, or the value itself."""
    return value["median"] if is_spread(value) else value


def column(key, header, fmt=None):
    """A table column: the rows' `key`, shown under `header`, numbers as format(x, fmt)."""
    return {"key": key, "header": header, "format": fmt}


def table(columns, rows, title=None):
    return {"title": title, "columns": columns, "rows": rows}


# ---- the environment ----------------------------------------------------------------------

def versions():
    """python and each installed package of PACKAGES: version string."""
    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def git(*args):
    try:
        done = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit():
    """(short commit, whether tracked files other than the reports differ from it); ("unknown",
    None) outside git."""
    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown", None
    changes = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{p}" for p in GENERATED))
    return head, None if changes is None else bool(changes)


def command_line(tool, argv=None):
    """`python tools/<tool>.py ARGS` as typed from the repository root."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path = os.path.relpath(os.path.abspath(tool), ROOT)
    return " ".join(shlex.quote(a) for a in ["python", path, *argv])


# ---- writing ------------------------------------------------------------------------------

def build(name, title, tables, *, tool, argv=None, settings=None, notes=(), headlines=()):
    """The report's JSON-able dict (see the module's docstring)."""
    head, changed = commit()
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"name": name, "title": title, "tool": os.path.relpath(os.path.abspath(tool), ROOT),
            "command": command_line(tool, argv), "machine": machine.describe(), "versions": versions(),
            "date": now.isoformat(timespec="seconds"), "commit": head, "local_changes": changed,
            "settings": dict(settings or {}), "notes": [n for n in notes if n], "tables": list(tables),
            "headlines": [dict(h) for h in headlines]}


def write(data, directory=DEFAULT_DIR, *, echo=True):
    """Write <directory>/<name>.json and .md; returns both paths. With `echo` the Markdown is
    printed too."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"{data['name']}.{ext}") for ext in ("json", "md")]
    text = markdown(data)
    for path, content in zip(paths, (json.dumps(data, indent=1) + "\n", text)):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(path + ".tmp", path)
    if echo:
        print(text, flush=True)
        print(f"report: {paths[0]} and .md", file=sys.stderr)
    return paths


def publish(args, title, tables, *, tool, argv=None, settings=None, notes=(), headlines=()):
    """build + write, named `--name`, with the notes of `--note` after the tool's own, into `--report`."""
    data = build(args.name, title, tables, tool=tool, argv=argv, settings=settings,
                 notes=list(notes) + list(getattr(args, "note", [])), headlines=headlines)
    write(data, args.report)
    return data


# ---- Markdown -----------------------------------------------------------------------------

def number(value, fmt):
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) or not fmt:
        return str(value)
    return format(value, fmt)


def cell(value, fmt=None):
    """A value as shown in a table: a spread as `median (min-max)`, None as n/a."""
    if is_spread(value):
        shown = number(value["median"], fmt)
        if value.get("n", 1) > 1:
            shown += f" ({number(value['min'], fmt)}-{number(value['max'], fmt)})"
        return shown
    return number(value, fmt).replace("|", "\\|").replace("\n", " ")


def numeric(value):
    return is_spread(value) or (isinstance(value, (int, float)) and not isinstance(value, bool))


def markdown_table(t):
    columns = t["columns"]
    lines = []
    if t.get("title"):
        lines += [f"**{t['title']}**", ""]
    lines.append("| " + " | ".join(c["header"] for c in columns) + " |")
    aligns = ["---:" if any(numeric(r.get(c["key"])) for r in t["rows"]) else "---" for c in columns]
    lines.append("|" + "|".join(aligns) + "|")
    for row in t["rows"]:
        lines.append("| " + " | ".join(cell(row.get(c["key"]), c.get("format")) for c in columns) + " |")
    return "\n".join(lines)


def footer(data):
    versions_ = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    return f"`{data['command']}` on {data['machine']}; {versions_}; {data['date'][:10]}."


def markdown(data):
    """The report as a Markdown section (from its JSON alone)."""
    parts = [f"## {data['title']}"]
    if data["notes"]:
        parts.append(" ".join(data["notes"]))
    parts += [markdown_table(t) for t in data["tables"]]
    parts.append(footer(data))
    return "\n\n".join(parts) + "\n"


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)
