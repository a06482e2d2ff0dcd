"""Start the real app server for tests, on a free port, with its own runs folder."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request

from helpers import REPO, env, free_port

TINY_YAML = (REPO / "recipes" / "tiny-pretrain.yaml").read_text().replace("block_size: 256", "block_size: 64") \
    .replace("eval_on_start: true", "eval_on_start: false").replace("eval_strategy: steps", "eval_strategy: \"no\"")
# torchft-3 (outer_backend torchft) small enough that 40 steps of 2 replicas take seconds on 2 CPU cores.
TORCHFT_YAML = (REPO / "recipes" / "torchft-3.yaml").read_text().replace("block_size: 256", "block_size: 32") \
    .replace("per_device_train_batch_size: 8", "per_device_train_batch_size: 4") \
    .replace("eval_strategy: steps", "eval_strategy: \"no\"")


# The app's key for the servers tests start (HF_DILOCO_APP_KEY): tests send it as a program would (`connect`) or
# open the page through the link with it (`keyed`), as the user does.
APP_KEY = "test-key-5c1e0d9a"


def connect(url: str, **kwargs):
    """gradio_client for the app at `url`, sending its key (app.guard.KeyAuth)."""
    from gradio_client import Client

    sys.path.insert(0, str(REPO))
    from app.guard import KeyAuth

    return Client(url, verbose=False, httpx_kwargs={"auth": KeyAuth(APP_KEY)}, **kwargs)


def keyed(url: str) -> str:
    """The link `hf-diloco app` prints: the page's address with the key."""
    return f"{url}?key={APP_KEY}"


@contextlib.contextmanager
def app_server(runs_dir, extra_env: dict | None = None, args: tuple = ()):
    port = free_port()
    command = [sys.executable, "-m", "hf_diloco.cli", "app", "--port", str(port), "--runs-dir", str(runs_dir), *args]
    process = subprocess.Popen(command, cwd=REPO, env={**env(), "HF_DILOCO_APP_KEY": APP_KEY, **(extra_env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(url, headers={"X-HF-Diloco-Key": APP_KEY}), timeout=2)
                break
            except OSError:
                if process.poll() is not None or time.time() > deadline:
                    raise AssertionError(f"app did not start:\n{process.stdout.read()[-3000:]}") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        end_runs(runs_dir)


def end_runs(runs_dir) -> None:
    """Kill what is left of the runs under `runs_dir` (runs outlive the app by design; a test's must not)."""
    import os
    import signal

    from hf_diloco import runs

    for run in runs.list_runs(runs_dir):
        if run.status in runs.ACTIVE and run.supervisor_pid:
            for pid in [run.supervisor_pid, *runs._descendants(run.supervisor_pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def table(value) -> dict:
    """A Dataframe's {"headers", "data"} from what gradio_client returns for it (a value, or an update holding one)."""
    return value["value"] if "value" in value else value


def knobs(**values) -> list[str]:
    """The form's knob values in the order of app.forms.Knobs."""
    sys.path.insert(0, str(REPO))
    from dataclasses import fields

    from app.forms import Knobs

    return [str(values.get(f.name, "")) for f in fields(Knobs)]
