"""The app in a real browser: Playwright drives Debian's chromium against a real app server in a fresh runs folder.

What a person sees is asserted: lines and points drawn in the plots' SVG, the log box scrolled to its newest line,
the status bar's text. Screenshots go to test-artifacts/: app-launch.png, app-live.png (mid-run, never reloaded),
app-stopped.png, app-failed.png, app-compare.png (a DiLoCo, a FedAvg and a DDP run), app-membership.png (a torchft
run's rounds and who took part in them), app-demo.png (the demo's run, which the app did not start).
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from app_helpers import TINY_YAML, app_server, connect, keyed, knobs, table
from helpers import ACCELERATE_CPU_2PROC, REPO, env, free_port, replica_training_pid, wait_for

from hf_diloco import runs
from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture
def browser():
    if not shutil.which("chromium"):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield browser
        browser.close()


def fill(page, elem_id: str, value: str) -> None:
    page.locator(f"#{elem_id} textarea, #{elem_id} input").first.fill(value)


def status(page) -> str:
    return page.locator("#hfd-status").inner_text() if page.locator("#hfd-status").count() else ""


def open_form(browser, url: str, recipe: str):
    """A new page on the app, once its form is there, with `recipe` picked from the recipe list."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(keyed(url))
    page.get_by_text("Preview command").wait_for(timeout=60_000)
    page.locator("#recipe input").click()
    page.get_by_role("option", name=recipe).click()
    return page


# What the page draws, read from the plots' SVG (Plotly draws each line trace as one path.js-line, each marker as a
# path in .points, each bar as a .point in .barlayer); colours come back as #rrggbb.
LINES = """id => [...document.querySelectorAll(`#${id} .scatterlayer .trace path.js-line`)]
    .filter(p => (p.getAttribute('d') || '').includes('L'))
    .map(p => '#' + getComputedStyle(p).stroke.match(/\\d+/g).slice(0, 3)
        .map(v => Number(v).toString(16).padStart(2, '0')).join(''))"""
MARKS = """([id, kind]) => document.querySelectorAll(kind === 'bar' ? `#${id} .barlayer .point`
    : `#${id} .scatterlayer .points path`).length"""
X_TICKS = """id => [...document.querySelectorAll(`#${id} .xtick text`)].map(t => t.textContent)"""
DRAWN_BY = """id => { const e = document.querySelector(`#${id}`);
    return e.querySelector('.js-plotly-plot') && !e.querySelector('img, canvas, .vega-embed') ? 'plotly' : 'other'; }"""
LOG_AT_BOTTOM = """() => { const b = document.querySelector('#log textarea');
    return [b.scrollHeight > b.clientHeight + 50, b.scrollTop + b.clientHeight >= b.scrollHeight - 30]; }"""


