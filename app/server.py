"""The Gradio app: a control room for DiLoCo runs.

Layout, top to bottom: the selected run's status and progress (always visible), the run picker with Stop, then
tabs: Launch (run name, recipe, accelerate config, main knobs, distributed settings, Preview/Start), Live
(per-replica loss, held-out loss, pseudo-gradient norms, replica agreement, bytes vs DDP on a log scale, sync vs
compute time, sync table, for a torchft run the membership of each sync, log tail that follows its newest line),
Runs (every run on disk; click a row to select it), Compare (held-out loss of several runs against tokens and
against bytes sent, and a table) and Push to Hub.

Design choices:
- The app holds no run state in memory: runs are folders (hf_diloco.runs), so several runs can exist, a page
  reload re-attaches to the newest active run and refills the form, and a restarted app finds everything again.
- Preview and Start share one plan: Start runs exactly the command Preview showed (same run id and output folder)
  unless the form changed in between, in which case it plans again. Run ids come from the run name, so planning
  at Preview does not start the run's clock; Start does. Start stays available while other runs train.
- Every figure is a Plotly figure in a gr.Plot (one library for Live and Compare; bytes need a log axis, which
  Gradio's native plots lack), each series in the colour it has everywhere, the model card's curve included. A
  refresh sends figures only when a sync, a logged loss or the run's status is new.
- Knobs are checked as they are typed; model and dataset paths are checked by Preview and Start.
- Validation runs as an `hf-diloco` subprocess and pushing in the app's process through hf_diloco.hub; the app
  never imports torch.
- Binds 127.0.0.1 unless --host says otherwise; every request needs the key of this start of the app and a host
  the app answers to (app.guard); --auth (or HF_DILOCO_APP_AUTH) also asks for a user and password; no
  share link unless --share. A token typed into the push form goes to
  huggingface_hub only.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, fields
from pathlib import Path

import gradio as gr
from starlette.middleware import Middleware

from app import forms, guard, views
from hf_diloco import runs
from hf_diloco.checks import TRAINERS
from hf_diloco.errors import ConfigError
from hf_diloco.launch import free_port
from hf_diloco.tasks import TASKS

KNOB_LABELS = {
    "replicas": "Replicas (blank: the config's; each starts the recipe's replica_group_size processes)",
    "inner_steps": "H: inner steps between syncs (or auto)",
    "outer_lr": "Outer learning rate", "outer_momentum": "Outer momentum", "max_steps": "Max steps",
    "model_name_or_path": "Model preset or path", "dataset_name": "Dataset (builtin, file, folder or Hub id)",
    "task": "Task (what the model learns; each task's preset: tiny-t5, tiny-bert, tiny-vit)",
    "trainer": "Trainer (ddp: the data-parallel baseline of the same recipe, TRL's trainer kept for sft and dpo)",
    "num_machines": "Machines", "machine_rank": "This machine's rank", "main_process_ip": "Main machine address",
    "main_process_port": "Main machine port",
    "restarts": "Restarts per replica (torchft; blank: 3)",
}
DEFAULT_CONFIG = "cpu-2proc.yaml"
PLOTS = ("loss", "norm", "agreement", "bytes", "time")
DISTRIBUTED = ("num_machines", "machine_rank", "main_process_ip", "main_process_port")
HOW_IT_WORKS = (
    "**How DiLoCo works.** Each *replica* (a copy of the model on its own processes) trains alone for *H* inner "
    "steps with its own optimizer: a *round*. Then comes a *sync*: every replica sends its *pseudo-gradient* (how "
    "far its weights moved in those H steps), the replicas average them, and an outer optimizer (Nesterov momentum "
    "by default) moves the shared weights by that average. Replicas talk once per round instead of once per step, so "
    "they send about H times fewer bytes than data-parallel training."
)
GLOSSARY = """
**Reading these plots**
- **replica**: one copy of the model and its data shard; replica *i* has the same colour in every Live plot and in the
  model card.
