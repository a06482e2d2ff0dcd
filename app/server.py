"""The Gradio app: a control room for DiLoCo runs.

Layout, top to bottom: the selected run's status and progress (always visible), the run picker with Stop, then
tabs: Launch (recipe, accelerate config, main knobs, distributed settings, Preview/Start), Live (per-replica loss,
eval loss, pseudo-gradient norms, replica agreement, bytes vs DDP, sync vs compute time, round table, log tail),
Runs (every run on disk) and Push to Hub.

Design choices:
- The app holds no run state in memory: runs are folders (hf_diloco.runs), so several runs can exist, a page
  reload re-attaches to the newest active run and refills the form, and a restarted app finds everything again.
- Preview and Start share one plan: Start runs exactly the command Preview showed (same run id and output folder)
  unless the form changed in between, in which case it plans again.
- Long work (validation, pushing) runs as `hf-diloco` subprocesses; the app never imports torch.
- Binds 127.0.0.1 unless --host says otherwise; --auth (or HF_DILOCO_APP_AUTH) asks for a user and password; no
  share link unless --share. Tokens typed into the push form go to the push process's environment only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import gradio as gr

from app import forms, views
from hf_diloco import runs
from hf_diloco.errors import ConfigError

KNOB_LABELS = {
    "replicas": "Replicas (processes; blank = config)", "inner_steps": "H: inner steps between syncs",
    "outer_lr": "Outer learning rate", "outer_momentum": "Outer momentum", "max_steps": "Max steps",
    "model_name_or_path": "Model preset or path", "dataset_name": "Dataset (builtin, file, folder or Hub id)",
    "num_machines": "Machines", "machine_rank": "This machine's rank", "main_process_ip": "Main machine address",
    "main_process_port": "Main machine port",
}
DISTRIBUTED = ("num_machines", "machine_rank", "main_process_ip", "main_process_port")
CSS = """
.hfd-status {font-size: 1.05em; padding: 10px 14px; border-radius: 8px; background: #f3f4f6; color: #111827}
.hfd-badge {color: white; padding: 2px 10px; border-radius: 10px; font-weight: 600; text-transform: uppercase}
.hfd-status progress {width: 180px; vertical-align: middle}
"""


class App:
    """Callbacks of the page; everything they need is on disk under `runs_dir`."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir.resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)

    # --- runs -----------------------------------------------------------------------------------------------

    def run(self, run_id: str | None) -> runs.Run | None:
        if not run_id or "/" in run_id or run_id.startswith("."):
            return None
        folder = self.runs_dir / run_id
        return runs.load(folder) if (folder / runs.RUN_FILE).exists() else None

    def run_ids(self) -> list[str]:
        return [r.id for r in runs.list_runs(self.runs_dir)]

    # --- launch ---------------------------------------------------------------------------------------------

    def _plan(self, recipe_name, yaml_text, config_name, *knob_values) -> runs.Run:
        # Typed paths are accepted by the dropdowns; forms.allowed keeps them inside the project's folders.
        knobs = forms.Knobs(*[str(v if v is not None else "") for v in knob_values])
        recipe = forms.recipe_path(recipe_name, yaml_text or "", self.runs_dir)
        config = forms.config_path(config_name)
        overrides, launch = forms.flags(knobs)
        plan = runs.plan(self.runs_dir, str(recipe), str(config), overrides, launch_args=launch)
        forms.validate(recipe, config, [*overrides, "--output_dir", plan.output_dir])
        return plan

    def preview(self, recipe_name, yaml_text, config_name, *knob_values):
        """Show the exact command Start will run, or why the form is wrong."""
        try:
            plan = self._plan(recipe_name, yaml_text, config_name, *knob_values)
        except (forms.FormError, ConfigError) as error:
            return "", f"**Cannot start:** {error}", None
        signature = [recipe_name, yaml_text, config_name, *knob_values]
        return command_text(plan.command), "Form is valid. **Start** runs exactly this command.", \
            {"plan": asdict(plan), "form": signature}

    def start(self, planned, recipe_name, yaml_text, config_name, *knob_values):
        """Start the previewed plan (or plan again if the form changed)."""
        signature = [recipe_name, yaml_text, config_name, *knob_values]
        try:
            if planned and planned.get("form") == signature and not self.run(planned["plan"]["id"]):
                plan = runs.Run(**planned["plan"])
            else:
                plan = self._plan(recipe_name, yaml_text, config_name, *knob_values)
        except (forms.FormError, ConfigError) as error:
            return f"**Cannot start:** {error}", gr.update(), "", None
        run = runs.start_planned(plan)
        return f"Started **{run.id}**.", gr.update(choices=self.run_ids(), value=run.id), \
            command_text(run.command), None

    def stop(self, run_id):
        run = self.run(run_id)
        if run is None or run.status not in runs.ACTIVE:
            return "Nothing to stop: select a running run."
        runs.stop(run.folder)
        return f"Stopping **{run.id}**: it finishes the current round, saves a checkpoint and exits."

    def load_recipe(self, recipe_name):
        try:
            return forms.allowed(forms.RECIPES / recipe_name, [forms.RECIPES], "recipe").read_text()
        except forms.FormError:
            return ""

    # --- live view ------------------------------------------------------------------------------------------

    def refresh(self, run_id):
        run = self.run(run_id)
        rounds = views.read_rounds(run)
        active = run is not None and run.status in runs.ACTIVE
        return (
            views.status_html(run),
            views.replica_loss_frame(rounds),
            views.norm_frame(rounds),
            views.agreement_frame(rounds),
            views.bytes_frame(rounds),
            views.time_frame(rounds),
            views.round_rows(rounds),
            views.log_tail(run),
            views.tensorboard_hint(run),
            views.runs_table(runs.list_runs(self.runs_dir)),
            gr.update(interactive=not active),  # Start: not while the selected run is active
            gr.update(interactive=active),  # Stop
        )

    def reattach(self):
        """On page load: select the newest active run (else the newest) and refill the form from it."""
        all_runs = runs.list_runs(self.runs_dir)
        chosen = next((r for r in all_runs if r.status in runs.ACTIVE), all_runs[0] if all_runs else None)
        form = [gr.update()] * (3 + len(fields(forms.Knobs)))
        if chosen is not None:
            recipe = Path(chosen.recipe)
            values = dict(zip(chosen.overrides[::2], chosen.overrides[1::2], strict=False))
            launch = chosen.command[chosen.command.index("--config_file") + 2: chosen.command.index("-m", 3)]
            launch_values = dict(zip(launch[::2], launch[1::2], strict=False))
            knob_values = [launch_values.get(forms.LAUNCH_FIELDS[f.name], "") if f.name in forms.LAUNCH_FIELDS
                           else values.get(f"--{f.name}", "") for f in fields(forms.Knobs)]
            form = [recipe.name if recipe.parent == forms.RECIPES else gr.update(), recipe.read_text()
                    if recipe.exists() else gr.update(), Path(chosen.accelerate_config).name, *knob_values]
        return gr.update(choices=[r.id for r in all_runs], value=chosen.id if chosen else None), *form

    # --- push -----------------------------------------------------------------------------------------------

    def card(self, run_id, repo_id):
        from hf_diloco.hub import model_card, write_training_curve

        run = self.run(run_id)
        if run is None:
            return "Select a run first.", None
        output = Path(run.output_dir)
        curve = write_training_curve(output, Path(tempfile.mkdtemp()) / "curve.png")
        return model_card(output, repo_id or None), str(curve) if curve else None

    def push(self, run_id, repo_id, private, token, merge_lora, message, progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
        from hf_diloco.hub import check_repo_id

        run = self.run(run_id)
        if run is None:
            return "**Cannot push:** select a run first.", ""
        if run.status in runs.ACTIVE:
            return "**Cannot push:** the run is still going; stop it or wait for it to finish.", ""
        try:
            check_repo_id(repo_id)
        except ConfigError as error:
            return f"**Cannot push:** {error}", ""
        env = dict(os.environ)
        if token:
            env["HF_TOKEN"] = token  # the push process's environment only: never on a command line or on disk
        command = [sys.executable, "-m", "hf_diloco.cli", "push", run.output_dir, "--repo-id", repo_id.strip(),
                   "--commit-message", message or "Upload DiLoCo model"]
        command += ["--private"] if private else []
        command += ["--merge-lora"] if merge_lora else []
        progress(0.1, desc="Uploading")
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=forms.PROJECT, timeout=3600)
        log = "\n".join(line for line in result.stdout.splitlines() if line.startswith("[push]"))
        if token:
            log = log.replace(token, "***")
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if line.startswith("hf-diloco: error:")]
            reason = errors[-1].removeprefix("hf-diloco: error: ") if errors else "see the server log"
            return f"**Push failed:** {reason.replace(token, '***') if token else reason}", log
        url = next((line.split("done: ", 1)[1] for line in log.splitlines() if "done: " in line), "")
        return f"Pushed: [{url}]({url})", log