def test_the_demo_prints_a_calm_console_and_a_fresh_app_then_shows_its_rounds_and_compares_it_with_fedavg_and_ddp(
        browser, tmp_path, monkeypatch):
    """The main job, shortened, as a first-time user meets it: `hf-diloco demo` (what `make demo` runs; its run goes
    to runs/demo-<time>, here <runs>/demo) trains two CPU replicas, says what happened (rounds, held-out loss before
    and after, bytes against DDP's) and prints at most 40 lines in all, one progress bar and one line per sync among
    them; then `hf-diloco app` over that runs folder, opened fresh and told nothing, shows the demo run: selected,
    finished, its rounds in the status bar and a line per replica in the loss plot.

    Then three short runs side by side in that app (the demo's DiLoCo run and two more started beside it, a FedAvg
    and a DDP run): the DDP baseline is watchable from Trainer's logs (loss and progress, no syncs), a click in Runs
    selects a run, Start stays available for a new run, and Compare draws held-out loss against tokens and bytes
    with a table of totals."""
    for key, value in env().items():
        monkeypatch.setenv(key, value)
    runs_dir = tmp_path / "runs"
    out = runs_dir / "demo"
    # As bytes: a progress bar redraws its line with carriage returns, which text mode would turn into newlines.
    demo = subprocess.run([sys.executable, "-m", "hf_diloco.cli", "demo", "--output-dir", str(out), "--max-steps",
                           "20", "--inner-steps", "10", "--port", str(free_port())], capture_output=True, env=env(),
                          cwd=REPO, timeout=300)
    result = subprocess.CompletedProcess(demo.args, demo.returncode, demo.stdout.decode(), demo.stderr.decode())
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "diloco_summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["rounds"] == 2 and summary["steps"] == 20
    assert summary["eval_loss_final"] < summary["eval_loss_initial"]
    # Ten inner steps per sync: DDP would all-reduce gradients ten times as often (metric slots aside).
    assert 9.9 < summary["ddp_bytes_per_replica"] / summary["bytes_per_replica"] <= 10
    report = result.stdout[result.stdout.index("hf-diloco demo: what happened"):]
    for row in ("eval loss before -> after", "tokens/s", "sent per replica", "DDP would have sent"):
        assert row in report
    assert report.rstrip().endswith(f"watch it in the app: hf-diloco app --runs-dir {runs_dir}"), report
    run_metrics = json.loads((out / "run_metrics.json").read_text())
    assert run_metrics["eval_loss"] == summary["eval_loss_final"] and run_metrics["global_step"] == 20
    assert run_metrics["steady_steps"] == 18 and run_metrics["steady_tokens_per_second"] > 0  # steps 2..20
    rounds = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and all(r.get("eval_loss") for r in rounds)
    # What a terminal shows: lines end at a newline (a progress bar redraws its own line with carriage returns).
    shown = result.stdout.split("\n") + result.stderr.split("\n")
    assert len(shown) <= 40, "\n".join(shown)
    assert sum(line.lstrip().startswith("[diloco] round") for line in shown) == 2, "one line per sync"
    assert sum("20/20" in line for line in shown) == 1, "one progress bar, ending at the last step"
    assert not any(line.lstrip().startswith("{'") for line in shown), "no dicts of logs"
    logged = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert any("loss" in entry for entry in logged) and any("eval_loss" in entry for entry in logged)

    with app_server(runs_dir) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(keyed(url))
        page.get_by_role("tab", name="Live").click()
        wait_for(lambda: "demo" in status(page) and page.evaluate(
            "document.querySelector('#hfd-status')?.dataset.status") == "finished", 30, "the demo run, finished")
        assert "FINISHED" in status(page) and "round 2 " in status(page) and "fewer bytes" not in status(page), \
            status(page)
        wait_for(lambda: {"#2563eb", "#ea580c"} <= set(page.evaluate(LINES, "loss-plot")), 30,
                 "a line per replica in the loss plot")
        page.get_by_role("tab", name="Runs").click()
        page.locator("#runs-table [role=gridcell]").filter(has_text="demo").first.wait_for(timeout=20_000)
        page.screenshot(path=str(ARTIFACTS / "app-demo.png"), full_page=True)

        # Compare: the demo's DiLoCo run beside a FedAvg and a DDP run started now (one demo, one app: a DiLoCo run
        # and an app start fewer than a test of its own).
        (demo_run,) = runs.list_runs(runs_dir)
        started = [start_short_run(runs_dir, "fedavg-baseline.yaml", "fedavg-H5", ["--inner_steps", "5"]),
                   start_short_run(runs_dir, "ddp-baseline.yaml", "ddp", [])]
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(keyed(url))
        page.get_by_text("Preview command").wait_for(timeout=60_000)
        assert runs.load(started[-1].folder).status in runs.ACTIVE
        assert page.locator("#start").is_enabled(), "a new run can start while others train"
        page.get_by_role("tab", name="Runs").click()
        # The page opened on the newest run (ddp); a click on another row selects that one.
        page.locator("#runs-table [role=gridcell]").filter(has_text="demo").first.click()
        wait_for(lambda: "demo" in status(page), 20, "the clicked run in the status bar")
        wait_for(lambda: all(runs.load(r.folder).status not in runs.ACTIVE for r in started), 400,
                 "the two runs to end")
        for run in started:
            assert runs.load(run.folder).status == "finished", (run.folder / "run.log").read_text()[-2000:]
        page.locator("#runs-table [role=gridcell]").filter(has_text="ddp").first.click()
        page.get_by_role("tab", name="Live").click()
        wait_for(lambda: "no syncs" in status(page) and "step 20/20" in status(page), 20, "the DDP status")
        wait_for(lambda: len(page.evaluate(LINES, "loss-plot")) >= 2, 20, "DDP train and held-out loss lines")
        page.get_by_role("tab", name="Compare").click()
        for run in [demo_run, *started]:
            page.locator("#compare-select input").click()
            page.locator("#compare-select input").fill(run.id)
            page.keyboard.press("Enter")
        page.keyboard.press("Escape")
        page.locator("#compare-table").click()  # close the run list so the figure shows
        wait_for(lambda: page.locator("#compare-table .virtual-row").count() == 3, 30, "three rows in the table")
        wait_for(lambda: {"#2563eb", "#ea580c", "#16a34a"} <= set(page.evaluate(LINES, "compare-plot")), 30,
                 "a line per run in its own colour")
        assert page.evaluate(DRAWN_BY, "compare-plot") == "plotly"
        table = page.locator("#compare-table").inner_text()
        assert "ddp" in table and "fedavg-H5" in table and "demo" in table
        page.screenshot(path=str(ARTIFACTS / "app-compare.png"), full_page=True)


LIVE_YAML = (REPO / "recipes" / "tiny-pretrain.yaml").read_text().replace("block_size: 256", "block_size: 64")


