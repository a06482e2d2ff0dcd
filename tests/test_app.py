"""The app as a real server, driven by gradio_client: launch, watch rounds, stop, push; bad input refused."""

import json
import re
import subprocess
import sys
import time
from dataclasses import fields

import pytest
from app_helpers import APP_KEY, TINY_YAML, app_server, connect, knobs, table
from helpers import REPO, cli, env
from hub_server import FakeHub

from hf_diloco import runs


@pytest.mark.process
def test_sharded_and_trl_recipes_preview_the_one_launch_start_runs(form_app):
    """Recipe fsdp-replicas with accelerate_configs/cpu-fsdp-2x2.yaml and 2 replicas, and recipe sft-lora (trainer:
    sft, TRL's SFTTrainer, its max_length field in the recipe) with cpu-2proc: Preview checks each form with the
    CLI's own dry run and shows one launch, of 2 x 2 processes (replicas x the recipe's replica_group_size) for the
    sharded one. The task picker turns the pre-training recipe into a seq2seq run of tiny-t5 (--task seq2seq). Their
    runs, records and cards are tested from the CLI (tests/test_sharded.py, tests/test_trl.py), and the app
    reads every run's records alike (tests/test_app_views.py)."""
    sharded = (REPO / "recipes" / "fsdp-replicas.yaml").read_text().replace("block_size: 256", "block_size: 32")
    sft = (REPO / "recipes" / "sft-lora.yaml").read_text()
    client = connect(form_app[0])
    form = ["", "fsdp-replicas.yaml", sharded, "cpu-fsdp-2x2.yaml", *knobs(replicas=2, inner_steps=10, max_steps=20)]
    command, message = client.predict(*form, api_name="/preview")
    assert "Form is valid" in message, message
    assert "accelerate_configs/cpu-fsdp-2x2.yaml" in command and " --num_processes 4 " in command, command
    form = ["", "sft-lora.yaml", sft, "cpu-2proc.yaml", *knobs(replicas=2, inner_steps=2, max_steps=4)]
    command, message = client.predict(*form, api_name="/preview")
    assert "Form is valid" in message, message
    assert " --num_processes 2 " in command and " --max_steps 4 " in command, command
    # The trainer picker: the DDP baseline of the same SFT recipe (TRL's trainer kept, tests/test_trl.py).
    form = ["", "sft-lora.yaml", sft, "cpu-2proc.yaml", *knobs(trainer="ddp", max_steps=4)]
    command, message = client.predict(*form, api_name="/preview")
    assert "Form is valid" in message, message
    assert " --max_steps 4 --trainer ddp" in command + " ", command
    # The task picker: another task from the pre-training recipe, with that task's preset.
    form = ["", "tiny-pretrain.yaml", "", "cpu-2proc.yaml", *knobs(task="seq2seq", model_name_or_path="tiny-t5")]
    command, message = client.predict(*form, api_name="/preview")
    assert "Form is valid" in message, message
    assert " --model_name_or_path tiny-t5 --task seq2seq " in command + " ", command


