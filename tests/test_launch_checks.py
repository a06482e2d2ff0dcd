"""`hf-diloco launch` on bad input and with a Hub token, as a user runs it.

What a dry run can check (data, model, LoRA targets, H against max_steps) is checked once by the launcher, before any
process starts, on either backend; bad input only a worker can find ends the launch with the worker's sentence once,
exit status 2, no torchelastic traceback and no restart; a Hub token never shows in what the launch prints or
writes, while the processes it runs get it.
"""

import json
import subprocess
import sys
import time

import psutil
import pytest
from helpers import REPO, ListenerWatch, cli, env, free_port, hf_diloco, is_launcher

TOKEN = "hf_PlantedToken1234567890abcdef"
TINY = str(REPO / "recipes" / "tiny-pretrain.yaml")
CPU_2PROC = str(REPO / "accelerate_configs" / "cpu-2proc.yaml")
BACKENDS = {
    "torch": [TINY, "--accelerate-config", CPU_2PROC],
    "torchft --replicas 2": [str(REPO / "recipes" / "torchft-3.yaml"), "--accelerate-config",
                             str(REPO / "accelerate_configs" / "torchft-replica.yaml"), "--replicas", "2"],
}
# Small, quick runs of the tiny recipe: a round of 1 step, each saved (checkpoints hold training_args.bin).
SHORT = ["--max_steps", "2", "--inner_steps", "1", "--block_size", "32", "--per_device_train_batch_size", "2",
         "--eval_strategy", "no", "--eval_on_start", "false", "--logging_steps", "1"]