def command_text(command: list[str]) -> str:
    """The command as one copyable shell line (for reading and copying; the app itself never uses a shell)."""
    import shlex

    return " ".join(shlex.quote(part) for part in command)


def build(runs_dir: Path) -> gr.Blocks:
    app = App(runs_dir)
    recipes, configs = forms.choices(forms.RECIPES), forms.choices(forms.CONFIGS)
    with gr.Blocks(title="hf-diloco") as page:
        status = gr.HTML(views.status_html(None), elem_id="status")
        with gr.Row():
            run_select = gr.Dropdown(app.run_ids(), label="Run", scale=4, elem_id="run-select")
            stop_button = gr.Button("Stop (checkpoint at round end)", variant="stop", interactive=False,
                                    elem_id="stop", scale=1)
        stop_message = gr.Markdown()
        planned = gr.State(None)
        with gr.Tabs():
            with gr.Tab("Launch", id="launch"):
                with gr.Row():
                    recipe = gr.Dropdown(recipes, value="tiny-pretrain.yaml" if "tiny-pretrain.yaml" in recipes
                                         else None, label="Recipe", elem_id="recipe", allow_custom_value=True)
                    config = gr.Dropdown(configs, value="cpu-2proc.yaml" if "cpu-2proc.yaml" in configs else None,
                                         label="Accelerate config", elem_id="config", allow_custom_value=True)
                knobs = {}
                with gr.Row():
                    for name in ("replicas", "inner_steps", "outer_lr", "outer_momentum", "max_steps"):
                        knobs[name] = gr.Textbox(label=KNOB_LABELS[name], elem_id=f"knob-{name}")
                with gr.Row():
                    for name in ("model_name_or_path", "dataset_name"):
                        knobs[name] = gr.Textbox(label=KNOB_LABELS[name], elem_id=f"knob-{name}")
                with gr.Accordion("Distributed settings (multi-node; blank = as in the accelerate config)", open=False):
                    with gr.Row():
                        for name in DISTRIBUTED:
                            knobs[name] = gr.Textbox(label=KNOB_LABELS[name], elem_id=f"knob-{name}")
                with gr.Accordion("Recipe YAML (edits are saved as a new recipe under the runs folder)", open=False):
                    yaml_text = gr.Code(app.load_recipe(recipe.value) if recipe.value else "", language="yaml",
                                        label="recipe", interactive=True)
                form_message = gr.Markdown(elem_id="form-message")
                with gr.Row():
                    preview_button = gr.Button("Preview command", elem_id="preview")
                    start_button = gr.Button("Start", variant="primary", elem_id="start")
                command = gr.Code(label="Command (exactly what Start runs)", language="shell", elem_id="command")
            with gr.Tab("Live", id="live"):
                with gr.Row():
                    loss_plot = gr.LinePlot(x="step", y="loss", color="replica", title="Inner loss per replica, "
                                            "held-out loss of the global model", height=280)
                    bytes_plot = gr.LinePlot(x="step", y="MB", color="traffic", title="MB sent per replica vs DDP",
                                             height=280)
                with gr.Row():
                    norm_plot = gr.LinePlot(x="round", y="norm", color="of", title="Pseudo-gradient norm", height=250)
                    agreement_plot = gr.LinePlot(x="round", y="cosine", color="replica",
                                                 title="Agreement: cos(Δ_replica, Δ_mean)", height=250)
                    time_plot = gr.BarPlot(x="round", y="seconds", color="part", title="Compute vs sync time",
                                           height=250)
                rounds_table = gr.Dataframe(headers=views.ROUND_COLUMNS, label="Rounds (newest first)",
                                            elem_id="rounds")
                tensorboard = gr.Markdown()
                log = gr.Textbox(label="Log (newest at the bottom)", lines=14, max_lines=14, autoscroll=True,
                                 elem_id="log")
            with gr.Tab("Runs", id="runs"):
                all_runs = gr.Dataframe(label="Runs on disk", elem_id="runs-table")
            with gr.Tab("Push to Hub", id="push"):
                with gr.Row():
                    repo_id = gr.Textbox(label="Repo id (owner/name)", elem_id="repo-id")
                    private = gr.Checkbox(label="Private", value=True)
                    merge = gr.Checkbox(label="Push merged model (LoRA runs)")
                token = gr.Textbox(label="Token (blank: HF_TOKEN or your huggingface_hub login)", type="password")
                message = gr.Textbox(label="Commit message", value="Upload DiLoCo model")
                with gr.Row():
                    card_button = gr.Button("Preview model card")
                    push_button = gr.Button("Push", variant="primary", elem_id="push-button")
                push_result = gr.Markdown(elem_id="push-result")
                push_log = gr.Textbox(label="Push log", lines=4)
                with gr.Row():
                    card = gr.Markdown()
                    curve = gr.Image(label="Training curve", type="filepath")

        form = [recipe, yaml_text, config, *[knobs[f.name] for f in fields(forms.Knobs)]]
        live = [status, loss_plot, norm_plot, agreement_plot, bytes_plot, time_plot, rounds_table, log, tensorboard,
                all_runs, start_button, stop_button]
        recipe.change(app.load_recipe, recipe, yaml_text, api_name=False)
        preview_button.click(app.preview, form, [command, form_message, planned], api_name="preview")
        start_button.click(app.start, [planned, *form], [form_message, run_select, command, planned],
                           api_name="start")
        stop_button.click(app.stop, run_select, stop_message, api_name="stop")
        run_select.change(app.refresh, run_select, live, api_name=False)
        gr.Timer(2.0).tick(app.refresh, run_select, live, api_name="refresh")
        card_button.click(app.card, [run_select, repo_id], [card, curve], api_name="card")
        push_button.click(app.push, [run_select, repo_id, private, token, merge, message], [push_result, push_log],
                          api_name="push")
        page.load(app.reattach, None, [run_select, *form], api_name=False)
    return page


def serve(host: str = "127.0.0.1", port: int = 7860, runs_dir: Path = Path("runs"), auth: str | None = None,
          share: bool = False) -> int:
    credentials = None
    if auth:
        if ":" not in auth:
            print("hf-diloco: error: --auth must look like user:password.", file=sys.stderr)
            return 2
        credentials = tuple(auth.split(":", 1))
    elif host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: the app is reachable on {host} without --auth", file=sys.stderr)
    build(runs_dir).launch(server_name=host, server_port=port, auth=credentials, share=share, css=CSS,
                           show_error=True)
    return 0