- **round**: *H* inner steps and the sync they end with. **sync**: one exchange of pseudo-gradients and the outer
  step. With streaming fragments each sync carries one fragment and a round holds one sync per fragment (the status
  bar counts rounds; the table has a row per sync).
- **pseudo-gradient Δ**: a replica's weights at its last sync minus its weights now; ‖Δ‖ is its size.
- **agreement**: the cosine between a replica's Δ and the averaged Δ; near 1, the replicas pull the same way.
- **blocked time**: seconds the inner loop waited for a sync; an overlapped sync hides its transfer behind compute.
- **held-out loss**: the loss of the averaged (global) model on data no replica trains on.
- **logged loss**: the loss Trainer logs every `logging_steps` steps on process 0, between syncs.
"""
CSS = """
.hfd-status {font-size: 1.05em; padding: 10px 14px; border-radius: 8px; background: #f3f4f6; color: #111827}
.hfd-badge {color: white; padding: 2px 10px; border-radius: 10px; font-weight: 600; text-transform: uppercase}
.hfd-status progress {width: 180px; vertical-align: middle}
"""


class App:
    """Callbacks of the page; everything they need is on disk under `runs_dir`. A run it starts reads a local model
    or dataset only from `data_dirs` (the folder the app started in by default)."""

    def __init__(self, runs_dir: Path, data_dirs: list[Path] | None = None):
        self.runs_dir = runs_dir.resolve()
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.readable = tuple(Path(d).expanduser().resolve() for d in (data_dirs or [Path.cwd()]))

    # --- runs -----------------------------------------------------------------------------------------------

    def run(self, run_id: str | None) -> runs.Run | None:
        if not run_id or "/" in run_id or run_id.startswith("."):
            return None
        return runs.load_folder(self.runs_dir / run_id) if (self.runs_dir / run_id).is_dir() else None

    def run_ids(self) -> list[str]:
        return [r.id for r in runs.list_runs(self.runs_dir)]

    # --- launch ---------------------------------------------------------------------------------------------

    def _plan(self, name, recipe_name, yaml_text, config_name, *knob_values) -> tuple[runs.Run, str | None]:
        """The run the form describes, checked as Start would check it, and the form's warning if it has one."""
        # Typed paths are accepted by the dropdowns; forms.allowed keeps them inside the project's folders.
        knobs = forms.Knobs(*[str(v if v is not None else "") for v in knob_values])
        recipe = forms.recipe_path(recipe_name, yaml_text or "", self.runs_dir)
        recipe_values = forms.check_recipe_keys(recipe, self.readable)
        note = forms.rounds_note(knobs, recipe_values)
        overrides, launch = forms.flags(knobs, self.readable, forms.group_size(recipe_values))
        replicas = forms.torchft_replicas(knobs, recipe_values)
        config = forms.config_path(config_name)
        typed = (name or "").strip()
        name = typed or forms.auto_name(recipe_name or "", knobs)
        port = None
        restarts = forms.restarts(knobs, replicas is not None)
        if replicas is not None:  # torchft: a Lighthouse and N replicas, which need no rendezvous port
            plan = runs.plan(self.runs_dir, str(recipe), str(config), overrides, name=name, replicas=replicas,
                             max_restarts=restarts)
        else:
            # Each run gets its own rendezvous port unless the form names one (a run over several machines needs
            # the port they agreed on: the form's, or the config's).
            single_machine = str(knobs.num_machines).strip() in ("", "1")
            port = free_port() if single_machine and not str(knobs.main_process_port).strip() else None
            plan = runs.plan(self.runs_dir, str(recipe), str(config), overrides, port=port, launch_args=launch,
                             name=name)
        if not typed:
            plan.name = plan.id  # a default name is made unique like the id: two runs are never named alike
        # Stored with the run, so a reload refills what the user chose, never a port or flag the app picked.
        plan.form = {key: value.strip() for key, value in asdict(knobs).items() if value.strip()}
        forms.validate(recipe, config, [*overrides, "--output_dir", plan.output_dir], replicas,
                       launch=[] if replicas is not None else launch, port=port, command=plan.command)
        return plan, note

    def default_name(self, recipe_name, *knob_values):
        """The run-name box's placeholder: the name a Start with a blank name gives, for the form as it is now."""
        knobs = forms.Knobs(*[str(v if v is not None else "") for v in knob_values])
        return gr.update(placeholder=forms.auto_name(recipe_name or "", knobs))

    def check(self, recipe_name, yaml_text, *knob_values):
        """The instant check of the form, run as the knobs are typed (forms.check_as_typed)."""
        try:
            note = forms.check_as_typed(forms.Knobs(*[str(v if v is not None else "") for v in knob_values]),
                                        recipe_name or "", yaml_text or "", self.runs_dir, self.readable)
        except forms.FormError as error:
            return f"**Cannot start:** {error}"
        return f"**Note:** {note}" if note else ""

    def preview(self, name, recipe_name, yaml_text, config_name, *knob_values):
        """Show the exact command Start will run, or why the form is wrong."""
        try:
            plan, note = self._plan(name, recipe_name, yaml_text, config_name, *knob_values)
        except (forms.FormError, ConfigError) as error:
            return "", f"**Cannot start:** {error}", None
        signature = [name, recipe_name, yaml_text, config_name, *knob_values]
        return command_text(plan.command), f"Form is valid. **Start** runs exactly this command as run " \
            f"**{plan.id}**." + (f" **Note:** {note}" if note else ""), {"plan": asdict(plan), "form": signature}

    def predict(self, recipe_name, yaml_text, config_name, link, latency_ms, speed, *knob_values):
        """What `hf-diloco plan` predicts for the form's recipe over the link typed in (blank link: nothing)."""
        if not str(link or "").strip():
            return ""
        knobs = forms.Knobs(*[str(v if v is not None else "") for v in knob_values])
        try:
            recipe = forms.recipe_path(recipe_name, yaml_text or "", self.runs_dir)
            prediction = forms.predict(recipe, forms.config_path(config_name), knobs,
                                       forms.check_recipe_keys(recipe, self.readable),
                                       str(link), str(latency_ms or ""), str(speed or ""))
        except (forms.FormError, ConfigError) as error:
            return f"**Cannot plan:** {error}"
        return views.plan_markdown(prediction)

    def start(self, planned, name, recipe_name, yaml_text, config_name, *knob_values):
        """Start the previewed plan (or plan again if the form changed or its run id was taken meanwhile)."""
        signature = [name, recipe_name, yaml_text, config_name, *knob_values]
        try:
            if planned and planned.get("form") == signature and not (self.runs_dir / planned["plan"]["id"]).exists():
                plan = runs.Run(**planned["plan"])
            else:
                plan, _ = self._plan(name, recipe_name, yaml_text, config_name, *knob_values)
        except (forms.FormError, ConfigError) as error:
            return f"**Cannot start:** {error}", gr.update(), "", None
        run = runs.start_planned(plan)
        return f"Started **{run.id}**.", gr.update(choices=self.run_ids(), value=run.id), \
            command_text(run.command), None

    def stop(self, run_id):
        run = self.run(run_id)
        if run is None or run.status not in runs.ACTIVE:
            return "Nothing to stop: select a running run."
        if run.found:
            return f"**{run.id}** was not started from the app: stop it where it was started (Ctrl-C stops it at " \
                f"the end of its round), or write the file {Path(run.output_dir) / runs.STOP_FILE}."
        runs.stop(run.folder)
        return f"Stopping **{run.id}**: it stops at the next sync (DiLoCo) or step (DDP), saves a " \
            "checkpoint and exits; the status turns to stopped once it has."

    def _recipe_file(self, recipe_name) -> Path | None:
        """A recipe by name (recipes/) or path (recipes/ or a draft under the runs folder)."""
        name = recipe_name or ""
        try:
            return forms.allowed(forms.RECIPES / name if "/" not in name else name, [forms.RECIPES, self.runs_dir],
                                 "recipe")
        except forms.FormError:
            return None

    def load_recipe(self, recipe_name):
        path = self._recipe_file(recipe_name)
        return path.read_text() if path else ""

    def config_for(self, recipe_name, config_name):
        """Choosing a torchft recipe picks the one-process-per-replica config; leaving one goes back to the default."""
        path = self._recipe_file(recipe_name)
        if path is not None and forms.is_torchft(path):
            return forms.TORCHFT_CONFIG
        return DEFAULT_CONFIG if config_name == forms.TORCHFT_CONFIG else gr.update()

    def recipe_source(self, recipe_name, yaml_text):
        """Which recipe the form holds: a recipe as shipped, a saved draft, or unsaved edits."""
        path = self._recipe_file(recipe_name)
        if path is None:
            return "Recipe: none chosen."
        shown = path.name if path.parent == forms.RECIPES else str(path.relative_to(self.runs_dir))
        kind = "saved draft" if path.is_relative_to(self.runs_dir) else "recipe"
        if (yaml_text or "").strip() and yaml_text.strip() != path.read_text().strip():
            return f"Recipe: **{shown}** with **unsaved edits** below (Start saves them as a new draft and runs it)."
        return f"Recipe: **{shown}** ({kind})."

    def select_row(self, table, event: gr.SelectData):
        """A click on a row of the Runs table selects that run."""
        row = event.index[0] if isinstance(event.index, (list, tuple)) else event.index
        try:
            run_id = table.iloc[row, 0] if hasattr(table, "iloc") else table["data"][row][0]
        except (IndexError, KeyError, TypeError):
            return gr.update()
        return gr.update(choices=self.run_ids(), value=run_id)

    # --- live view ------------------------------------------------------------------------------------------

    def refresh(self, run_id, drawn):
        run = self.run(run_id)
        rounds = views.read_rounds(run)
        trainer_log = views.read_trainer_log(run)
        active = run is not None and run.status in runs.ACTIVE and not run.found  # Stop: the runs it started
        count = views.replicas(run) if run is not None else ""
        membership = views.membership_rows(rounds, int(count) if count.isdigit() else 0,
                                           views.read_replica_states(run))
        replica_states = views.replica_rows(run)
        # The figures are drawn again only when there is something new to draw (a sync, a logged loss, the end).
        key = [run_id, len(rounds), len(trainer_log), run.status if run else None]
        figures = views.live_figures(run, rounds, trainer_log, views.read_summary(run)) if key != drawn else None
        plot = {name: figures[name] if figures else gr.skip() for name in PLOTS}
        return (
            views.status_html(run),
            plot["loss"],
            plot["norm"],
            plot["agreement"],
            plot["bytes"],
            plot["time"],
            views.round_rows(rounds),
            gr.update(value=replica_states, visible=not replica_states.empty),  # torchft runs only
            gr.update(value=membership, visible=not membership.empty),
            views.log_tail(run),
            views.tensorboard_hint(run),
            views.runs_table(runs.list_runs(self.runs_dir)),
            gr.update(interactive=active),  # Stop
            key,
        )

    def compare(self, run_ids):
        chosen = [run for run in (self.run(i) for i in run_ids or []) if run is not None]
        return views.compare_figure(chosen), views.compare_rows(chosen)

    def compare_choices(self):
        return gr.update(choices=self.run_ids())

    def reattach(self):
        """On page load: select the newest active run (else the newest) and refill the form from it: its recipe,
        config and the knobs the user filled in (stored with the run), nothing the app chose itself (a rendezvous
        port, the process count a replicas knob became)."""
        all_runs = runs.list_runs(self.runs_dir)
        chosen = next((r for r in all_runs if r.status in runs.ACTIVE), all_runs[0] if all_runs else None)
        form = [gr.update()] * (4 + len(fields(forms.Knobs)))
        if chosen is not None and chosen.recipe:  # a run whose run.json cannot be read names no recipe
            recipe = Path(chosen.recipe)
            knob_values = [chosen.form.get(f.name, "") for f in fields(forms.Knobs)]
            # A draft is shown as itself (its path under the runs folder), never as the recipe it was edited from.
            shown = recipe.name if recipe.parent == forms.RECIPES else str(recipe)
            # The name box stays blank, showing the default for the refilled form: a new Start is a new run, never
            # a second run under the old run's name.
            form = ["", shown if recipe.is_file() else gr.update(),
                    recipe.read_text() if recipe.is_file() else gr.update(), Path(chosen.accelerate_config).name,
                    *knob_values]
        return gr.update(choices=[r.id for r in all_runs], value=chosen.id if chosen else None), *form

    # --- push -----------------------------------------------------------------------------------------------

    def card(self, run_id, repo_id):
        from hf_diloco.hub import model_card, write_training_curve

        run = self.run(run_id)
        if run is None:
            return "Select a run first.", "", None
        output = views.lead_folder(run)  # a torchft run: a replica's folder (all end with the same model)
        curve = write_training_curve(output, Path(tempfile.mkdtemp()) / "curve.png")
        metadata, body = views.card_preview(model_card(output, repo_id or None))
        return body, metadata, str(curve) if curve else None

    def push(self, run_id, repo_id, private, token, merge_lora, message, unfinished,
             progress=gr.Progress()):  # noqa: B008 (Gradio injects it)
        """Push in this process with huggingface_hub (hf_diloco.hub imports no torch); the token goes to
        huggingface_hub only, never to a log, a file or the environment of another process."""
        from hf_diloco import hub

        run = self.run(run_id)
        if run is None:
            return "**Cannot push:** select a run first.", ""
        if run.status in runs.ACTIVE:
            return "**Cannot push:** the run is still going; stop it or wait for it to finish.", ""
        lines = []

        def report(line: str) -> None:
            lines.append(line.replace(token, "***") if token else line)
            progress(min(0.9, 0.3 * len(lines)), desc=lines[-1].removeprefix("[push] ")[:80])

        try:
            url = hub.push(views.lead_folder(run), repo_id, token=token or None, private=private,
                           merge_lora=merge_lora, commit_message=message or "Upload DiLoCo model",
                           allow_unfinished=unfinished, progress=report)
        except hub.UnfinishedRun as refused:
            how = hub.describe_outcome(refused.outcome)
            return f"**Not pushed:** this run {how}. Tick \"Push a run that did not finish\" to push it anyway; " \
                "its card will say how it ended.", "\n".join(lines)
        except ConfigError as error:
            return f"**Cannot push:** {error}", "\n".join(lines)
        except Exception as error:  # noqa: BLE001 (network and Hub errors: the reason, never a traceback)
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return f"**Push failed:** {reason.replace(token, '***') if token else reason}", "\n".join(lines)
        return f"Pushed: [{url}]({url})", "\n".join(lines)


FOLLOW_LOG = """() => {
  const box = document.querySelector('#log textarea');
  if (!box) return;
  if (!box.dataset.follow) {  // follow the newest line until the reader scrolls up; scrolling back down resumes
    box.dataset.follow = '1';
    box.addEventListener('scroll', () => {
      box.dataset.follow = box.scrollTop + box.clientHeight >= box.scrollHeight - 24 ? '1' : '0';
    });
  }
  if (box.dataset.follow === '1') box.scrollTop = box.scrollHeight;
}"""


def command_text(command: list[str]) -> str:
    """The command as one copyable shell line (for reading and copying; the app itself never uses a shell)."""
    import shlex

    return " ".join(shlex.quote(part) for part in command)


def build(runs_dir: Path, data_dirs: list[Path] | None = None) -> gr.Blocks:
    app = App(runs_dir, data_dirs)
    recipes, configs = forms.choices(forms.RECIPES), forms.choices(forms.CONFIGS)
    with gr.Blocks(title="hf-diloco") as page:
        gr.Markdown(HOW_IT_WORKS, elem_id="how-it-works")
        status = gr.HTML(views.status_html(None), elem_id="status")
        with gr.Row():
            run_select = gr.Dropdown(app.run_ids(), label="Run", scale=4, elem_id="run-select")
            stop_button = gr.Button("Stop (checkpoint at the next sync)", variant="stop", interactive=False,
                                    elem_id="stop", scale=1)
        stop_message = gr.Markdown(elem_id="stop-message")
        planned = gr.State(None)
        drawn = gr.State(None)
        with gr.Tabs():
            with gr.Tab("Launch", id="launch"):
                first = "tiny-pretrain.yaml" if "tiny-pretrain.yaml" in recipes else None
                name = gr.Textbox(label="Run name (blank: the recipe plus the knobs you changed, as shown)",
                                  elem_id="run-name", placeholder=forms.auto_name(first or "", forms.Knobs()))
                with gr.Row():
                    recipe = gr.Dropdown(recipes, value=first, label="Recipe", elem_id="recipe",
                                         allow_custom_value=True)
                    config = gr.Dropdown(configs, value=DEFAULT_CONFIG if DEFAULT_CONFIG in configs else None,
                                         label="Accelerate config", elem_id="config", allow_custom_value=True)
                recipe_note = gr.Markdown(app.recipe_source(first, app.load_recipe(first)), elem_id="recipe-source")
                knobs = {}
                with gr.Row():
                    for knob in ("replicas", "restarts", "inner_steps", "outer_lr", "outer_momentum", "max_steps"):
                        knobs[knob] = gr.Textbox(label=KNOB_LABELS[knob], elem_id=f"knob-{knob}")
                with gr.Row():
                    for knob in ("model_name_or_path", "dataset_name"):
                        knobs[knob] = gr.Textbox(label=KNOB_LABELS[knob], elem_id=f"knob-{knob}")
                    knobs["task"] = gr.Dropdown([("as in the recipe", ""), *((name, name) for name in TASKS)], value="",
                                                label=KNOB_LABELS["task"], elem_id="knob-task")
                    knobs["trainer"] = gr.Dropdown([("as in the recipe", ""), *((name, name) for name in TRAINERS)],
                                                   value="", label=KNOB_LABELS["trainer"], elem_id="knob-trainer")
                with gr.Accordion("Distributed settings (multi-node; blank = as in the accelerate config)", open=False):
                    with gr.Row():
                        for knob in DISTRIBUTED:
                            knobs[knob] = gr.Textbox(label=KNOB_LABELS[knob], elem_id=f"knob-{knob}")
                with gr.Accordion("Recipe YAML (edits are saved as a new draft under the runs folder)", open=False):
                    yaml_text = gr.Code(app.load_recipe(first), language="yaml", label="recipe", interactive=True,
                                        elem_id="recipe-yaml")
                form_message = gr.Markdown(elem_id="form-message")
                with gr.Row():
                    preview_button = gr.Button("Preview command", elem_id="preview")
                    start_button = gr.Button("Start a new run", variant="primary", elem_id="start")
                command = gr.Code(label="Command (exactly what Start runs)", language="shell", elem_id="command")
                with gr.Accordion("Across sites: Preview also predicts each round over this link (hf-diloco plan)",
                                  open=False):
                    with gr.Row():
                        link = gr.Textbox(label="Link between sites (e.g. 100mbit, 1gbit; blank: no prediction)",
                                          elem_id="plan-link")
                        latency = gr.Textbox(label="Latency per hop, ms (blank: 25)", elem_id="plan-latency")
                        speed = gr.Textbox(value="h100", label="GPU kind (h100, a100, ...) or measured tokens/s "
                                           "per replica", elem_id="plan-speed")
                    prediction = gr.Markdown(elem_id="plan")
            with gr.Tab("Live", id="live"):
                with gr.Row():
                    loss_plot = gr.Plot(label="Loss", elem_id="loss-plot")
                    bytes_plot = gr.Plot(label="Bytes", elem_id="bytes-plot")
                with gr.Row():
                    norm_plot = gr.Plot(label="Pseudo-gradient norm", elem_id="norm-plot")
                    agreement_plot = gr.Plot(label="Agreement", elem_id="agreement-plot")
                    time_plot = gr.Plot(label="Time", elem_id="time-plot")
                gr.Markdown(GLOSSARY, elem_id="glossary")
                rounds_table = gr.Dataframe(
                    headers=views.ROUND_COLUMNS, elem_id="rounds",
                    label="Syncs (newest first; one per round, or one per fragment with streaming)")
                replicas_table = gr.Dataframe(headers=views.REPLICA_COLUMNS, visible=False, elem_id="replicas",
                                              label="Replicas: each replica's process (a failed one is started "
                                                    "again and heals from the others)")
                membership_table = gr.Dataframe(headers=views.MEMBERSHIP_COLUMNS, visible=False,
                                                label="Membership: who took part in each sync (newest first)",
                                                elem_id="membership")
                tensorboard = gr.Markdown()
                log = gr.Textbox(label="Log (follows the newest line at the bottom)", lines=14, max_lines=14,
                                 autoscroll=False, elem_id="log")
            with gr.Tab("Runs", id="runs"):
                gr.Markdown("Click a run to select it.")
                all_runs = gr.Dataframe(label="Runs on disk", elem_id="runs-table", interactive=False)
            with gr.Tab("Compare", id="compare") as compare_tab:
                compared = gr.Dropdown([], multiselect=True, label="Runs to compare", elem_id="compare-select")
                compare_plot = gr.Plot(label="Held-out loss vs tokens and vs bytes sent", elem_id="compare-plot")
                compare_table = gr.Dataframe(headers=views.COMPARE_COLUMNS, label="Totals", elem_id="compare-table")
            with gr.Tab("Push to Hub", id="push"):
                with gr.Row():
                    repo_id = gr.Textbox(label="Repo id (owner/name)", elem_id="repo-id")
                    private = gr.Checkbox(label="Private", value=True)
                    merge = gr.Checkbox(label="Push merged model (LoRA runs)")
                    unfinished = gr.Checkbox(label="Push a run that did not finish (stopped or failed)",
                                             elem_id="push-unfinished")
                token = gr.Textbox(label="Token (blank: HF_TOKEN or your huggingface_hub login)", type="password")
                message = gr.Textbox(label="Commit message", value="Upload DiLoCo model")
                with gr.Row():
                    card_button = gr.Button("Preview model card")
                    push_button = gr.Button("Push", variant="primary", elem_id="push-button")
                push_result = gr.Markdown(elem_id="push-result")
                push_log = gr.Textbox(label="Push log", lines=4)
                with gr.Row():
                    with gr.Column():
                        card = gr.Markdown(elem_id="card")
                        with gr.Accordion("Card metadata (YAML)", open=False):
                            card_metadata = gr.Code(language="yaml", label="metadata")
                    curve = gr.Image(label="Training curve", type="filepath")

        knob_inputs = [knobs[f.name] for f in fields(forms.Knobs)]
        form = [name, recipe, yaml_text, config, *knob_inputs]
        live = [status, loss_plot, norm_plot, agreement_plot, bytes_plot, time_plot, rounds_table, replicas_table,
                membership_table,
                log, tensorboard, all_runs, stop_button, drawn]
        recipe.change(app.load_recipe, recipe, yaml_text, api_name=False)
        recipe.input(app.config_for, [recipe, config], config, api_name=False)
        yaml_text.change(app.recipe_source, [recipe, yaml_text], recipe_note, api_name=False)
        for box in knob_inputs:
            box.change(app.check, [recipe, yaml_text, *knob_inputs], form_message, api_name=False)
        for box in (recipe, *knob_inputs):
            box.change(app.default_name, [recipe, *knob_inputs], name, api_name=False)
        preview_button.click(app.preview, form, [command, form_message, planned], api_name="preview").then(
            app.predict, [recipe, yaml_text, config, link, latency, speed, *knob_inputs], prediction,
            api_name="predict")
        start_button.click(app.start, [planned, *form], [form_message, run_select, command, planned],
                           api_name="start")
        stop_button.click(app.stop, run_select, stop_message, api_name="stop")
        run_select.change(app.refresh, [run_select, drawn], live, api_name=False).then(None, js=FOLLOW_LOG)
        gr.Timer(2.0).tick(app.refresh, [run_select, drawn], live, api_name="refresh").then(None, js=FOLLOW_LOG)
        all_runs.select(app.select_row, all_runs, run_select, api_name=False)
        compare_tab.select(app.compare_choices, None, compared, api_name=False)
        compared.change(app.compare, compared, [compare_plot, compare_table], api_name="compare")
        card_button.click(app.card, [run_select, repo_id], [card, card_metadata, curve], api_name="card")
        push_button.click(app.push, [run_select, repo_id, private, token, merge, message, unfinished],
                          [push_result, push_log],
                          api_name="push")
        page.load(app.reattach, None, [run_select, *form], api_name="reattach")
    return page


def serve(host: str = "127.0.0.1", port: int = 7860, runs_dir: Path = Path("runs"), auth: str | None = None,
          share: bool = False, data_dirs: list[Path] | None = None) -> int:
    credentials = None
    if auth:
        if ":" not in auth:
            print("hf-diloco: error: --auth must look like user:password.", file=sys.stderr)
            return 2
        credentials = tuple(auth.split(":", 1))
    elif share or host not in ("127.0.0.1", "localhost", "::1"):
        # The app starts processes on this machine: nobody else reaches it without a password.
        exposure = "a public share link" if share else f"--host {host}"
        print(f"hf-diloco: error: {exposure} lets others start runs on this machine; add --auth user:password "
              f"(or set HF_DILOCO_APP_AUTH).", file=sys.stderr)
        return 2
    key, key_path = guard.draw_key(runs_dir, port)
    shown = f"[{host}]" if ":" in host else ("127.0.0.1" if host in guard.WIDE else host)
    print(f"hf-diloco app: open http://{shown}:{port}/?key={key}\n"
          f"  (the key is in {key_path}, readable only by you; every page and API call needs it)", flush=True)
    middleware = [Middleware(guard.Guard, key=key, key_path=key_path, host=host, port=port, check_host=not share)]
    build(runs_dir, data_dirs).launch(server_name=host, server_port=port, auth=credentials, share=share, css=CSS,
                           show_error=True, app_kwargs={"middleware": middleware})
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m app.server`, what `hf-diloco app` becomes: its flags (the CLI documents them and passes them all),
    the password from HF_DILOCO_APP_AUTH, never from the command line (which every user of the machine can read)."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="hf-diloco app", allow_abbrev=False)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--runs-dir", required=True)
    parser.add_argument("--share", action="store_true")
    parser.add_argument("--data-dir", action="append", type=Path, default=[])
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.data_dir if not d.expanduser().is_dir()]
    if missing:
        print(f"hf-diloco: error: --data-dir {missing[0]} is not a folder.", file=sys.stderr)
        return 2
    return serve(host=args.host, port=args.port, runs_dir=Path(args.runs_dir),
                 auth=os.environ.get("HF_DILOCO_APP_AUTH") or None, share=args.share, data_dirs=args.data_dir)


if __name__ == "__main__":
    sys.exit(main())
