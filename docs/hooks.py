"""MkDocs hooks: pages generated from the code, and the benchmarks' plots.

- `<!-- readme -->` (the front page) becomes the README, its links made relative to docs/;
- `<!-- cli-help -->` in a page becomes the help of `hf-diloco` and of each of its commands, as `--help` prints it;
- `<!-- fields: NAME -->` becomes a table of the fields of NAME (DiLoCoConfig or RunArguments): name, default and
  the help text the CLI shows for it;
- the plots the benchmarks write (benchmarks/results/*.png) are served under img/, for the pages that cite them.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for plot in sorted((REPO / "benchmarks" / "results").glob("*.png")):
        files.append(File.generated(config, f"img/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- readme -->" in markdown:  # the front page is the README, its links made relative to docs/
        readme = (REPO / "README.md").read_text().split("\n", 1)[1]  # its title is the page's
        markdown = markdown.replace("<!-- readme -->", readme.replace("](docs/", "]("))
    if "<!-- cli-help -->" in markdown:
        markdown = markdown.replace("<!-- cli-help -->", cli_help())
    return re.sub(r"<!-- fields: (\w+) -->", lambda match: fields_table(match.group(1)), markdown)


def cli_help() -> str:
    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the page's is fixed
    from hf_diloco.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    blocks = [f"## hf-diloco\n\n```text\n{parser.format_help()}```\n"]
    blocks += [f"## hf-diloco {name}\n\n```text\n{sub.format_help()}```\n" for name, sub in commands.items()]
    return "\n".join(blocks)


def fields_table(name: str) -> str:
    """The table of the fields `name` adds: each with its type, its default as Python writes it (a string quoted,
    so an empty one shows) and its help, whose prose is escaped so that Markdown shows it as written (`*` of a
    formula, `<output_dir>` of a path); the parts in backticks stay code."""
    from hf_diloco import config

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(getattr(config, name)):
        if not field.init or field.name in _inherited(name):
            continue
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None)
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        meaning = _as_written(" ".join((field.metadata.get("help") or "").split()))
        rows.append(f"| `{field.name}` | `{kind}` | `{default!r}` | {meaning} |")  # (a | in code splits no cell)
    return "\n".join(rows)


def _as_written(text: str) -> str:
    """Markdown that shows `text` as written in a table cell: outside its backtick spans, HTML's, emphasis's and the
    table's characters are escaped (inside code spans none needs to be)."""
    import html

    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # the even pieces lie outside code spans
        pieces[i] = html.escape(pieces[i], quote=False).replace("*", "\\*").replace("_", "\\_").replace("|", "\\|")
    return "`".join(pieces)


def _inherited(name: str) -> set[str]:
    """Fields DiLoCoConfig takes from TrainingArguments (their reference is transformers')."""
    if name != "DiLoCoConfig":
        return set()
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}
