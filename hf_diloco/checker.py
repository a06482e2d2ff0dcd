"""Commands that start nothing, run inside a process that stays up: the app's form checks.

The app checks a form with the command line's own code (`hf-diloco launch ... --dry-run`, `hf-diloco plan`), and
that code imports torch and transformers: about ten seconds of CPU that a new process would pay on every Preview.
`python -m hf_diloco.checker` pays them once. It reads one JSON list of arguments per line on stdin and answers each
with one line on stdout: `MARK` followed by a JSON object {"returncode", "stdout", "stderr"}, as the command's own
process would have ended. Lines without `MARK` are not answers (a library may print). Nothing received is
unpickled, and only a launch's dry run and the planner are run: any other command is refused without running.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

MARK = "hf-diloco-checker-answer: "


def run_inside(args: list[str], environ: dict[str, str] | None = None) -> dict:
    """`hf-diloco ARGS` run in this process, with `environ` added to the environment for its duration: its exit
    status and what it printed, as {"returncode", "stdout", "stderr"}. The environment is put back afterwards, and
    a command that would replace the process (os.execve) fails instead."""
    from .cli import main

    def replaced(*_args, **_kwargs):
        raise RuntimeError("this command replaces its process; it cannot run inside another")

    out, err = io.StringIO(), io.StringIO()
    saved, execve = dict(os.environ), os.execve
    os.environ.update(environ or {})
    os.execve = replaced
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse's refusals
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
    finally:
        os.execve = execve
        os.environ.clear()
        os.environ.update(saved)
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def starts_nothing(args: object) -> bool:
    """Whether `args` is a command this process may run: a list of strings that asks for a launch's dry run or a
    plan."""
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        return False
    if args[0] == "plan":
        return True
    before_fields = args[:args.index("--")] if "--" in args else args
    return args[0] == "launch" and "--dry-run" in before_fields


def serve(requests=None, answers=None) -> int:
    """Answer each request line of `requests` (stdin) on `answers` (stdout) until the input ends."""
    requests, answers = requests or sys.stdin, answers or sys.stdout
    for line in requests:
        try:
            args = json.loads(line)
        except ValueError:
            args = None
        if starts_nothing(args):
            answer = run_inside(args)
        else:
            answer = {"returncode": 2, "stdout": "",
                      "stderr": "hf-diloco: error: the checker runs only `launch ... --dry-run` and `plan`.\n"}
        answers.write(MARK + json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
