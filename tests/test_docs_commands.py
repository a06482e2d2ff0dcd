"""Every shell command the README and the docs show is run here, as a reader would type it in a clone of the
repository (a folder of its own under tmp, linking to the repository's files, beside the reader's own model folder
and JSONL), with what the reader fills in filled in (PLACEHOLDERS) and a run shortened to two steps (SHORT, after
the command's own flags):

- a run that fits this machine (`hf-diloco train`, `hf-diloco launch` of a CPU layout, `accelerate launch`) trains
  its two steps for real, to the end: exit 0, and every replica saved its model;
- a command that reports or checks (`plan`, `--help`, `launch --dry-run`) runs as written: exit 0;
- a launch that is one machine's part of a job across machines (`--machine_rank`, `--replica_id` with
  `--num_replicas`), whose other machines are not here, runs as a dry run (`--dry-run`: the launch's own check of
  the recipe, the layout, the data and the model, printing the command it would start);
- `hf-diloco slurm ... --submit` runs without `--submit` (this machine has no GPU partition; tests/test_slurm.py
  submits to a real Slurm cluster): it writes the batch script;
- `hf-diloco app` and `hf-diloco lighthouse` are servers: each is started, must print its address, and is stopped;
- `make <target>` runs as `make -n <target>` (what it would run: `make test` is the suite itself, and the demo it
  runs is run by tests/test_browser.py).

A block whose first line is `# fragment (not run by the tests): <why>` is the only exception, and says so to the
reader. A command that matches no rule fails the test, so a new one cannot go unrun. A `text` block right after
a block of commands shows what its first command prints: each of its lines (but those with `...`) must be in what
that command printed."""

from __future__ import annotations

