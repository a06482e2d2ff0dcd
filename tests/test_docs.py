"""The documentation: the README is a short front page whose links resolve, its Python example runs, and the site
(MkDocs Material, docs/ and mkdocs.yml) builds in strict mode with the pages generated from the code."""

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, accelerate_launch

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


@pytest.mark.process
def test_the_readmes_python_example_trains_two_replicas_under_accelerate_launch(tmp_path):
    """The README's Python block, as written, saved as a script and run with `accelerate launch` on two processes as
    the README says (every process a replica), its run shortened (4 steps, H = 2) and its folder in tmp: both
    replicas take part in each of the two syncs and the model is saved."""
    from hf_diloco.metrics import read_syncs

    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    out = tmp_path / "runs" / "my-run"
    shorter = {"inner_steps=50": "inner_steps=2", "max_steps=400": "max_steps=4", "eval_steps=50": "eval_steps=2",
               "block_size=256": "block_size=32", 'output_dir="runs/my-run"': f"output_dir={str(out)!r}"}
    assert all(setting in code for setting in shorter), "the example's settings are where the test expects them"
    for setting, short in shorter.items():
        code = code.replace(setting, short)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    result = accelerate_launch([str(script)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_syncs(out)
    assert [r["step"] for r in records] == [2, 4], records
    assert all([m["participated"] for m in r["replicas"]] == [True, True] for r in records), records
    assert (out / "model.safetensors").exists() or (out / "checkpoint-4").is_dir()


def test_the_guides_mixin_block_gives_diloco_to_a_trainer_of_ones_own(tmp_path):
    """docs/guides/your-model.md's DiLoCoMixin block, as written, with the names it leaves to the user bound to a
    Trainer subclass and a TrainingArguments subclass with a field of its own: the config has both argument sets
    (its own field's default stands), and the trainer trains as one replica, syncing at H = 2."""
    from dataclasses import dataclass, field

    import torch
    from transformers import Trainer, TrainingArguments, default_data_collator

    page = (REPO / "docs" / "guides" / "your-model.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "DiLoCoMixin" in block)

    @dataclass
    class MyTrainerConfig(TrainingArguments):
        temperature: float = field(default=0.5)

    class MyTrainer(Trainer):
        pass

    scope = {"MyTrainerConfig": MyTrainerConfig, "MyTrainer": MyTrainer}
    exec(compile(code, "your-model.md", "exec"), scope)
    args = scope["MyConfig"](output_dir=str(tmp_path), inner_steps=2, max_steps=4, per_device_train_batch_size=2,
                             save_strategy="no", save_every_rounds=0, report_to="none", disable_tqdm=True,
                             use_cpu=True)
    assert args.temperature == 0.5 and args.inner_steps == 2
    from helpers import tiny_llama

    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64} for _ in range(8)]
    trainer = scope["MyDiLoCoTrainer"](model=tiny_llama(), args=args, train_dataset=data,
                                       data_collator=default_data_collator)
    trainer.train()
    assert len((tmp_path / "syncs.jsonl").read_text().splitlines()) == 2


def test_every_python_block_of_the_docs_parses_and_imports_what_exists():
    """Every Python block of the README and the docs is run by a test: the README's and the DiLoCoMixin one here,
    the SFT and DPO ones as two replicas in tests/test_trl.py, the seq2seq and DiLoCoTrainer-task ones as two
    replicas in tests/test_tasks.py, the app's API client in tests/test_app.py. Here: each block parses, and every
    name it imports from hf_diloco exists (7 blocks at least)."""
    import ast
    import importlib

    blocks = [(page, code) for page in [README, *(REPO / "docs").rglob("*.md")]
              for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]
    assert len(blocks) >= 7
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
    called = ("load_model_and_tokenizer", "build_datasets", "build_task_datasets", "task_collator", "task_metrics",
              "DiLoCoSeq2SeqTrainer", "DiLoCoSeq2SeqConfig", "give_chat_template", "predict")
    assert all(f"{name} " in api for name in called), [n for n in called if f"{n} " not in api]
    assert "get_tp_size" not in api and "continue_at_step" not in api  # Trainer's hooks and internals stay out
    import html

    shown = " ".join(html.unescape(api).split())  # the page's text as a reader sees it
    assert "theta_local <- alpha*theta_local + (1-alpha)*theta_global" in shown  # no italics, no lost arrow
    assert "to <output_dir>/merged" in shown and "str | None" in shown  # a path in brackets, a union type
    reference = (site / "reference" / "cli" / "index.html").read_text()  # the same generated tables
    assert all(f"<code>{name}</code>" in reference for name in added), [n for n in added if n not in reference]
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


def test_the_troubleshooting_page_quotes_the_lines_the_code_prints():
    """Each line the troubleshooting page quotes (its `text` blocks, `<...>` standing for what varies) is one the
    code prints: rendered for real where that takes no process (the out-of-memory sentence), else every stretch of
    three or more words between the variable parts is in the source of hf_diloco/ and app/ (adjacent string
    literals joined; the words next to a variable part are left out, since the source spells them with it)."""
    from hf_diloco import DiLoCoConfig
    from hf_diloco.cli import out_of_memory

    page = (REPO / "docs" / "guides" / "troubleshooting.md").read_text()
    lines = [line for block in re.findall(r"```text\n(.*?)```", page, re.S) for line in block.splitlines()
             if line.strip()]
    assert len(lines) >= 10, lines
    source = "\n".join(path.read_text() for folder in ("hf_diloco", "app") for path in (REPO / folder).glob("*.py"))
    source = " ".join(re.sub(r"[\"']\s*\n\s*(?:rf|fr|f|r)?[\"']", "", source).split())
    rendered = [out_of_memory(DiLoCoConfig(output_dir="out", use_cpu=True), RuntimeError("CUDA out of memory."))]
    for line in lines:
        text = line.removeprefix("hf-diloco: error: ")
        segments = re.split(r"<[^>]+>", text)
        if any(re.fullmatch(".+".join(map(re.escape, segments)), r) for r in rendered):
            continue
        stretches = []
        for index, segment in enumerate(segments):
            words = segment.split()[1 if index > 0 else 0:]
            words = words[:-1] if index < len(segments) - 1 else words
            if len(words) >= 3:
                stretches.append(" ".join(words))
        assert stretches, line
        missing = [stretch for stretch in stretches if stretch not in source]
        assert not missing, (line, missing)


def test_every_extra_the_docs_install_is_one_the_package_declares():
    """`pip install -e '.[x,y]'` in the README and the docs names only extras pyproject.toml declares, and the
    README's install section names each extra a user installs (trl, ft, app)."""
    import tomllib

    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    pages = [README, *(REPO / "docs").rglob("*.md")]
    installs = [(page.name, group) for page in pages for group in re.findall(r"pip install -e '\.\[([^\]]+)\]'",
                                                                               page.read_text())]
    named = {(page, extra.strip()) for page, group in installs for extra in group.split(",")}
    assert named and not {extra for _, extra in named} - declared, named
    assert {"trl", "ft", "app"} <= {extra for page, extra in named if page == "README.md"}