def test_preview_refuses_four_bad_forms_then_the_live_view_draws_without_reload_and_stop_ends_with_a_checkpoint(
        browser, tmp_path):
    """Fresh app: four forms that would fail a minute into the run are refused by Preview (a task picked that the
    recipe's model does not do among them), each with its sentence shown beside the form, and nothing is started;
    with a link typed in, Preview draws the planner's table.

    Then, in that app and page, still no runs: Start from the form, switch to Live, never reload. The plots draw
    lines and points (their first frame was empty), the held-out series that appears later is drawn too, the
    progress moves between syncs, the log follows its newest line, and Stop ends the run with a checkpoint. The
    stopped run is then pushed (to a local server speaking the Hub's endpoints) only once the user says it may be,
    with a card that says how it ended, and the token reaches no file of the run."""
    from hub_server import FakeHub

    runs_dir = tmp_path / "runs"
    empty = tmp_path / "my-data"
    empty.mkdir()
    (empty / "README.md").write_text("notes, no data\n")
    with FakeHub() as hub, app_server(runs_dir, {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"},
                                      args=("--data-dir", str(tmp_path))) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(keyed(url))
        page.get_by_text("Preview command").wait_for(timeout=60_000)
        message = page.locator("#form-message")

        def refused(words: str, refusal: bool = True) -> None:
            # A person clicks again when nothing happens: on a cold machine the first answer has once taken over a
            # minute (cause not found); three clicks, 30 s each, and the sentence must be there.
            for attempt in range(3):
                page.click("#preview")
                try:
                    message.get_by_text(words).wait_for(timeout=30_000)
                    break
                except Exception:
                    if attempt == 2:
                        knobs = {k: page.locator(f"#knob-{k} input, #knob-{k} textarea").first.input_value()
                                 for k in ("inner_steps", "max_steps")}
                        print("shown:", repr(message.inner_text()), knobs, page.locator("#command").inner_text()[:300])
                        raise
            assert ("Cannot start" in message.inner_text()) == refusal, message.inner_text()

        fill(page, "knob-inner_steps", "1000000000")
        fill(page, "knob-max_steps", "150")
        refused("H = 1000000000 inner steps is above max steps = 150: the replicas sync once", refusal=False)
        fill(page, "knob-inner_steps", "5")
        fill(page, "knob-dataset_name", str(empty))
        refused(f"dataset folder '{empty}' holds no data file")
        fill(page, "knob-dataset_name", "")
        # The task picker, blank ("as in the recipe") at first: a masked LM from the recipe's causal preset.
        picker = page.locator("#knob-task input")
        wait_for(lambda: picker.input_value() == "as in the recipe", 20, "the task picker showing its blank choice")
        picker.click()
        page.get_by_role("option", name="masked-lm", exact=True).click()
        wait_for(lambda: picker.input_value() == "masked-lm", 20, "masked-lm picked")
        refused("preset 'tiny-llama' is a causal language model; task masked-lm starts from preset 'tiny-bert'")
        picker.click()
        page.get_by_role("option", name="as in the recipe", exact=True).click()
        wait_for(lambda: picker.input_value() == "as in the recipe", 20, "the task picker back to the recipe's")
        # Across sites: with a link typed in, Preview also shows the planner's table for the form as it is.
        page.get_by_text("Across sites: Preview also predicts").click()
        fill(page, "plan-link", "10mbit")
        fill(page, "plan-speed", "15000")
        page.click("#preview")
        plan = page.locator("#plan")
        plan.get_by_text("Recommended:").wait_for(timeout=90_000)
        assert plan.locator("table tr").count() >= 10 and "Predicted for" in plan.inner_text(), plan.inner_text()
        page.get_by_text("Recipe YAML").click()
        editor = page.locator("#recipe-yaml .cm-content")
        editor.click()
        page.keyboard.press("Control+End")
        page.keyboard.type("\ninner_stepz: 5\n")
        page.locator("#recipe-source").get_by_text("unsaved edits").wait_for(timeout=20_000)
        refused("unknown key 'inner_stepz' (did you mean 'inner_steps'?)")
        page.screenshot(path=str(ARTIFACTS / "app-refused.png"), full_page=True)
        assert runs.list_runs(runs_dir) == []

        # The live part. No link: Preview predicts nothing more. The recipe edited to blocks of 64 tokens, not 256
        # (and the unknown key gone): the same rounds, syncs, evaluations and log lines for a quarter of the
        # compute (a draft keeps its recipe's default name).
        fill(page, "plan-link", "")
        editor.click()
        page.keyboard.press("Control+A")
        page.keyboard.insert_text(LIVE_YAML)
        wait_for(lambda: "inner_stepz" not in editor.inner_text() and "block_size: 64" in editor.inner_text(), 20,
                 "the edited recipe in the editor")
        fill(page, "knob-max_steps", "-5")
        page.locator("#form-message").get_by_text("max steps must be at least 1").wait_for(timeout=10_000)
        fill(page, "knob-max_steps", "400")
        fill(page, "knob-inner_steps", "5")
        wait_for(lambda: "Cannot start" not in page.locator("#form-message").inner_text(), 10, "the check to pass")
        page.click("#preview")
        page.get_by_text("Form is valid").wait_for(timeout=120_000)
        page.screenshot(path=str(ARTIFACTS / "app-launch.png"), full_page=True)
        previewed = page.locator("#command").inner_text()
        assert "hf_diloco.accelerate_launch" in previewed and "--inner_steps 5" in previewed
        message = page.locator("#form-message").inner_text()
        assert "tiny-pretrain-H5-steps400" in message, "the default name: recipe plus the knobs changed"

        time.sleep(2)  # the run's clock starts at Start, not at Preview
        clicked = time.time()
        page.click("#start")
        page.get_by_text("Started").wait_for(timeout=60_000)
        (run,) = runs.list_runs(runs_dir)
        assert run.created >= clicked and " ".join(run.command) in " ".join(previewed.split()), \
            "Start runs exactly the previewed command"
        page.get_by_role("tab", name="Live").click()
        steps = set()

        def shown():
            text = status(page)
            if "step " in text:
                steps.add(int(text.split("step ")[1].split("/")[0]))
            return text

        def rounds_drawn(n):
            text = shown()
            return f"round {n} " in text or any(f"round {k} " in text for k in range(n, n + 50))

        wait_for(lambda: rounds_drawn(3), 240, "three sync rounds in the status bar", every=0.3)
        # The held-out loss (eval_steps 50) is a series that appears later, on the open page.
        held_out = "#111827"
        wait_for(lambda: rounds_drawn(11) and held_out in page.evaluate(LINES, "loss-plot"), 240,
                 "the held-out loss line", every=0.3)
        lines = page.evaluate(LINES, "loss-plot")
        logged = "#93c5fd"  # the loss Trainer logs every logging_steps, between rounds
        assert {"#2563eb", "#ea580c", held_out, logged} <= set(lines), f"replicas, held-out, logged: {lines}"
        ticks = page.evaluate(X_TICKS, "loss-plot")
        assert len(ticks) < 30, f"a numeric axis, not one tick per value: {ticks}"
        assert page.evaluate(MARKS, ["norm-plot", "point"]) >= 3 * 2, "pseudo-gradient norms drawn as points"
        assert page.evaluate(MARKS, ["time-plot", "bar"]) >= 2 * 2, "compute and blocked bars per sync"
        step_ticks = [t for t in page.evaluate(X_TICKS, "norm-plot") if t.replace(",", "").strip()]
        assert step_ticks and all("." not in t for t in step_ticks), step_ticks
        assert {"#dc2626", "#111827"} <= set(page.evaluate(LINES, "bytes-plot")), "DDP and DiLoCo bytes drawn"
        assert {page.evaluate(DRAWN_BY, f"{name}-plot") for name in ("loss", "bytes", "norm", "agreement", "time")} \
            == {"plotly"}, "every figure on the page is drawn by one library"
        # progress.json is rewritten at most twice a second and the page every 2 s: where a round (H = 5) takes less
        # than that, a step between syncs shows now and then, not at every refresh.
        wait_for(lambda: shown() and any(step % 5 for step in steps), 120,
                 "a step between syncs in the status bar, not only the syncs' steps", every=0.3)
        # One line per sync: the log outgrows its box as the run goes on, and then follows its newest line.
        wait_for(lambda: page.evaluate(LOG_AT_BOTTOM) == [True, True], 120, "the log to show its newest line")
        page.screenshot(path=str(ARTIFACTS / "app-live.png"), full_page=True)

        page.click("#stop")
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'stopped'",
                               timeout=240_000)
        page.screenshot(path=str(ARTIFACTS / "app-stopped.png"), full_page=True)
        run = runs.load(run.folder)
        assert run.status == "stopped" and list((runs_dir / run.id / "output").glob("checkpoint-*"))
        assert runs.training_pids(run) == []
        # The supervisor records the end, then exits: under load the second can come a moment after.
        wait_for(lambda: not runs._alive(run.supervisor_pid, "hf_diloco.launch"), 30, "the supervisor to exit")

        client = connect(url)
        client.predict(api_name="/reattach")  # what a page load shows: the run list, for this client too
        card, metadata, _ = client.predict(run.id, "alice/tiny-diloco", api_name="/card")
        assert "## DiLoCo settings" in card and "- diloco" in metadata
        assert not card.startswith("---") and "![" not in card, "the preview renders the card, not its YAML header"
        # A stopped run is pushed only when the user says so, and its card says how it ended.
        push = [run.id, "alice/tiny-diloco", True, "hf_app_token_456", False, "from the app"]
        result, _ = client.predict(*push, False, api_name="/push")
        stopped = json.loads((runs_dir / run.id / "output" / runs.STOPPED_FILE).read_text())
        assert result.startswith("**Not pushed:** this run stopped on request at step "
                                 f"{stopped['step']} of 400; its {stopped['checkpoint']} was kept."), result
        assert hub.commits == [] and hub.repos == {}
        result, log = client.predict(*push, True, api_name="/push")
        assert result.startswith("Pushed") and "alice/tiny-diloco" in result, result
        files = hub.files["alice/tiny-diloco"]
        assert sorted(files) == ["README.md", "config.json", "generation_config.json", "model.safetensors",
                                 "run_config.json", "syncs.jsonl", "tokenizer_config.json",
                                 "training_curve.png"], log
        assert f"**This run stopped on request at step {stopped['step']} of 400" in files["README.md"].decode()
        assert len(hub.commits) == 1 and hub.commits[-1]["header"]["summary"] == "from the app"
        assert all(t == "Bearer hf_app_token_456" for t in hub.tokens)
    leaked = [p for p in runs_dir.rglob("*") if p.is_file() and b"hf_app_token_456" in p.read_bytes()]
    assert leaked == [], "the token never reaches the run folders"