import contextlib
import json
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, env, free_port

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```$", re.S | re.M)
FRAGMENT = "# fragment (not run by the tests): "
BIN = Path(sys.executable).parent
SHORT = ["--max_steps", "2", "--inner_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
         "--save_every_rounds", "0", "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]
PLACEHOLDERS = {  # what the reader puts in, and what stands for it here
    "recipes/X.yaml": "recipes/tiny-pretrain.yaml",
    "LIGHTHOUSE_ADDRESS": "127.0.0.1", "LIGHTHOUSE_HOST": "127.0.0.1", "THIS_MACHINE_ADDRESS": "127.0.0.1",
    "<first site's Lighthouse>": "127.0.0.1", "--replica_id k": "--replica_id 0",
}


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int  # where its block starts
    text: str  # continuations joined, comments dropped
    output: str | None  # the text block right after its block, if it is its block's first command

    @property
    def argv(self) -> list[str]:
        text = self.text
        for placeholder, value in PLACEHOLDERS.items():
            text = text.replace(placeholder, value)
        return shlex.split(text)


def blocks() -> list[tuple[str, int, str, str, str]]:
    """(page, line, language, body, what follows the block up to the next one) of every fenced block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        matches = list(FENCE.finditer(text))
        for index, match in enumerate(matches):
            after = text[match.end():matches[index + 1].start() if index + 1 < len(matches) else len(text)]
            found.append((str(page.relative_to(REPO)), text.count("\n", 0, match.start()) + 1, match.group(1),
                          match.group(2), after))
    return found


def commands() -> list[Command]:
    found = []
    every = blocks()
    for index, (page, line, language, body, after) in enumerate(every):
        if language != "bash" or body.startswith(FRAGMENT):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        texts = [t for t in (re.sub(r"(^|\s)#.*", "", raw).strip() for raw in joined.splitlines()) if t]
        following = every[index + 1] if index + 1 < len(every) else None
        output = following[3] if following and following[0] == page and following[2] == "text" \
            and not after.strip() else None
        found += [Command(page, line, " ".join(t.split()), output if i == 0 else None) for i, t in enumerate(texts)]
    once = {}  # a command two pages show runs once
    for command in found:
        once.setdefault(command.text, command)
    return list(once.values())


def test_every_block_names_its_language_and_every_fragment_says_why():
    """A block with no language could hide a command from the test below; a fragment gives its reason."""
    unnamed = [(page, line) for page, line, language, _body, _after in blocks() if not language]
    assert not unnamed, f"fenced blocks with no language (bash, python or text): {unnamed}"
    fragments = [body.splitlines()[0] for _page, _line, language, body, _after in blocks()
                 if language == "bash" and body.startswith(FRAGMENT)]
    assert all(len(line) > len(FRAGMENT) + 10 for line in fragments), fragments


def ran(clone: Path, argv: list[str], timeout: int = 420) -> str:
    """Run `argv` in the reader's clone; what it printed, after checking it exited 0."""
    result = subprocess.run(argv, cwd=clone, env=env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def served(clone: Path, argv: list[str], address: re.Pattern[str], timeout: float = 90) -> str:
    """Start a server, wait for its address on its output, stop it; what it printed."""
    process = subprocess.Popen(argv, cwd=clone, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    printed = []
    try:
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not address.search("".join(printed)):
            if selector.select(timeout=1) and (line := process.stdout.readline()):
                printed.append(line)
            elif process.poll() is not None:
                break
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
    text = "".join(printed)
    assert address.search(text), f"{shlex.join(argv)} printed no address:\n{text[-3000:]}"
    return text


def launch_flags(argv: list[str], flags: list[str]) -> list[str]:
    """`argv` with `flags` of its own (before a `--` that starts the flags for the run)."""
    at = argv.index("--") if "--" in argv else len(argv)
    return [*argv[:at], *flags, *argv[at:]]


def run_flags(argv: list[str], flags: list[str]) -> list[str]:
    """`argv` with `flags` for the run: after its `--`, adding one where it has none."""
    return [*argv, *flags] if "--" in argv else [*argv, "--", *flags]


def a_clone(tmp: Path, pretrained: Path) -> Path:
    """A reader's working copy: the repository's files (linked), the model folder and the JSONL the docs name (a
    text classifier's rows, labelled by name), and nothing of a run yet."""
    from hf_diloco.data import builtin_labelled_texts

    clone = tmp / "hf-diloco"
    clone.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".git", "runs", "site", "all-MiniLM-L6-v2", "my.jsonl"):
            (clone / entry.name).symlink_to(entry)
    (clone / "all-MiniLM-L6-v2").symlink_to(pretrained)
    (clone / "my.jsonl").write_text("".join(json.dumps({"text": text, "label": ["positive", "negative"][label]})
                                            + "\n" for text, label in builtin_labelled_texts()[:200]))
    return clone


def reports(argv: list[str]) -> list[str] | None:
    """The arguments of `hf-diloco` with which a command only reports or checks (it starts no process, so it runs
    inside the test's), or None for one that starts something."""
    if argv[0] != "hf-diloco":
        return None
    verb, across = argv[1], "--machine_rank" in argv or ("--replica_id" in argv and "--num_replicas" in argv)
    if verb == "slurm":
        return [a for a in argv[1:] if a != "--submit"]
    if across and "--dry-run" not in argv:
        return launch_flags(argv, ["--dry-run"])[1:]
    return argv[1:] if verb == "plan" or "--help" in argv or "--dry-run" in argv else None


def run_inside(clone: Path, args: list[str]) -> str:
    """`hf-diloco ARGS` run in this process (its own code path, hf_diloco.cli.main) from the reader's clone; what it
    printed, after checking it exited 0."""
    from hf_diloco.checker import run_inside

    with contextlib.chdir(clone):
        answer = run_inside(args, {"HF_HUB_OFFLINE": "1"})
    assert answer["returncode"] == 0, f"hf-diloco {shlex.join(args)} exited {answer['returncode']}:\n" \
        f"{answer['stderr'][-3000:]}"
    if args[0] == "slurm":
        assert list(clone.glob("runs/*/slurm/job.sbatch")), answer["stdout"]
    return answer["stdout"] + answer["stderr"]


def run_process(clone: Path, command: Command) -> str:
    """Run a command that starts something, by the rules of this module's docstring; what it printed."""
    argv = command.argv
    program, verb = argv[0], argv[1]
    if program == "make":
        printed = ran(clone, ["make", "-n", *argv[1:]])
        assert {"test": "-m pytest", "demo": "hf-diloco demo"}[verb] in printed, printed
        return printed
    if program == "accelerate":
        port = ["--main_process_port", str(free_port())]
        return saved(clone, ran(clone, [str(BIN / "accelerate"), verb, *port, *argv[2:], *SHORT]))
    assert program == "hf-diloco", f"{command.page}:{command.line}: no rule runs {command.text!r}"
    argv = [str(BIN / "hf-diloco"), *argv[1:]]
    if verb in ("app", "lighthouse"):
        shown = r"http://127\.0\.0\.1:\d+/\?key=" if verb == "app" else r"Lighthouse on 127\.0\.0\.1:\d+"
        return served(clone, [*argv, "--port", str(free_port())], re.compile(shown))
    if verb == "launch":
        return saved(clone, ran(clone, run_flags(launch_flags(argv, ["--port", str(free_port())]), SHORT)))
    assert verb == "train", f"{command.page}:{command.line}: no rule runs {command.text!r}"
    return saved(clone, ran(clone, [*argv, *SHORT]))


def saved(clone: Path, printed: str) -> str:
    """What a run printed, once it is seen to have saved its model under the clone's runs/."""
    models = list(clone.glob("runs/**/model.safetensors"))
    assert models, f"no model saved under runs/:\n{printed[-3000:]}"
    return printed


def shows_what_it_printed(command: Command, printed: str) -> None:
    if command.output:
        shown = [" ".join(line.split()) for line in command.output.splitlines() if line.strip()
                 and "..." not in line]
        said = " ".join(printed.split())
        missing = [line for line in shown if line not in said]
        assert not missing, f"{command.page}:{command.line}: the docs show lines it did not print: {missing}"


def name(command: Command) -> str:
    return f"{Path(command.page).stem}:{command.line}:{command.text[:60]}"


@pytest.mark.parametrize("command", [c for c in commands() if reports(c.argv)], ids=name)
def test_the_docs_command_that_reports_or_checks_runs(command, tmp_path, pretrained):
    shows_what_it_printed(command, run_inside(a_clone(tmp_path, pretrained), reports(command.argv)))


@pytest.mark.process
@pytest.mark.parametrize("command", [c for c in commands() if not reports(c.argv)], ids=name)
def test_the_docs_command_runs(command, tmp_path, pretrained):
    shows_what_it_printed(command, run_process(a_clone(tmp_path, pretrained), command))
