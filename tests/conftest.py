"""Runs that tests of several files read (each launched once per session, the first time a test asks for it), and
the two tiers.

The fast tier (`make test-fast`, `pytest -m "not process"`) is every test that starts no process; the rest carry
`@pytest.mark.process` (a launch, a server, a browser, a daemon). The marker is enforced: a test without it that
starts a process, in its body or in a fixture it sets up, fails with a sentence saying so.
"""

import contextlib
import hashlib
import importlib.util
import multiprocessing.process
import os
import subprocess
import uuid
import zipfile
from pathlib import Path

# Nothing in a test reaches the real Hub; commands run inside pytest (helpers.cli) read this as their processes do.
# huggingface_hub reads it once, when first imported: here, before any test module imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from helpers import ACCELERATE_CPU_2PROC, share, train_shared  # noqa: E402


class StartsAProcess(RuntimeError):
    """A test outside the process tier started a process."""


@contextlib.contextmanager
def processes_refused(item: pytest.Item):
    """Within the block, starting a process (subprocess, multiprocessing) raises StartsAProcess, unless `item` is
    marked `process`."""
    if item.get_closest_marker("process") is not None:
        yield
        return

    def refuse(*args, **kwargs):
        raise StartsAProcess(f"{item.nodeid} starts a process but is not marked @pytest.mark.process: mark it, so that "
                             f"the fast tier (make test-fast) leaves it out.")

    spawn, start = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start
    subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = refuse, refuse
    try:
        yield
    finally:
        subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = spawn, start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with processes_refused(item):  # fixtures too: a session fixture that launches a run is set up here
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with processes_refused(item):
        return (yield)


# Two replicas of one process with the paper's outer settings (SGD lr 0.7, momentum 0.9, Nesterov), H = 5, 12 steps:
# rounds end at 5, 10, 12; Trainer reports to TensorBoard. Every other field at its default, so a run of the same
# settings spelled otherwise must end with its bits. The first run of the session's shared launch: the collectives
# before its first step are the launch's own.
share("conftest", {"paper": {"inner_steps": 5, "max_steps": 12, "outer_lr": 0.7, "outer_momentum": 0.9,
                             "outer_nesterov": True, "report_to": "tensorboard"}}, first=True)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """`shared_runs(key, config)`: module `key`'s runs of the shared launch of `config` (tests/helpers.py share),
    name → (folder, every rank's record); the launch runs once, when first asked."""
    trained: dict[Path, dict] = {}

    def runs_of(key: str, config: Path = ACCELERATE_CPU_2PROC) -> dict[str, tuple[Path, list[dict]]]:
        if config not in trained:
            trained[config] = train_shared(tmp_path_factory.mktemp("shared"), config)
        return trained[config][key]

    return runs_of


@pytest.fixture(scope="session")
def paper_run(shared_runs):
    """The paper run above: (folder, every rank's record)."""
    return shared_runs("conftest")["paper"]


PRETRAINED_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
PRETRAINED_FILES = ("config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                    "tokenizer_config.json")


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 as a user has it: a model folder (config.json says BertModel: no task head) with its
    WordPiece tokenizer, taken from the wheel tests/pretrained-model.txt pins, its weights checked by checksum."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        pytest.fail("the pretrained test model is not installed: `make test` installs it (tests/pretrained-model.txt)")
    folder = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        for name in PRETRAINED_FILES:
            archive.extract(name, folder)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == PRETRAINED_WEIGHTS_SHA256, f"all-MiniLM-L6-v2's weights are not the pinned ones ({digest})"
    return folder


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
# The quota is enforced per period: a group with share s runs s x period, then waits (1 - s) x period. At the
# default 100 ms a quarter-core replica can be held 75 ms at the moment its budget is spent, which the others then
# wait for; a 10 ms period keeps that under 8 ms, as a slower machine would.
CFS_PERIOD_US = 10_000


MEMORY_CGROUP = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def cgroups(controller: Path, what: str, on_removal: dict[str, str] | None = None):
    """Yields make(settings) -> a new cgroup v1 folder under `controller` with `settings` ({file: value}) written;
    a process joins by writing its pid to the folder's cgroup.procs, and its children follow. Afterwards any process
    still in a folder moves back to the controller's root, `on_removal` is written, and the folder goes. Skips with
    one sentence where cgroups cannot be written (CI runs as root)."""
    made = []

    def make(settings: dict[str, str]) -> Path:
        folder = controller / f"hf-diloco-test-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()
            for name, value in settings.items():
                (folder / name).write_text(value)
        except OSError as error:
            pytest.skip(f"cgroups cannot be written here ({error.strerror}): {what} needs root and cgroup v1 "
                        f"{controller.name}.")
        made.append(folder)
        return folder

    try:
        yield make
    finally:
        for folder in made:
            for pid in (folder / "cgroup.procs").read_text().split():  # none once the processes have ended
                with contextlib.suppress(OSError):
                    (controller / "cgroup.procs").write_text(pid)
            for name, value in (on_removal or {}).items():
                with contextlib.suppress(OSError):
                    (folder / name).write_text(value)
            os.rmdir(folder)


@pytest.fixture
def memory_limit():
    """make(bytes) -> a cgroup v1 `memory` folder whose processes together may hold at most `bytes` (page cache
    included, reclaimed first; past the limit the kernel ends a process); see `cgroups`. The page cache it still
    holds at the end moves to the parent."""
    with cgroups(MEMORY_CGROUP, "a memory limit", {"memory.force_empty": "0"}) as make:
        yield lambda limit: make({"memory.limit_in_bytes": str(limit)})


def quotas():
    """make(share) -> a cgroup v1 `cpu` folder whose processes get `share` of one core (a real CPU quota: a slower
    replica); see `cgroups`."""
    with cgroups(CPU_CGROUP, "a CPU quota") as make:
        yield lambda share: make({"cpu.cfs_period_us": str(CFS_PERIOD_US),
                                  "cpu.cfs_quota_us": str(int(share * CFS_PERIOD_US))})


cpu_quota = pytest.fixture(quotas, name="cpu_quota")
cpu_quota_of_module = pytest.fixture(quotas, scope="module", name="cpu_quota_of_module")  # for a module's runs


def pytest_configure(config):
    """matplotlib lists the system's fonts with a process (fc-list) the first time it is imported on a machine: done
    here, before any test, so that a fast-tier test that draws a figure on a fresh machine starts no process."""
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture
def hostname_elsewhere(tmp_path):
    """A command prefix under which this machine's host name resolves to its non-loopback address (as on many cloud
    machines), not 127.0.0.1: a mount namespace with its own /etc/hosts (`unshare -m`). Skips with one sentence
    where a mount namespace cannot be made (CI runs as root)."""
    import shutil
    import socket
    import subprocess

    import psutil

    external = next((a.address for addresses in psutil.net_if_addrs().values() for a in addresses
                     if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{external} {socket.gethostname()}\n")
    prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh"]
    probe = subprocess.run([*prefix, "getent", "hosts", socket.gethostname()], capture_output=True, text=True) \
        if external and shutil.which("unshare") else None
    if probe is None or probe.returncode != 0 or external not in probe.stdout:
        pytest.skip("a mount namespace cannot be made here (unshare -m needs root): the host name cannot be mapped "
                    "to another address.")
    return prefix