def test_a_torchft_replica_killed_from_outside_is_started_again_shown_and_the_run_ends_finished(browser, tmp_path):
    """A torchft run of 2 replicas (min_replicas 1) from the app, restarts left at the default (3). Replica 1's
    training process is SIGKILLed from outside after round 2: the Replicas table shows it restarting, then rejoined;
    the membership table marks the rounds it missed as down, not merely absent; the run ends finished (its last
    round committed), and the status bar, the round table and Compare count the steps and tokens as trained."""
    import os
    import signal

    import psutil
    from app_helpers import TORCHFT_YAML

    runs_dir = tmp_path / "runs"
    draft = TORCHFT_YAML.replace("min_replicas: 2", "min_replicas: 1")
    draft = draft.replace('eval_strategy: "no"', "eval_strategy: steps").replace("eval_steps: 50", "eval_steps: 100")
    # A replica killed inside a sync leaves replica 0's exchange waiting for it until sync_timeout: 30 s, not the
    # recipe's 120, keeps the two syncs alone below the wait below
    assert "sync_timeout: 120" in draft
    draft = draft.replace("sync_timeout: 120", "sync_timeout: 30")
    with app_server(runs_dir) as url:
        client = connect(url)
        form = ["", "torchft-3.yaml", draft, "torchft-replica.yaml", *knobs(replicas=2, inner_steps=5, max_steps=300)]
        message = client.predict(*form, api_name="/start")[0]
        assert message.startswith("Started"), message
        (run,) = runs.list_runs(runs_dir)
        assert " --max-restarts 3 " in " ".join(run.command), "the default: a failed replica is started again"
        output = Path(run.output_dir)
        page = browser.new_page(viewport={"width": 1400, "height": 1200})
        page.goto(keyed(url))
        page.get_by_role("tab", name="Live").click()
        table = page.locator("#replicas")
        wait_for(lambda: len(read_syncs(output / "replica-1")) >= 2, 180, "two rounds of replica 1")
        pid = replica_training_pid(output, 1)
        assert pid is not None
        # Its launcher is held while replica 0 syncs twice alone (a restart can be quicker than a sync here), then
        # let go: it finds its worker dead and the supervisor starts the replica again.
        launcher = psutil.Process(pid).parent()
        launcher.suspend()
        try:
            os.kill(pid, signal.SIGKILL)
            alone = len(read_syncs(output / "replica-0")) + 2
            wait_for(lambda: len(read_syncs(output / "replica-0")) >= alone, 180, "two syncs of replica 0 alone")
        finally:
            launcher.resume()
        wait_for(lambda: table.count() and "restarting" in table.inner_text(), 60, "replica 1 shown restarting")
        wait_for(lambda: "rejoined" in table.inner_text(), 240, "replica 1 shown rejoined")
        page.screenshot(path=str(ARTIFACTS / "app-replica-rejoined.png"), full_page=True)
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'finished'",
                               timeout=300_000)
        rows = [page.locator("#replicas .virtual-row").nth(i).inner_text().split("\n") for i in range(2)]
        rows = [[cell.strip() for cell in row if cell.strip()] for row in rows]
        assert rows[0][:3] == ["0", "finished", "0"] and rows[1][:3] == ["1", "finished", "1"], rows
        live = client.predict(run.id, api_name="/refresh")
        membership = live[8]["value"] if "value" in live[8] else live[8]  # older rows lie below the table's fold
        down = [row[0] for row in membership["data"] if row[5] == "down, restarting"]
        assert down and all(row[4].startswith("✓") for row in membership["data"] if row[0] in down), membership
        assert "step 300/300" in status(page)
        rounds = [r for k in (0, 1) for r in read_syncs(output / f"replica-{k}") if r.get("committed", True)]
        top = page.locator("#rounds .virtual-row").first.inner_text().split()
        assert top[:2] == [str(max(r["round"] for r in rounds)), "300"], top
        page.screenshot(path=str(ARTIFACTS / "app-replica-restarted.png"), full_page=True)
        trained = sum({r["round"]: r["tokens"] for r in rounds}.values())
        curve = views_curve(run)
        assert list(curve["step"]) == [100, 200, 300], curve
        assert curve["tokens"].iloc[-1] == trained, "tokens as trained: the rounds' own counts"
        assert trained < 300 * 2 * 4 * 32, "replica 1 trained less than every step"
    assert runs.load(run.folder).status == "finished"