BAD_FORMS = {
    "no recipe": (["", "cpu-2proc.yaml", knobs()], "choose a recipe"),
    "H = 0": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(inner_steps=0)],
              "inner_steps (H) must be a whole number of at least 1, got 0."),
    "momentum 1": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(outer_momentum=1)],
                   "outer_momentum must be in [0, 1), got 1.0."),
    "H = abc": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(inner_steps="abc")], "must be a whole number"),
    "max steps -5": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(max_steps=-5)], "max steps must be at least 1"),
    "every interface as the rendezvous": (["tiny-pretrain.yaml", "multi-node.yaml",
                                           knobs(num_machines=2, main_process_ip="0.0.0.0")],
                                          "one machine's name or IP address, got '0.0.0.0'"),
    "a LAN address on one machine": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(main_process_ip="192.0.2.7")],
                                     "a run on one machine meets on loopback"),
    "rank 5 of 2": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(num_machines=2, machine_rank=5)],
                    "rank must be below the number of machines"),
    "outside folders": (["/etc/hostname", "cpu-2proc.yaml", knobs()], "is not a file in"),
    "bad replicas": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(replicas="two")], "whole number"),
    "restarts on the torch backend": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(restarts=2)],
                                      "restarts apply to torchft runs"),
    "negative restarts": (["torchft-3.yaml", "torchft-replica.yaml", knobs(restarts=-1)],
                          "restarts must be at least 0"),
    "missing model": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(model_name_or_path="models/missing-model")],
                      "'models/missing-model' is neither a local path"),
    "not a model": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(model_name_or_path="README.md")],
                    "is not a model folder"),
    "a model outside the data folders": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(model_name_or_path="/etc")],
                                         "model path '/etc' lies outside the folders the app reads data from"),
    "climbs out": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(model_name_or_path="../../no-such-model")],
                   "model path '../../no-such-model' does not exist"),
    "missing dataset": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(dataset_name="data/nothing.txt")],
                        "dataset path 'data/nothing.txt' does not exist"),
    "not a dataset": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(dataset_name="README.md")],
                      "dataset path 'README.md' is not a dataset"),
    "a dataset outside the data folders": (["tiny-pretrain.yaml", "cpu-2proc.yaml",
                                            knobs(dataset_name="/etc/passwd")],
                                           "dataset path '/etc/passwd' lies outside the folders the app reads data "
                                           "from"),
    # Launch flags are checked with the config they go beside, as every worker of the launch would.
    "rank 3 of the config's 2 machines": (["tiny-pretrain.yaml", "multi-node.yaml", knobs(machine_rank=3)],
                                          "rank 3, but there are only 2 machine(s)"),
    "3 processes over 2 machines": (["tiny-pretrain.yaml", "cpu-2proc.yaml",
                                     knobs(replicas=3, num_machines=2, machine_rank=1)],
                                    "spreads 3 processes over 2 machines"),
    "torchft over machines": (["torchft-3.yaml", "torchft-replica.yaml", knobs(num_machines=2, machine_rank=1)],
                              "the distributed settings (machines, this machine's rank) do not apply to a torchft run"),
    "torchft below its quorum": (["torchft-3.yaml", "torchft-replica.yaml", knobs(replicas=1)],
                                 "replicas = 1 is below the recipe's min_replicas = 2"),
    "a task the model does not do": (["tiny-pretrain.yaml", "cpu-2proc.yaml", knobs(task="seq2seq")],
                                     "preset 'tiny-llama' is a causal language model; task seq2seq starts from "
                                     "preset 'tiny-t5'"),
}


@pytest.fixture(scope="module")
def form_app(tmp_path_factory):
    """One app server for the tests of the form that start no run: (its URL, its runs folder). Each test checks
    that nothing but drafts was written there."""
    runs_dir = tmp_path_factory.mktemp("form-app") / "runs"
    with app_server(runs_dir) as url:
        yield url, runs_dir


