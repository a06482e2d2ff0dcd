"""The documentation: the README is a short front page whose links resolve, its Python example runs, and the site
(MkDocs Material, docs/ and mkdocs.yml) builds in strict mode with the pages generated from the code."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)#]+)(#[^)]*)?\)")


def test_the_readme_is_a_front_page_whose_links_resolve():
    """At most 250 lines; every relative link names a file of the repository, and every page of the site's
    navigation is linked from it or from a page it links."""
    import yaml

    text = README.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    targets = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith("http")]
    assert targets and all((REPO / t).is_file() for t in targets), [t for t in targets if not (REPO / t).is_file()]

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    site = yaml.safe_load((REPO / "mkdocs.yml").read_text().replace("!!python", ""))
    listed = set(pages(site["nav"]))
    assert listed == {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}, \
        "every page is in the navigation"
    assert listed - {"index.md"} <= {t.removeprefix("docs/") for t in targets}, "the README links every page"


def test_the_readmes_python_example_trains(tmp_path, monkeypatch):
    """The README's Python block, as written, with its run shortened (4 steps, H = 2) and its folder in tmp."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    shorter = {"inner_steps=50": "inner_steps=2", "max_steps=400": "max_steps=4", "eval_steps=50": "eval_steps=2",
               "block_size=256": "block_size=32"}
    assert all(setting in code for setting in shorter), "the example's settings are where the test expects them"
    shortened = code
    for setting, short in shorter.items():
        shortened = shortened.replace(setting, short)
    monkeypatch.chdir(tmp_path)
    exec(compile(shortened + "\nRESULT = trainer.state.global_step\n", "README.md", "exec"), scope := {})
    assert scope["RESULT"] == 4
    records = (tmp_path / "runs" / "my-run" / "syncs.jsonl").read_text().splitlines()
    assert len(records) == 2


def test_every_python_block_of_the_docs_parses_and_imports_what_exists():
    """The README's example runs (above); the docs' other Python blocks are fragments of a user's script (their
    model, data and own trainer are the user's): each parses, and every name it imports from hf_diloco exists."""
    import ast
    import importlib

    blocks = [(page, code) for page in [README, *(REPO / "docs").rglob("*.md")]
              for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    assert len(blocks) >= 4
    imported = 0
    for page, code in blocks:
        tree = ast.parse(code, filename=str(page))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_diloco"):
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]
                assert not missing, f"{page.name}: {node.module} has no {missing}"
                imported += 1
    assert imported >= 5


@pytest.mark.process
def test_the_site_builds_strictly_with_the_pages_generated_from_the_code(tmp_path):
    """`mkdocs build --strict` (what `make docs` runs) succeeds; the API page holds every field DiLoCoConfig adds,
    with its help, the CLI page every command's help, the concepts page its diagram, and the pages citing the
    benchmarks their plots. The same strict settings fail on a link to a missing anchor."""
    from dataclasses import fields

    from transformers import TrainingArguments

    from hf_diloco import DiLoCoConfig

    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=REPO,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-3000:]
    api = re.sub(r"<[^>]+>", " ", (site / "reference" / "api" / "index.html").read_text())
    inherited = {f.name for f in fields(TrainingArguments)}
    added = [f.name for f in fields(DiLoCoConfig) if f.init and f.name not in inherited]
    assert len(added) > 30 and all(name in api for name in added), [n for n in added if n not in api]
    assert "Streaming DiLoCo: sync the model in F fragments" in api
    cli_page = (site / "reference" / "cli-help" / "index.html").read_text()
    assert all(f"hf-diloco {command}" in cli_page for command in ("train", "launch", "demo", "app", "push", "slurm"))
    assert 'src="../img/concepts.svg"' in (site / "concepts" / "index.html").read_text()
    assert (site / "img" / "plan-measured.png").is_file()
    assert "plan-measured.png" in (site / "guides" / "planning" / "index.html").read_text()

    broken = tmp_path / "broken"
    (broken / "docs").mkdir(parents=True)
    (broken / "docs" / "index.md").write_text("# Home\n\nSee [the other page](other.md#no-such-heading).\n")
    (broken / "docs" / "other.md").write_text("# Other\n")
    validation = re.search(r"(?m)^validation:\n(?:  .*\n)+", (REPO / "mkdocs.yml").read_text()).group(0)
    (broken / "mkdocs.yml").write_text(f"site_name: broken\n{validation}")
    refused = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=broken, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert refused.returncode != 0 and "no-such-heading" in refused.stderr, refused.stderr[-2000:]