def views_curve(run):
    import sys

    sys.path.insert(0, str(REPO))
    from app import views

    return views.held_out_curve(runs.load(run.folder))


def start_short_run(runs_dir, recipe: str, name: str, extra: list[str]) -> runs.Run:
    overrides = ["--max_steps", "20", "--block_size", "64", "--eval_steps", "5", "--logging_steps", "5",
                 "--per_device_eval_batch_size", "8", "--eval_fraction", "0.02", *extra]
    return runs.start(runs_dir, str(REPO / "recipes" / recipe), str(ACCELERATE_CPU_2PROC), overrides,
                      port=free_port(), name=name)


def test_a_one_round_run_draws_lines_a_failed_run_shows_its_reason_and_a_contribution_left_out_is_named(browser,
                                                                                                    tmp_path):
    """A finished run of a single round (its folder written here, as a run writes it), beside older folders whose
    run.json is empty or holds a JSON list: the page still draws a line per replica, the Runs table lists the
    damaged ones as failed, and the model card preview shows the rendered card, not its YAML header or a broken
    image.

    Then, in the same app: a run from an edited recipe fails at run time (its corpus is shorter than one block,
    which only tokenizing it finds): the status bar shows the run's own one-sentence reason, and after a reload the
    form says it holds that saved draft.

    Then, still in that app, a run of 3 replicas started from the form in which replica 1 sends 3 Δ_1 (the test hook
    on the app's environment, which changes nothing in the runs before: one written here, one that fails before
    its first sync): once it finishes, the Live round table's `left out` column names replica 1 and the rule on the
    syncs the records say it was left out of, and the status bar counts them."""
    import os

    runs_dir = tmp_path / "runs"
    for name, text in (("empty", ""), ("a-list", "[1, 2, 3]")):
        (runs_dir / name).mkdir(parents=True)
        (runs_dir / name / "run.json").write_text(text)
        os.utime(runs_dir / name / "run.json", (time.time() - 3600,) * 2)  # older: the page opens on the good run
    folder = runs_dir / "one-round"
    (folder / "output").mkdir(parents=True)
    record = {"round": 1, "step": 20, "loss": 4.0, "replica_losses": [4.1, 3.9], "pseudo_grad_norm": 0.5,
              "replica_pseudo_grad_norms": [0.6, 0.7], "bytes_per_replica": 4_000_000,
              "ddp_bytes_per_replica": 80_000_000, "sync_seconds": 0.1, "compute_seconds": 3.0, "tokens": 20480,
              "tokens_per_second": 6000.0, "num_replicas": 2, "inner_steps": 20}
    (folder / "output" / "syncs.jsonl").write_text(json.dumps(record) + "\n")
    recipe = str(REPO / "recipes" / "tiny-pretrain.yaml")
    runs._write(folder, runs.Run("one-round", recipe, str(ACCELERATE_CPU_2PROC), ["--max_steps", "20"], ["true"],
                                 str(folder / "output"), status="finished", ended=time.time()))
    hook = {"PYTHONPATH": str(REPO / "tests" / "scripts" / "contribution_hook"), "CONTRIBUTION_HOOK_SCALE": "3",
            "CONTRIBUTION_HOOK_RANK": "1"}
    with app_server(runs_dir, extra_env=hook, args=("--data-dir", str(tmp_path))) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(keyed(url))
        page.get_by_role("tab", name="Live").click()
        wait_for(lambda: {"#2563eb", "#ea580c"} <= set(page.evaluate(LINES, "loss-plot")), 30,
                 "a line for each replica of the single round")
        assert page.evaluate(MARKS, ["norm-plot", "point"]) == 3, "one sync: one visible point per series"
        page.get_by_role("tab", name="Runs").click()
        for name in ("empty", "a-list"):
            page.locator("#runs-table [role=gridcell]").filter(has_text=name).first.wait_for(timeout=20_000)
        assert page.locator("#runs-table").inner_text().count("failed") == 2, page.locator("#runs-table").inner_text()
        page.get_by_role("tab", name="Push to Hub").click()
        page.get_by_role("button", name="Preview model card").click()
        page.locator("#card h1").wait_for(timeout=30_000)
        card = page.locator("#card").inner_text()
        assert "DiLoCo" in card and "library_name" not in card and not card.lstrip().startswith("---"), card
        assert page.locator("#card img").count() == 0, "no broken image: the curve is shown beside the card"

        # The failed run, started in the same app (one app start less than a test of its own).
        data = tmp_path / "notes.txt"
        data.write_text("hello world\n")
        draft = TINY_YAML.replace("dataset_name: builtin", f"dataset_name: {data}")
        before = {run.id for run in runs.list_runs(runs_dir)}
        client = connect(url)
        message = client.predict("", "tiny-pretrain.yaml", draft, "cpu-2proc.yaml", *knobs(inner_steps=5, max_steps=20),
                                 api_name="/start")[0]
        assert message.startswith("Started"), message
        (run,) = [run for run in runs.list_runs(runs_dir) if run.id not in before]
        wait_for(lambda: runs.load(run.folder).status == "failed", 180, "the run to fail")
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(keyed(url))
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'failed'", timeout=60_000)
        shown = status(page)
        assert "fewer than" in shown and "tokens of text" in shown and "exit code" not in shown, shown
        assert runs.load(run.folder).reason in shown
        page.locator("#recipe-source").get_by_text("saved draft").wait_for(timeout=20_000)
        assert "drafts/tiny-pretrain-edited-" in page.locator("#recipe-source").inner_text()
        page.screenshot(path=str(ARTIFACTS / "app-failed.png"), full_page=True)

        # The contribution left out, from a run of 3 replicas started in the same app (one app start less).
        draft = TINY_YAML.replace("block_size: 64", "block_size: 32")
        before = {run.id for run in runs.list_runs(runs_dir)}
        form = ["", "tiny-pretrain.yaml", draft, "cpu-4proc.yaml", *knobs(replicas=3, inner_steps=5, max_steps=40)]
        message = client.predict(*form, api_name="/start")[0]
        assert message.startswith("Started"), message
        (run,) = [run for run in runs.list_runs(runs_dir) if run.id not in before]
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(keyed(url))
        page.get_by_role("tab", name="Live").click()
        wait_for(lambda: run.name in status(page), 30, "the new run selected")
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'finished'",
                               timeout=240_000)
        records = read_syncs(run.output_dir)
        left_out = {r["round"] for r in records if r["excluded"]}
        assert left_out and all(e["replica"] == 1 for r in records for e in r["excluded"]), records
        assert f"{len(left_out)} contribution{'s' if len(left_out) > 1 else ''} left out" in status(page)
        headers = page.locator("#rounds thead").inner_text()
        assert "left out" in headers, headers
        rows = page.locator("#rounds .virtual-row")
        wait_for(lambda: rows.count() == len(records), 30, "one row per sync")
        shown = {int(rows.nth(i).inner_text().split()[0]): rows.nth(i).inner_text() for i in range(rows.count())}
        assert {r for r, text in shown.items() if "replica 1 (outlier)" in text} == left_out, shown
        page.screenshot(path=str(ARTIFACTS / "app-left-out.png"), full_page=True)