def ask(url: str, path: str = "", method: str = "GET", **headers) -> tuple[int, dict, str]:
    """(status, headers, body) of one plain HTTP request to the app, redirects not followed."""
    import urllib.error
    import urllib.request

    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    request = urllib.request.Request(url + path, method=method, headers=headers,
                                     data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.build_opener(Stay).open(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, dict(refused.headers), refused.read().decode()


@pytest.mark.process
def test_the_app_answers_only_requests_that_hold_its_key_and_name_its_host(form_app):
    """Reaching the port is not enough, on loopback too: without the app's key the page, the API's list and a push
    get 401 and a page that says where the key is; the key file is the user's alone. With the key, a Host or Origin
    of another site (a page that rebound its own name to 127.0.0.1) gets 403. The printed link sets the cookie and
    sends the browser to the page without the key in its address; the cookie alone then opens the page."""
    url, runs_dir = form_app
    key_file = runs_dir / f".app-{url.rsplit(':', 1)[1].strip('/')}.key"
    assert key_file.read_text().strip() == APP_KEY and key_file.stat().st_mode & 0o077 == 0
    for path, method in (("", "GET"), ("gradio_api/info", "GET"), ("gradio_api/call/push", "POST")):
        status, _, body = ask(url, path, method)
        assert status == 401 and "needs its key" in body and str(key_file) in body, (path, status, body)
    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    with pytest.raises(AuthenticationError):
        Client(url, verbose=False)
    key = {"X-HF-Diloco-Key": APP_KEY}
    assert ask(url, "gradio_api/info", **key)[0] == 200
    assert ask(url, "gradio_api/info", **{"X-HF-Diloco-Key": APP_KEY[:-1] + "x"})[0] == 401
    status, _, body = ask(url, "gradio_api/info", **key, Host="evil.example:7860")
    assert status == 403 and "'evil.example'" in body
    assert ask(url, "gradio_api/info", **key, Host="localhost")[0] == 200
    assert ask(url, "gradio_api/info", **key, Origin="http://evil.example")[0] == 403
    assert ask(url, "gradio_api/info", **key, Origin=url.rstrip("/"))[0] == 200
    # The app guide's gradio_client example, pointed at this server, gets the API in.
    guide = (REPO / "docs" / "guides" / "app.md").read_text()
    example = re.search(r"```python\n(from gradio_client.*?)```", guide, re.S).group(1)
    scope: dict = {}
    exec(example.replace("http://127.0.0.1:7860/", url).replace("runs/.app-7860.key", str(key_file)), scope)
    assert "/preview" in scope["client"].view_api(print_info=False, return_format="dict")["named_endpoints"]
    status, headers, _ = ask(url, f"?key={APP_KEY}")
    assert status == 303 and headers["location"] == "/", headers
    cookie = headers["set-cookie"].split(";")[0]
    assert "HttpOnly" in headers["set-cookie"] and "SameSite=Strict" in headers["set-cookie"]
    status, _, page = ask(url, Cookie=cookie)
    assert status == 200 and "<title>hf-diloco app: refused" not in page


@pytest.mark.process
def test_bad_form_input_gets_one_sentence_from_preview_and_start_and_starts_nothing(form_app):
    """Every knob is checked: Preview never calls a form valid that Start would run into an error, and the
    message is one sentence, not a usage dump."""
    url, runs_dir = form_app
    client = connect(url)
    for case, ((recipe, config, values), words) in BAD_FORMS.items():
        form = ["", recipe, "", config, *values]
        previewed = client.predict(*form, api_name="/preview")[1]
        started = client.predict(*form, api_name="/start")[0]
        for message in (previewed, started):
            assert message.startswith("**Cannot start:**") and words in message, (case, message)
            assert "usage:" not in message and message.count("\n") == 0, (case, message)
    assert [p.name for p in runs_dir.iterdir() if p.name != "drafts" and not p.name.endswith(".key")] == []


@pytest.mark.process
def test_preview_predicts_each_round_over_the_link_as_hf_diloco_plan_does(tmp_path, form_app):
    """With a link typed in, Preview shows what `hf-diloco plan --json` predicts for the form's recipe, replicas and
    H (every row's utilisation and bytes as the CLI computes them, and its recommendation); a link of 0 is refused
    in the planner's sentence, and a blank link predicts nothing."""
    recipe = tmp_path / "recipe.yaml"  # the form's recipe text, as the app saves it
    recipe.write_text(TINY_YAML)
    planned = cli("plan", str(recipe), "--replicas", "3", "--link", "10mbit", "--tokens-per-second", "15000",
                  "--inner-steps", "20", "--json")
    expected = json.loads(planned.stdout)
    client = connect(form_app[0])
    form = ["tiny-pretrain.yaml", TINY_YAML, "cpu-2proc.yaml"]
    shown = client.predict(*form, "10mbit", "", "15000", *knobs(replicas=3, inner_steps=20), api_name="/predict")
    refused = client.predict(*form, "0mbit", "", "15000", *knobs(), api_name="/predict")
    blank = client.predict(*form, "", "", "15000", *knobs(), api_name="/predict")
    assert shown.startswith("**Predicted** for 3 replica(s) over 10 Mbit/s with 25 ms a hop"), shown
    for row in expected["rows"]:
        assert (f"| {row['bytes_per_replica_per_round'] / 1e6:,.2f} | {row['wire_seconds']:.2f} | "
                f"{row['blocked_seconds']:.2f} | {100 * row['utilisation']:.1f}% |") in shown, (row, shown)
    best = expected["recommendation"]
    assert f"**Recommended:** H = {best['inner_steps']}, codec {best['codec']}" in shown
    assert refused.startswith("**Cannot plan:** ") and "link" in refused and "Traceback" not in refused, refused
    assert blank == ""


@pytest.mark.process
def test_preview_asks_the_hub_about_an_id_that_is_not_a_local_path(tmp_path):
    """Online, a model or dataset id that is no local path must exist on the Hub (here: the local stand-in that
    speaks the Hub's repo-info endpoint) before Preview calls the form valid; an unreachable Hub leaves it to the
    run."""
    check = ("import sys; from app import forms\n"
             "for what, value in (('model', 'alice/tiny'), ('model', 'alice/missing'), ('dataset', 'bob/missing')):\n"
             "    try:\n"
             "        forms.check_source(value, what, (), ())\n"
             "        print(what, value, 'ok')\n"
             "    except forms.FormError as error:\n"
             "        print(what, value, 'refused:', error)\n")
    outcomes = {}
    with FakeHub() as hub:
        hub.repos["alice/tiny"] = {}
        for endpoint in (hub.url, "http://127.0.0.1:9"):  # port 9: nothing listens, the Hub cannot be reached
            result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO,
                                    env={**env(), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint,
                                         "HF_HOME": str(tmp_path)}, timeout=120)
            assert result.returncode == 0, result.stderr[-2000:]
            outcomes[endpoint] = result.stdout.splitlines()
    assert outcomes[hub.url] == [
        "model alice/tiny ok",
        "model alice/missing refused: model 'alice/missing' is neither a local path nor a public repository on the "
        "Hugging Face Hub; give an existing path or a Hub id.",
        "dataset bob/missing refused: dataset 'bob/missing' is neither a local path nor a public repository on the "
        "Hugging Face Hub; give an existing path or a Hub id.",
    ]
    assert outcomes["http://127.0.0.1:9"] == ["model alice/tiny ok", "model alice/missing ok", "dataset bob/missing ok"]


@pytest.mark.process
def test_bad_push_input_gets_a_message(tmp_path, monkeypatch):
    """A finished run (a saved model of one tensor) pushed with a repo id that is not one, then with no token: a
    sentence for each, and the run is left as it was."""
    import numpy as np
    from safetensors.numpy import save_file

    runs_dir = tmp_path / "runs"
    folder = runs_dir / "done"
    folder.mkdir(parents=True)
    (folder / "output").mkdir()
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(folder / "output" / "model.safetensors"))
    runs._write(folder, runs.Run("done", "r.yaml", "c.yaml", [], ["true"], str(folder / "output"), status="finished"))
    with app_server(runs_dir, {"HOME": str(tmp_path), "HF_TOKEN": ""}) as url:
        client = connect(url)
        spaces = client.predict("done", "my model", False, "hf_x", False, "", api_name="/push")[0]
        no_token = client.predict("done", "alice/model", False, "", False, "", api_name="/push")[0]
    assert "repo id" in spaces and "not valid" in spaces
    assert "no Hugging Face token" in no_token
    assert json.loads((folder / "run.json").read_text())["status"] == "finished"