def one_sentence(result) -> str:
    """The launch's only output: one `hf-diloco: error:` line on stderr and nothing on stdout, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-diloco: error: "), result.stderr[-3000:]
    return lines[0]


@pytest.fixture
def bad_inputs(tmp_path):
    """Each bad input as (recipe or None for the backend's own, flags, words its sentence holds)."""
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text("\n".join(json.dumps({"content": f"line {i}"}) for i in range(5)))
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    return {
        "missing dataset file": (None, ["--dataset_name", str(tmp_path / "absent.txt")], ["does not exist"]),
        "no text column": (None, ["--dataset_name", str(no_text)], ["no text column 'text'", "content"]),
        "LoRA target absent": (str(REPO / "recipes" / "lora-finetune.yaml"),
                               ["--model_name_or_path", "tiny-llama", "--lora_target_modules", "q_proj,nope_proj"],
                               ["cannot add LoRA adapters", "nope_proj"]),
        "unloadable model": (None, ["--model_name_or_path", str(not_a_model)], ["could not load model"]),
    }


CASES = [("torch", case) for case in ("missing dataset file", "no text column", "LoRA target absent",
                                      "unloadable model")] \
    + [("torchft --replicas 2", "missing dataset file")]


@pytest.mark.parametrize("backend,case", CASES)
def test_launch_refuses_what_a_dry_run_refuses_before_starting_any_process(tmp_path, bad_inputs, backend, case):
    """Exit 2 and the sentence alone, once; the launcher printed no command (it prints one just before starting
    it) and nothing was written. (The checks are the same code on both backends: the torchft path is shown with
    one of them.)"""
    recipe, flags, words = bad_inputs[case]
    launch = BACKENDS[backend] if recipe is None else [recipe, *BACKENDS[backend][1:]]
    out = tmp_path / "out"
    result = cli("launch", *launch, "--max-restarts", "2", "--", "--output_dir", str(out), *flags)
    assert result.returncode == 2, result.stderr[-3000:]
    sentence = one_sentence(result)
    assert all(word in sentence for word in words), sentence
    assert result.stdout == "" and not out.exists(), "no process was started"


@pytest.mark.process
def test_bad_input_only_the_workers_find_ends_the_launch_once_without_a_restart(tmp_path):
    """A corpus shorter than one block is found only once the workers tokenize it. Both workers hand the sentence to
    the launcher, which says it once and ends with 2: no torchelastic traceback, and no restart although
    --max-restarts allows one (the same input would fail the same way)."""
    short = tmp_path / "short.txt"
    short.write_text("hello world\n")
    result = hf_diloco("launch", TINY, "--accelerate-config", CPU_2PROC, "--port", str(free_port()),
                       "--max-restarts", "1", "--", "--output_dir", str(tmp_path / "out"), "--dataset_name",
                       str(short), *SHORT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "ChildFailedError" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    # What the workers printed before they found it (the data's progress bars) stays; the sentence comes once, last.
    sentence = f"hf-diloco: error: dataset {str(short)!r} has fewer than 32 tokens of text."
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == sentence and result.stderr.count("hf-diloco: error:") == 1, result.stderr[-3000:]
    assert "restart" not in result.stdout, result.stdout


FAKE_WORKER = ("import sys; from hf_diloco.launch import report_input_error; report_input_error(sys.argv[1]); "
               "sys.stderr.write('Traceback (most recent call last):\\n  torchelastic says it again\\n'); "
               "sys.exit(1)")


@pytest.mark.process
def test_a_replica_ending_on_bad_input_is_not_started_again_and_its_sentence_ends_the_run(tmp_path, capfd):
    """ReplicaSupervisor (`launch --replicas N`) with launches whose worker hands over a sentence and whose launcher
    then fails with a traceback, as accelerate's does: neither is started again though restarts are allowed, what
    follows the sentence on stderr is not passed on, and with no replica finished the run ends with the sentence.
    With another replica that finishes, the run succeeds as before."""
    from hf_diloco.errors import ConfigError
    from hf_diloco.launch import ReplicaSupervisor

    bad = [sys.executable, "-c", FAKE_WORKER, "the dataset is too short."]
    with pytest.raises(ConfigError, match=r"^the dataset is too short\.$"):
        ReplicaSupervisor([bad, bad], str(tmp_path / "all"), max_restarts=3).run()
    states = json.loads((tmp_path / "all" / "replicas.json").read_text())
    assert [(s["state"], s["restarts"], s["exit_code"]) for s in states] == [("exited", 0, 2)] * 2
    assert "torchelastic says it again" not in capfd.readouterr().err

    finish = [sys.executable, "-c", "pass"]
    assert ReplicaSupervisor([finish, bad], str(tmp_path / "one"), max_restarts=3).run() == 0


@pytest.mark.process
def test_a_launch_passes_stderr_on_with_the_token_hidden(tmp_path, capfd):
    """What a launch's processes write to stderr reaches ours, but the token of its command (as a traceback that
    quotes it would print it) reads `***`; the process itself got the real value, in its environment, and a
    command line without it."""
    from hf_diloco.launch import Launch

    echo = ("import os, sys; print(os.environ['HF_DILOCO_HUB_TOKEN']); "
            "sys.stderr.write(f'failed: {sys.argv} {os.environ[\"HF_DILOCO_HUB_TOKEN\"]}\\n')")
    assert Launch([sys.executable, "-c", echo, "--hub_token", TOKEN, "--x"]).wait() == 0
    out, err = capfd.readouterr()
    assert out.strip() == TOKEN, "the process gets the token"
    assert "failed: ['-c', '--x'] ***" in err and TOKEN not in err, err


def files_holding(folder, secret: str) -> list[str]:
    return [str(path) for path in folder.rglob("*") if path.is_file() and secret.encode() in path.read_bytes()]


def test_a_torchft_dry_run_shows_each_replica_s_command_with_the_token_hidden(tmp_path):
    """Both spellings of the flag: every replica's printed command carries `***` where the token was (the torch
    backend's one command is shown by the real run below)."""
    result = cli("launch", *BACKENDS["torchft --replicas 2"], "--dry-run", "--", "--output_dir",
                       str(tmp_path / "out"), "--hub_token", TOKEN, f"--hub-token={TOKEN}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert TOKEN not in result.stdout + result.stderr
    commands = [line for line in result.stdout.splitlines() if "hf_diloco.accelerate_launch" in line]
    assert len(commands) == 2 and all("--hub_token *** --hub-token=***" in line for line in commands), \
        result.stdout


@pytest.mark.process
@pytest.mark.parametrize("hostname", ["loopback", "elsewhere"])
def test_a_launch_given_a_hub_token_leaves_it_nowhere_and_listens_on_loopback_only(tmp_path, request, hostname):
    """A real two-process run of the torch backend (cpu-2proc.yaml) given a token in both spellings (push_to_hub
    off: nothing is sent anywhere): the printed command shows `***`; the token is in no byte the launch printed and
    no file of its output folder (training_args.bin, in the model's folder and every checkpoint, is a pickle of the
    arguments), while its training processes were handed it in their environment (HF_DILOCO_HUB_TOKEN), and no
    process of the launch had it on its command line, which every user of the machine can read.

    Its listeners, read with psutil every 0.1 s while it runs: every one of every process (torchrun's rendezvous
    store in the launcher, gloo in each training process) is on 127.0.0.1 and refuses a connection to this
    machine's external address; the store is among them (under plain `accelerate launch` it binds every
    interface). `elsewhere`: the machine's host name resolves to its LAN address, as on many cloud machines (where
    gloo, left to itself, binds that address); the one-machine run's gloo still listens on loopback."""
    out = tmp_path / "out"
    prefix = request.getfixturevalue("hostname_elsewhere") if hostname == "elsewhere" else []
    command = [*prefix, sys.executable, "-m", "hf_diloco.cli", "launch", TINY, "--accelerate-config", CPU_2PROC,
               "--port",
               str(free_port()), "--", "--output_dir", str(out), *SHORT, "--hub_token", TOKEN, f"--hub-token={TOKEN}"]
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    listeners = ListenerWatch(launch)
    given, on_a_command_line = False, False
    while launch.poll() is None:
        for process in psutil.Process(launch.pid).children(recursive=True):
            try:
                argv, environment = process.cmdline(), process.environ()
            except psutil.Error:
                continue
            on_a_command_line |= any(TOKEN in word for word in argv)
            given |= "train" in argv and not is_launcher(argv) and environment.get("HF_DILOCO_HUB_TOKEN") == TOKEN
        time.sleep(0.1)
    stdout, stderr = launch.communicate(timeout=300)
    assert launch.returncode == 0, stderr[-3000:]
    assert given, "a training process was handed the token in its environment"
    assert not on_a_command_line, "no process of the launch had the token on its command line (ps shows those)"
    assert "--hub_token *** --hub-token=***" in stdout and TOKEN not in stdout + stderr
    assert (out / "training_args.bin").is_file() and any(out.glob("checkpoint-*/training_args.bin"))
    assert files_holding(out, TOKEN) == []
    addresses, ports, reachable = listeners.result()
    assert addresses == {"127.0.0.1"}, addresses
    assert reachable and not any(reachable.values()), reachable
    assert len(ports) == 2 and all(ports.values()), ports  # gloo in each training process
    assert set(reachable) - set().union(*ports.values()), "the launcher's rendezvous store"


def test_conversations_and_trls_formats_pass_the_launch_check_that_training_passes(tmp_path):
    """The one check of a dataset (data.check_dataset) that a launch, its dry run and the app's preview make
    accepts what training accepts: a `messages` column of turns for a causal LM (rendered by the chat template),
    TRL SFT's prompt and completion, DPO's preference pairs; and refuses a TRL trainer's data with none of its
    columns in one sentence naming them."""
    def jsonl(name: str, row: dict):
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for _ in range(4)))
        return str(path)

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chats = jsonl("chats.jsonl", {"messages": turns})
    pairs = jsonl("pairs.jsonl", {"prompt": "say hi", "completion": "hi"})
    preferences = jsonl("preferences.jsonl", {"prompt": "say hi", "chosen": "hi", "rejected": "no"})
    for recipe, data in [("tiny-pretrain", chats), ("sft-lora", chats), ("sft-lora", pairs),
                         ("dpo-lora", preferences)]:
        result = cli("launch", f"recipes/{recipe}.yaml", "--accelerate-config", "accelerate_configs/cpu-2proc.yaml",
                     "--dry-run", "--", "--dataset_name", data)
        assert result.returncode == 0, (recipe, data, result.stderr[-2000:])
    result = cli("launch", "recipes/dpo-lora.yaml", "--accelerate-config", "accelerate_configs/cpu-2proc.yaml",
                 "--dry-run", "--", "--dataset_name", pairs)
    assert one_sentence(result) == (f"hf-diloco: error: trainer dpo reads the columns prompt and chosen and rejected "
                                    f"or chosen and rejected of its dataset, and {pairs!r} has none of those (it has "
                                    f"prompt, completion).")


def test_a_worker_takes_the_hub_token_its_launch_hands_it_in_the_environment(monkeypatch):
    """What a worker of a launch given --hub_token parses (the launch moves the token into HF_DILOCO_HUB_TOKEN):
    config.hub_token is the token; a --hub_token on the worker's own command line still wins."""
    from hf_diloco.recipes import parse_train_args

    monkeypatch.setenv("HF_DILOCO_HUB_TOKEN", TOKEN)
    assert parse_train_args(TINY, [])[1].hub_token == TOKEN
    assert parse_train_args(TINY, ["--hub_token", "hf_" + "b" * 30])[1].hub_token == "hf_" + "b" * 30
    monkeypatch.delenv("HF_DILOCO_HUB_TOKEN")
    assert parse_train_args(TINY, [])[1].hub_token is None