NAME_BOX = "#run-name input, #run-name textarea"
NAME = "ddp-baseline-steps400-llama-20m"  # the default name: the recipe plus the knobs changed


def test_two_ddp_runs_stop_in_their_first_seconds_then_a_torchft_run_shows_its_membership_and_stops(browser,
                                                                                                      tmp_path):
    """Fresh app, the DDP baseline recipe: the name box shows the default name; Preview, then Start twice (a second
    run beside the first, from the Launch tab) and Stop each while it is still starting. The status bar shows the
    start-up phase and a clock that counts from Start, not from Preview; both runs end `stopped` with a checkpoint
    and no process left (a stop that happened, not a kill); after a reload the name box is blank again with the
    default shown, so the next Start is a new run.

    Then, from that reloaded form (one app for both parts): choosing torchft-3 (outer_backend torchft) picks the
    one-process-per-replica config (the torch backend's cpu-2proc is refused for it) and leaves the rendezvous
    settings the DDP runs got out; 2 replicas, H = 5. Preview shows, and Start runs, one `hf-diloco launch ...
    --replicas 2`. On Live, the membership table appears with the first round: one row per round, a column per
    replica, each replica's steps in its cells. Stop ends the run as stopped, every replica after the same round;
    the run wrote only replica-r/ folders, and the tables then hold exactly the rounds the replicas recorded (each
    round once, newest first, its loss; a cell per replica with its steps), as do the status bar, the Runs table and
    the model card."""
    runs_dir = tmp_path / "runs"
    with app_server(runs_dir) as url:
        page = open_form(browser, url, "ddp-baseline.yaml")
        fill(page, "knob-max_steps", "400")
        # The 19M-parameter preset: its start-up (and evaluation on start) lasts long enough to be seen.
        fill(page, "knob-model_name_or_path", "llama-20m")
        name_box = page.locator(NAME_BOX).first
        wait_for(lambda: name_box.get_attribute("placeholder") == NAME, 20, "the default run name in the name box")
        page.click("#preview")
        page.get_by_text("Form is valid").wait_for(timeout=120_000)
        time.sleep(8)  # time between Preview and Start: the run's clock must not count it
        clocks, phases = [], set()
        for count in (1, 2):
            page.click("#start")
            # This Start's own message (the first one's may still be shown): the run it started is on disk then.
            name = NAME if count == 1 else f"{NAME}-2"
            page.locator("#form-message").get_by_text(re.compile(rf"Started \S*{re.escape(name)}\b")).wait_for(
                timeout=120_000)
            newest = wait_for(lambda n=count: len(runs.list_runs(runs_dir)) == n and runs.list_runs(runs_dir)[0],
                              20, f"run {count} on disk")
            page.click("#stop")
            wait_for(lambda r=newest: f"Stopping {r.id}" in page.locator("#stop-message").inner_text(), 20,
                     f"the Stop of {newest.id}")
            shown = wait_for(lambda r=newest: r.name in status(page) and status(page), 20, "its status bar")
            clocks.append(int(re.findall(r"(\d+)m(\d\d)s", shown)[-1][1]))
        second, first = runs.list_runs(runs_dir)  # newest first
        assert (first.name, second.name) == (NAME, f"{NAME}-2")
        assert max(clocks) < 8, f"the clock starts at Start, not at Preview 8 s before: {clocks} s"

        def phase_or_end():
            text = status(page).lower()
            phases.update(p for p in ("loading model and data", "waiting for replicas") if p in text)
            return page.evaluate("document.querySelector('#hfd-status')?.dataset.status") == "stopped"

        wait_for(phase_or_end, 240, "the selected (second) run to stop", every=0.3)
        assert phases, "the status bar shows the start-up phase the run records"
        page.get_by_role("tab", name="Runs").click()
        exactly = re.compile(rf"^\s*{re.escape(first.name)}\s*$")  # not the second run, whose name extends it
        page.locator("#runs-table [role=gridcell]").filter(has_text=exactly).first.click()
        wait_for(lambda: first.name in status(page) and second.name not in status(page), 20,
                 "the first run selected")
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'stopped'",
                               timeout=240_000)
        page.screenshot(path=str(ARTIFACTS / "app-ddp-stopped.png"), full_page=True)
        page.reload()
        page.get_by_text("Preview command").wait_for(timeout=60_000)
        wait_for(lambda: page.locator("#knob-max_steps input, #knob-max_steps textarea").first.input_value()
                 == "400", 30, "the form refilled from the run")
        name_box = page.locator(NAME_BOX).first
        wait_for(lambda: name_box.get_attribute("placeholder") == NAME, 20, "the default name after the reload")
        assert name_box.input_value() == ""
        # The runs got rendezvous ports the app chose; the reloaded form leaves them out, so a torchft recipe
        # (whose replicas meet through its Lighthouse, not a port) starts from it.
        assert " --main_process_port " in " ".join(runs.list_runs(runs_dir)[0].command)
        page.locator("#recipe input").click()
        page.get_by_role("option", name="torchft-3.yaml").click()
        wait_for(lambda: page.locator("#config input").input_value() == "torchft-replica.yaml", 10,
                 "the torchft replica config to be chosen")
        page.get_by_text("Distributed settings").click()
        for knob in ("main_process_port", "main_process_ip", "num_machines", "machine_rank"):
            assert page.locator(f"#knob-{knob} input, #knob-{knob} textarea").first.input_value() == "", knob
        client = connect(url)
        wrong = client.predict("", "torchft-3.yaml", "", "cpu-2proc.yaml", *knobs(replicas=2), api_name="/preview")[1]
        assert wrong.startswith("**Cannot start:**") and "use accelerate_configs/torchft-replica.yaml" in wrong
        fill(page, "knob-model_name_or_path", "")
        fill(page, "knob-replicas", "2")
        fill(page, "knob-inner_steps", "5")
        fill(page, "knob-max_steps", "400")
        page.click("#preview")
        page.get_by_text("Form is valid").wait_for(timeout=60_000)
        previewed = page.locator("#command").inner_text()
        assert " -m hf_diloco.cli launch " in previewed and " --replicas 2 --max-restarts 3 " in previewed, previewed
        assert "accelerate_configs/torchft-replica.yaml" in previewed and "--main_process_port" not in previewed
        page.click("#start")
        page.locator("#form-message").get_by_text("Started").wait_for(timeout=60_000)
        run = runs.list_runs(runs_dir)[0]
        assert run.id not in (first.id, second.id) and run.status == "running"
        assert " ".join(run.command) in " ".join(previewed.split()), "Start runs exactly the previewed command"
        page.get_by_role("tab", name="Live").click()
        assert page.locator("#membership").count() == 0, "no membership table before the first round"
        rows = page.locator("#membership .virtual-row")
        wait_for(lambda: page.locator("#membership").count() and rows.count() >= 2, 120, "two membership rows")
        headers = page.locator("#membership thead").inner_text()
        assert "replica 0" in headers and "replica 1" in headers and "replica 2" not in headers, headers
        assert rows.first.inner_text().count("✓ 5 steps") == 2, rows.first.inner_text()
        page.screenshot(path=str(ARTIFACTS / "app-membership.png"), full_page=True)

        page.click("#stop")
        page.wait_for_function("document.querySelector('#hfd-status')?.dataset.status === 'stopped'",
                               timeout=90_000)
        output = Path(run.output_dir)
        recorded = {r["round"] for k in (0, 1) for r in read_syncs(output / f"replica-{k}")}
        wait_for(lambda: rows.count() == len(recorded), 10, f"{len(recorded)} rows, one per recorded round")
        assert rows.first.inner_text().split()[0] == str(max(recorded)), "newest round first"
        assert not (output / "syncs.jsonl").exists() and (output / "replica-1" / "syncs.jsonl").exists()
        both = [r for r in read_syncs(output / "replica-0") if r["participants"] == 2]
        client.predict(api_name="/reattach")  # what a page load shows: the run list, for this client too
        live = client.predict(run.id, api_name="/refresh")
        rounds = table(live[6])
        shown = {row[0]: row for row in rounds["data"]}
        assert [row[0] for row in rounds["data"]] == sorted(shown, reverse=True), "newest first, once each"
        assert all(shown[r["round"]][1] == r["step"] and shown[r["round"]][3] == round(r["loss"], 4) for r in both)
        membership = table(live[8])
        assert membership["headers"] == ["round", "step", "participants", "committed", "replica 0", "replica 1"]
        cells = {row[0]: row for row in membership["data"]}
        assert all(cells[r["round"]] == [r["round"], r["step"], 2, "yes", *(f"✓ {m['steps']} steps" for m in
                                                                             r["replicas"])] for r in both)
        assert "2 of 2 replicas" in live[0]
        assert table(live[11])["data"][0][:5] == [run.id, "stopped", "diloco", "5", "2"]
        card = client.predict(run.id, "alice/elastic", api_name="/card")[0]
        assert "## DiLoCo settings" in card, "the card is written from a replica's folder"
        page.reload()  # the form is refilled from the run: its replica count and config
        replicas = page.locator("#knob-replicas input, #knob-replicas textarea").first
        wait_for(lambda: replicas.input_value() == "2", 30, "the replicas knob refilled")
        assert page.locator("#config input").input_value() == "torchft-replica.yaml"
    stopped = [json.loads((Path(run.output_dir) / f"replica-{k}" / runs.STOPPED_FILE).read_text()) for k in (0, 1)]
    assert stopped[0]["step"] == stopped[1]["step"] < 400 and runs.training_pids(runs.load(run.folder)) == []
    for ddp in (first, second):
        ddp = runs.load(ddp.folder)
        stopped = json.loads((Path(ddp.output_dir) / runs.STOPPED_FILE).read_text())
        assert ddp.status == "stopped" and stopped["step"] < 400, (ddp.status, stopped)
        assert (Path(ddp.output_dir) / stopped["checkpoint"]).is_dir(), stopped
        assert runs.training_pids(ddp) == []