# Written into every Python process started with its folder on PYTHONPATH: the process's command line and
# environment, as it sees them, in <HF_DILOCO_TEST_ENV_DUMP>/<pid>.json.
DUMP_ENVIRONMENT = """import json, os
folder = os.environ.get("HF_DILOCO_TEST_ENV_DUMP")
if folder:
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().decode(errors="replace").split("\\0")
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump({"argv": argv, "env": dict(os.environ)}, f)
"""


@pytest.mark.process
def test_the_forms_check_runs_without_the_apps_token_and_password(tmp_path):
    """The app is started with a Hub token and its password in its environment. The check Preview runs
    (`hf-diloco launch --dry-run`, in the checker's process) gets the app's environment less those secrets: every
    Python process started with the planted sitecustomize.py on PYTHONPATH writes down the environment it sees, and
    the check's holds neither secret, while the app's own ordinary variables did reach it."""
    hooks, seen = tmp_path / "hooks", tmp_path / "environments"
    hooks.mkdir()
    seen.mkdir()
    (hooks / "sitecustomize.py").write_text(DUMP_ENVIRONMENT)
    secrets = {"HF_TOKEN": "hf_planted_token_789", "HF_DILOCO_APP_AUTH": "alice:planted-password-789"}
    with app_server(tmp_path / "runs", {**secrets, "PYTHONPATH": str(hooks), "HF_DILOCO_TEST_ENV_DUMP": str(seen)}) \
            as url:
        client = connect(url, auth=("alice", "planted-password-789"))
        message = client.predict("", "tiny-pretrain.yaml", "", "cpu-2proc.yaml", *knobs(inner_steps=5, max_steps=50),
                                 api_name="/preview")[1]
        assert "Form is valid" in message, message
    processes = [json.loads(p.read_text()) for p in seen.glob("*.json")]
    app = [p for p in processes if "app.server" in p["argv"]]
    assert app and app[0]["env"]["HF_TOKEN"] == secrets["HF_TOKEN"], "the app itself holds the planted secrets"
    checks = [p for p in processes if "hf_diloco.checker" in p["argv"]]
    assert checks, f"no process of the check wrote its environment: {[p['argv'] for p in processes]}"
    for check in checks:
        assert check["env"]["HF_DILOCO_TEST_ENV_DUMP"] == str(seen), "an ordinary variable of the app's arrives"
        assert not set(secrets) & set(check["env"]), sorted(check["env"])
        assert not [k for k, v in check["env"].items() if "planted" in v], "no secret under another name either"
        assert APP_KEY not in check["env"].values(), "nor the app's key"


def plotted(values) -> list:
    """The numbers of a Plotly trace's array as the page gets them: a list, or base64 bytes of a dtype (Plotly 6)."""
    if isinstance(values, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return list(values)


@pytest.mark.process
def test_the_app_serves_a_good_run_beside_run_json_files_it_cannot_read(tmp_path):
    """A runs folder holds, beside one finished run (two syncs, written here as a run writes them), an empty
    run.json, one holding a JSON list, one holding keys from elsewhere and none of a run's, and a run written by a
    newer version (a run's keys plus some this version does not know). The server starts and lists them all: the
    unreadable ones as failed, with the sentence naming their file; the newer one as what it says. The good run's
    rounds and loss plot come as written, and a page load while a damaged run is the newest fails nothing."""
    import os

    from app.server import App

    runs_dir = tmp_path / "runs"
    recipe = str(REPO / "recipes" / "tiny-pretrain.yaml")
    good = runs_dir / "good"
    (good / "output").mkdir(parents=True)
    written = [{"round": n, "step": 10 * n, "loss": 4.0 - n / 4, "replica_losses": [4.1 - n / 4, 3.9 - n / 4],
                "pseudo_grad_norm": 0.5, "replica_pseudo_grad_norms": [0.6, 0.7], "bytes_per_replica": 4_000_000,
                "ddp_bytes_per_replica": 40_000_000, "sync_seconds": 0.1, "compute_seconds": 3.0, "tokens": 10240,
                "tokens_per_second": 6000.0, "num_replicas": 2, "inner_steps": 10} for n in (1, 2)]
    (good / "output" / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    runs._write(good, runs.Run("good", recipe, "cpu-2proc.yaml", [], ["true"], str(good / "output"),
                               status="finished", ended=time.time()))
    newer = {**json.loads((good / "run.json").read_text()), "id": "newer", "output_dir": str(runs_dir / "newer" / "o"),
             "priority": "high", "placement": {"rack": 3}}
    bad = {"empty": "", "a-list": "[1, 2, 3]", "foreign": json.dumps({"name": "x", "colour": "blue"}),
           "newer": json.dumps(newer)}
    for name, text in bad.items():
        (runs_dir / name).mkdir()
        (runs_dir / name / "run.json").write_text(text)
        os.utime(runs_dir / name / "run.json", (time.time() - 3600,) * 2)  # older than the good run
    with app_server(runs_dir) as url:
        client = connect(url)
        live = client.predict("good", api_name="/refresh")
        listed = {row[0]: row for row in table(live[11])["data"]}
        assert set(listed) == {"good", *bad}, listed
        assert listed["good"][1] == listed["newer"][1] == "finished"
        for name in ("empty", "a-list", "foreign"):
            assert listed[name][1] == "failed" and str(runs_dir / name / "run.json") in listed[name][-1], listed[name]
        assert "data-status='finished'" in live[0]
        assert [row[:2] for row in table(live[6])["data"]] == [[2, 20], [1, 10]], "the good run's rounds, newest first"
        drawn = {trace["name"]: plotted(trace["y"]) for trace in json.loads(live[1]["plot"])["data"]}
        for replica in (0, 1):
            assert drawn[f"replica {replica}"] == [r["replica_losses"][replica] for r in written], drawn
        damaged = client.predict("empty", api_name="/refresh")[0]
        assert "data-status='failed'" in damaged and "run.json is empty" in damaged, damaged
    os.utime(runs_dir / "a-list" / "run.json")  # now the newest: the page opens on it
    selected = App(runs_dir).reattach()[0]
    assert selected["value"] == "a-list", selected



def test_the_live_view_and_compare_draw_sync_records_that_lack_optional_fields(tmp_path):
    """A run whose first sync record was written by an older version (no `ddp_bytes_per_replica`,
    `blocked_seconds`, `tokens`, `sync`) and whose second was written by hand (round, step, loss, replica losses
    and bytes only): the live view's refresh and the Compare tab draw what the records hold instead of failing
    (the refresh raised KeyError on the first). Status bar: round, loss, bytes sent, "—" for what the last record
    lacks and for the seconds waited (unknown for the second sync); round table: both rounds, empty cells where a
    field is missing; loss plot: each replica's losses; bytes plot: DiLoCo's bytes, with no DDP series; norm and
    time plots: the first sync only. A torchft record without replica rows or participants fills a membership row."""
    from app import views
    from app.server import App

    runs_dir = tmp_path / "runs"
    old = runs_dir / "old"
    (old / "output").mkdir(parents=True)
    written = [{"round": 1, "step": 10, "loss": 3.5, "replica_losses": [3.6, 3.4], "pseudo_grad_norm": 0.5,
                "replica_pseudo_grad_norms": [0.6, 0.7], "bytes_per_replica": 4_000_000, "sync_seconds": 0.1,
                "compute_seconds": 3.0, "tokens_per_second": 6000.0, "num_replicas": 2, "inner_steps": 10},
               {"round": 2, "step": 20, "loss": 3.0, "replica_losses": [3.1, 2.9], "bytes_per_replica": 2_000_000}]
    (old / "output" / "syncs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    runs._write(old, runs.Run("old", str(REPO / "recipes" / "tiny-pretrain.yaml"), "cpu-2proc.yaml", [], ["true"],
                              str(old / "output"), status="finished", ended=time.time()))
    app = App(runs_dir)
    live = app.refresh("old", None)

    bar = live[0]
    assert "round 2 · loss 3.0000 · — tok/s · — replicas · sent 6.0 MB/replica, none" in bar, bar
    assert "waited for syncs — s" in bar, bar
    rounds = live[6]
    assert rounds[["round", "step", "train loss"]].values.tolist() == [[2, 20, 3.0], [1, 10, 3.5]], rounds
    assert rounds["MB sent"].tolist() == [2.0, 4.0] and rounds["Δ norm"].tolist()[1] == 0.5
    assert rounds[["Δ norm", "sync s", "compute s", "tokens/s"]].iloc[0].isna().all(), "round 2's cells are empty"

    def traces(figure) -> dict:
        return {trace.name: (plotted(trace.x), plotted(trace.y)) for trace in figure.data}

    losses = traces(live[1])
    assert losses["replica 0"] == ([10, 20], [3.6, 3.1]) and losses["replica 1"] == ([10, 20], [3.4, 2.9]), losses
    traffic = traces(live[4])
    assert traffic == {"DiLoCo (cumulative)": ([10, 20], [4.0, 6.0]), "DiLoCo (this sync)": ([10, 20], [4.0, 2.0])}
    assert {name: x for name, (x, _) in traces(live[2]).items()} == {"averaged Δ": [10], "replica 0": [10],
                                                                      "replica 1": [10]}
    assert {name: x for name, (x, _) in traces(live[5]).items()} == {"compute": [10], "blocked": [10]}
    assert live[11]["run"].tolist() == ["old"] and live[11]["loss"].tolist() == [3.0]

    _, compared = app.compare(["old"])
    assert compared[["run", "MB sent per replica"]].values.tolist() == [["old", 6.0]], compared

    torchft = {"round": 1, "step": 10, "loss": 3.0, "outer_backend": "torchft"}
    assert views.membership_rows([torchft]).values.tolist() == [[1, 10, None, "yes"]]


TINY = TINY_YAML
BAD_DRAFTS = {
    "push from a run": (TINY + "push_to_hub: true\n", {}, "does not start runs that set 'push_to_hub'"),
    "a token in the recipe": (TINY + "hub_token: hf_abc\n", {}, "'hub_token'"),
    "an online tracker": (TINY.replace("report_to: tensorboard", "report_to: wandb"), {}, "report_to may only be"),
    "DeepSpeed": (TINY + "deepspeed: ds.json\n", {}, "'deepspeed'"),
    "resume from anywhere": (TINY + "resume_from_checkpoint: /tmp/other/checkpoint-5\n", {},
                             "resume_from_checkpoint may only be 'auto' or 'latest'"),
    "a misspelt key": (TINY + "inner_stepz: 5\n", {}, "unknown key 'inner_stepz' (did you mean 'inner_steps'?)"),
    "a dataset folder with no data file": (TINY, {"dataset_name": str(REPO / "accelerate_configs")},
                                           "holds no data file"),
    "a torchft replica's own Lighthouse": (TINY + "outer_backend: torchft\nlighthouse: http://10.0.0.9:29510\n", {},
                                           "the recipe may not set 'lighthouse': the app starts"),
}


@pytest.mark.process
def test_the_app_starts_only_runs_it_may_and_gives_each_its_own_port(form_app):
    """A draft recipe may set hf-diloco's fields and the training settings, nothing that pushes, tracks online,
    shards the model or resumes from elsewhere, nor what the launcher of a torchft run sets for each replica; the
    process count must fit the replica groups (found in Preview, not in every worker). Two runs previewed from one
    form get two rendezvous ports."""
    url, runs_dir = form_app
    client = connect(url)
    for case, (draft, values, words) in BAD_DRAFTS.items():
        form = ["", "tiny-pretrain.yaml", draft, "cpu-2proc.yaml", *knobs(**values)]
        previewed = client.predict(*form, api_name="/preview")[1]
        started = client.predict(*form, api_name="/start")[0]
        for message in (previewed, started):
            assert message.startswith("**Cannot start:**") and words in message, (case, message)
    grouped = ["", "tiny-pretrain.yaml", TINY + "replica_group_size: 2\n", "cpu-2proc.yaml", *knobs(replicas=3)]
    command = client.predict(*grouped, api_name="/preview")[0]
    assert " --num_processes 6 " in command, "3 replicas of 2 processes are 6 processes"
    ports = set()
    for name in ("first", "second"):
        form = [name, "tiny-pretrain.yaml", "", "cpu-2proc.yaml", *knobs(inner_steps=5, max_steps=5)]
        command = client.predict(*form, api_name="/preview")[0]
        ports.add(command.split("--main_process_port")[1].split()[0])
    assert len(ports) == 2
    assert [p.name for p in runs_dir.iterdir() if p.name != "drafts" and not p.name.endswith(".key")] == []


@pytest.mark.process
def test_a_reloaded_form_refills_what_the_user_chose_and_nothing_the_app_chose(tmp_path):
    """A torch-backend run of 3 replicas with replica_group_size 2 runs 6 processes on a port the app picked; the
    reloaded form says 3 replicas and leaves the port and the other distributed settings blank."""
    sys.path.insert(0, str(REPO))
    from app import forms
    from app.server import App

    runs_dir = tmp_path / "runs"
    app = App(runs_dir)
    grouped = TINY + "replica_group_size: 2\n"
    form = ["", "tiny-pretrain.yaml", grouped, "cpu-2proc.yaml", *knobs(replicas=3, inner_steps=7)]
    command, message, planned = app.preview(*form)
    assert "Form is valid" in message, message
    assert " --num_processes 6 " in command and " --main_process_port " in command
    plan = runs.Run(**planned["plan"])
    plan.status, plan.ended = "finished", time.time()
    plan.folder.mkdir(parents=True)
    runs._write(plan.folder, plan)  # as Start leaves it, less the processes

    refilled = dict(zip([f.name for f in fields(forms.Knobs)], app.reattach()[5:], strict=True))
    assert refilled == {**dict.fromkeys(refilled, ""), "replicas": "3", "inner_steps": "7"}


@pytest.mark.process
def test_the_checker_is_one_process_for_every_check_and_is_started_again_when_it_ends():
    """The form's checks run in one process kept between them (app.forms.Checker): two checks are answered by the
    same process, each as its own process would have ended; a checker killed between checks is started again for
    the next one."""
    import os
    import signal

    from app.forms import Checker

    checker = Checker()
    check = ["launch", str(REPO / "recipes" / "tiny-pretrain.yaml"), "--accelerate-config",
             str(REPO / "accelerate_configs" / "cpu-2proc.yaml"), "--dry-run"]
    try:
        good = checker.run(check)
        assert good.returncode == 0 and "hf_diloco.accelerate_launch" in good.stdout, good.stderr
        first = checker._process.pid
        bad = checker.run([*check, "--", "--inner_steps", "0"])
        assert bad.returncode == 2 and "inner_steps" in bad.stderr and checker._process.pid == first
        os.kill(first, signal.SIGKILL)
        checker._process.wait()
        again = checker.run(check)
        assert again.returncode == 0 and again.stdout == good.stdout and checker._process.pid != first
    finally:
        checker.close()


@pytest.mark.process
def test_the_instant_check_refuses_what_preview_refuses_for_the_forms_own_values(tmp_path):
    """The check that runs as knobs are typed and Preview answer in either order, so they must agree: a local
    dataset folder without data, a recipe as typed that names a dataset outside the folders the app reads data
    from, and an unknown key in the recipe as edited are refused by both, in the same sentence; H above max steps
    (knobs or the recipe as typed) is allowed by both with the same note, the run's own words (the replicas sync
    once, at the last step); a valid form passes both; the check writes no draft."""
    from app.server import App

    app = App(tmp_path / "runs", [tmp_path])
    empty = tmp_path / "my-data"
    empty.mkdir()
    cases = [(knobs(dataset_name=str(empty)), ""),
             (knobs(), TINY_YAML.replace("dataset_name: builtin", "dataset_name: /etc/hostname")),
             (knobs(), TINY_YAML + "inner_stepz: 5\n")]
    for values, edited in cases:
        preview = app.preview("", "tiny-pretrain.yaml", edited, "cpu-2proc.yaml", *values)[1]
        assert preview.startswith("**Cannot start:**"), (values, edited, preview)
        assert app.check("tiny-pretrain.yaml", edited, *values) == preview
    from hf_diloco.checks import rounds_note

    for values, edited, (inner, steps) in ((knobs(inner_steps=1000, max_steps=150), "", (1000, 150)),
                                           (knobs(), TINY_YAML.replace("max_steps: 400", "max_steps: 3"), (50, 3))):
        note = f"**Note:** {rounds_note(inner, steps)}"
        preview = app.preview("", "tiny-pretrain.yaml", edited, "cpu-2proc.yaml", *values)[1]
        assert preview.startswith("Form is valid") and preview.endswith(note), preview
        assert app.check("tiny-pretrain.yaml", edited, *values) == note
    assert app.check("tiny-pretrain.yaml", "", *knobs(inner_steps=5, max_steps=150)) == ""
    assert "Form is valid" in app.preview("", "tiny-pretrain.yaml", "", "cpu-2proc.yaml",
                                          *knobs(inner_steps=5, max_steps=150))[1]
    drafts_before = sorted((tmp_path / "runs" / "drafts").glob("*"))
    app.check("tiny-pretrain.yaml", TINY_YAML + "# edited\n", *knobs())
    assert sorted((tmp_path / "runs" / "drafts").glob("*")) == drafts_before


@pytest.mark.process
def test_a_trainer_the_picker_does_not_offer_is_refused_in_one_sentence(tmp_path):
    """Gradio keeps the trainer picker to its choices (diloco, sft, dpo, ddp); the form's own check refuses any
    other value that reaches it, in one sentence, before anything runs."""
    sys.path.insert(0, str(REPO))
    from app.server import App

    app = App(tmp_path / "runs")
    command, message, planned = app.preview("", "tiny-pretrain.yaml", "", "cpu-2proc.yaml",
                                            *knobs(trainer="deepspeed"))
    assert "trainer must be one of diloco, sft, dpo, ddp, got 'deepspeed'." in message, message
    assert not command and not planned
