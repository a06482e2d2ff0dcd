"""`hf-diloco`: train from a recipe, launch replicas with accelerate, run the demo.

    hf-diloco train --config recipes/tiny-pretrain.yaml [--field value ...]   # this process is one replica
    hf-diloco launch recipes/tiny-pretrain.yaml --accelerate-config accelerate_configs/cpu-2proc.yaml [-- --field v]
    hf-diloco slurm recipes/tiny-pretrain.yaml --accelerate-config accelerate_configs/multi-gpu.yaml --nodes 4
    hf-diloco demo                                                              # 2 CPU replicas, tiny model

Design choices:
- Recipes are YAML files whose keys are DiLoCoConfig / RunArguments fields; flags override them. Both go through
  HfArgumentParser, so every field's help text is its `--help` and its documentation.
- Errors a user can cause end in one sentence on stderr and exit status 2, never a traceback.
- `launch` validates the recipe, the accelerate config, the model and the data in this process before starting
  anything, as a dry run does; bad input only a worker can find ends the launch with the worker's sentence, once,
  exit status 2, and is never restarted (hf_diloco.launch.Launch).
- A command is printed with its Hub token as `***` (hf_diloco.launch.redact); the processes run get the token in
  their environment, not on their command lines (hf_diloco.launch.Launch).
- This module parses and prints; what starts and watches processes (launches, torchft replicas, the Lighthouse,
  SLURM jobs, a worker's exit) is hf_diloco.launch's and hf_diloco.slurm's. The app is started as a program of its
  own (`python -m app.server`): the library never imports it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from . import launch
from . import train as training
from .checks import require_lighthouse
from .errors import ConfigError, RunError, first_line
from .recipes import CLIError, Parser, field_parser, parse_train_args
from .runs import accelerate_command

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_RECIPE = REPO_ROOT / "recipes" / "tiny-pretrain.yaml"
DEMO_ACCELERATE_CONFIG = REPO_ROOT / "accelerate_configs" / "cpu-2proc.yaml"


# --- argument parsing -----------------------------------------------------------------------------------------------


# --- commands -------------------------------------------------------------------------------------------------------


def cmd_train(args: argparse.Namespace) -> int:
    run, config = parse_train_args(args.config, args.overrides)
    if run.dry_run:
        print_plan(training.dry_run_plan(run, config))
        return 0
    require_lighthouse(config)
    import torch  # (here, not at the top: a refusal or a dry run answers without the seconds torch takes to load)

    try:
        trainer = training.train(run, config)
    except torch.OutOfMemoryError as error:
        raise RunError(out_of_memory(config, error)) from None
    if trainer.is_world_process_zero():
        print(f"[diloco] finished: model and metrics in {config.output_dir}", flush=True)
    return 0


def out_of_memory(config, error: Exception) -> str:
    """The sentence for a run that ran out of accelerator memory: what to change, most effective first."""
    advice = [f"lower per_device_train_batch_size (now {config.per_device_train_batch_size}; raise "
              f"gradient_accumulation_steps to keep the batch)"]
    if not config.gradient_checkpointing:
        advice.append("set gradient_checkpointing: true")
    if not config.offload_outer_state:
        advice.append("set offload_outer_state: true (θ_global and the outer optimizer in CPU memory)")
    advice.append("shard the model inside each replica (replica_group_size with fsdp: true)")
    return (f"out of memory ({first_line(error)}): {'; or '.join(advice)}. `--dry-run` prints the memory each "
            f"process needs for its parameters and optimizer states.")


def print_plan(plan: dict[str, str]) -> None:
    width = max(map(len, plan))
    print("hf-diloco dry run: nothing was downloaded or trained")
    for key, value in plan.items():
        print(f"  {key:<{width}}  {value}")


def cmd_launch(args: argparse.Namespace) -> int:
    run, config = parse_train_args(args.recipe, args.overrides, checking_only=args.dry_run)  # fail before starting
    launch_args = launch_args_of(args)
    values = launch.check_launch(run, config, args.accelerate_config, processes=args.num_processes,
                                 machines=args.num_machines, rank=args.machine_rank, dry_run=run.dry_run)
    if args.max_restarts < 0:
        raise CLIError(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
    if config.outer_backend == "torchft":
        return launch_torchft(args, config)
    if args.replicas:
        raise CLIError("--replicas starts torchft replicas; set outer_backend: torchft (the torch backend takes its "
                       "replica count from the accelerate config).")
    command = accelerate_command(args.recipe, args.accelerate_config, args.overrides, args.port, launch_args)
    if args.dry_run:  # the plan for the accelerate config's layout (replicas, memory per process, bytes per
        layout = values["hf_diloco_layout"]  # round), then the command, last, as it would run
        print_plan(training.dry_run_plan(run, config, processes=layout["processes"], group=layout["group"],
                                         sharded=layout["sharded"] or config.sharded_replica,
                                         tp=max(layout["tp"], config.tp_size)))
        print(launch.shown(command), flush=True)
        return 0
    print(launch.shown(command), flush=True)
    return launch.run_with_restarts(command, args.max_restarts, output_dir=config.output_dir)


def launch_torchft(args: argparse.Namespace, config) -> int:
    """outer_backend torchft: one launch per replica. With --replicas N: a Lighthouse (unless --lighthouse names
    one) and N replicas on this machine, each started again when it fails; without: this one replica."""
    processes = launch.check_torchft_launch(args.accelerate_config, config, launch_args_of(args))
    if not args.replicas:
        require_lighthouse(config)
        command = accelerate_command(args.recipe, args.accelerate_config, args.overrides, args.port)
        print(launch.shown(command), flush=True)
        return 0 if args.dry_run else launch.run_with_restarts(command, args.max_restarts, resume=False)
    if args.replicas < 1:
        raise CLIError(f"--replicas must be at least 1, got {args.replicas}.")
    with launch.run_lighthouse(config, dry_run=args.dry_run) as (lighthouse, served_here):
        if served_here:
            print(f"[diloco] Lighthouse on {lighthouse} (min {config.min_replicas} replica(s), grace "
                  f"{config.sync_grace_seconds:g} s)", flush=True)
        commands = launch.replica_commands(args.recipe, args.accelerate_config, args.overrides, config, args.replicas,
                                           processes, lighthouse, args.port)
        for command in commands:
            print(launch.shown(command), flush=True)
        return 0 if args.dry_run else launch.supervise_replicas(commands, config, args.max_restarts)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback, unreachable from others."""
    import ipaddress

    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def cmd_lighthouse(args: argparse.Namespace) -> int:
    if args.min_replicas < 1:
        raise CLIError(f"--min-replicas must be at least 1, got {args.min_replicas}.")
    if not args.grace_seconds >= 0 or not args.heartbeat_timeout > 0:
        raise CLIError("--grace-seconds must be 0 or more and --heartbeat-timeout above 0.")
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        server = launch.start_lighthouse(f"{host}:{args.port}", args.min_replicas, args.grace_seconds,
                                  args.heartbeat_timeout)
    except RuntimeError as error:
        raise CLIError(f"the Lighthouse could not start on {args.host}:{args.port}: {first_line(error)}.") from None
    port = server.address().rsplit(":", 1)[1]
    reach = "this machine only" if is_loopback(args.host) else "anyone who can reach this address"
    shown = socket.gethostname() if args.host in ("0.0.0.0", "::") else host
    print(f"[diloco] Lighthouse on {args.host}:{port} (min {args.min_replicas} replica(s), grace "
          f"{args.grace_seconds:g} s), open to {reach}; start replicas with --outer_backend torchft --lighthouse "
          f"http://{shown}:{port} --replica_id N", flush=True)
    if not is_loopback(args.host):
        print(f"[diloco] the Lighthouse has no authentication: keep port {port} on a private network or an "
              f"encrypted overlay (WireGuard, Tailscale), not the open internet.", flush=True)
    launch.serve_until_stopped(server)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    for needed in (DEMO_RECIPE, DEMO_ACCELERATE_CONFIG):
        if not needed.is_file():
            raise CLIError(f"the demo needs {needed}, which ships with the repository; run it from a clone.")
    output_dir = Path(args.output_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if output_dir.exists():
        raise CLIError(f"output directory {str(output_dir)!r} already exists; choose another with --output-dir.")
    overrides = [
        "--output_dir", str(output_dir),
        "--max_steps", str(args.max_steps),
        "--inner_steps", str(args.inner_steps),
        "--eval_steps", str(args.inner_steps),
        *(["--verbose", "true"] if args.verbose else []),
    ]
    command = accelerate_command(str(DEMO_RECIPE), str(DEMO_ACCELERATE_CONFIG), overrides, args.port)
    print("$ " + launch.shown(command), flush=True)
    started = time.time()
    code = launch.run_with_restarts(command, 0, resume=False, env={"OMP_NUM_THREADS": "1"})
    if code != 0:
        raise CLIError(f"the demo run failed with exit status {code}; its log is above.")
    print_demo_summary(output_dir, time.time() - started)
    return 0


def print_demo_summary(output_dir: Path, seconds: float) -> None:
    from .metrics import format_bytes, read_summary

    summary = read_summary(output_dir)
    before, after = summary["eval_loss_initial"], summary["eval_loss_final"]
    sent, ddp = summary["bytes_per_replica"], summary["ddp_bytes_per_replica"]
    rows = [
        ("replicas x inner steps (H)", f"{summary['num_replicas']} x {summary['inner_steps']}"),
        ("steps / rounds", f"{summary['steps']} / {summary['rounds']}" + (
            f" ({summary['syncs']} syncs)" if summary.get("syncs", summary["rounds"]) != summary["rounds"] else "")),
        ("eval loss before -> after", f"{before:.4f} -> {after:.4f}" if before and after else "n/a"),
        ("throughput (all replicas)", f"{summary['tokens_per_second']:,.0f} tokens/s"),
        ("outer syncs, incl. waiting", f"{summary['sync_seconds']:.2f} s of {seconds:.0f} s"),
        ("sent per replica (DiLoCo)", format_bytes(sent)),
        ("DDP would have sent", f"{format_bytes(ddp)} ({ddp / sent:.0f}x more)" if sent else format_bytes(ddp)),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nhf-diloco demo: what happened")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(f"  per sync: {output_dir / 'syncs.jsonl'}   TensorBoard: tensorboard --logdir {output_dir / 'runs'}")
    runs_dir = output_dir.parent
    print(f"  watch it in the app: hf-diloco app{'' if runs_dir == Path('runs') else f' --runs-dir {runs_dir}'}")


# --- entry point ----------------------------------------------------------------------------------------------------


def cmd_slurm(args: argparse.Namespace) -> int:
    """Write the SLURM batch script of a recipe (hf_diloco.slurm) after the checks `launch` makes; `--submit`
    hands it to sbatch."""
    from . import slurm

    if launch.token_values(args.overrides):
        raise CLIError("a --hub_token given to hf-diloco slurm would be written into the job's script; export "
                       "HF_TOKEN in the shell that runs sbatch instead (the job inherits its environment).")
    run, config = parse_train_args(args.recipe, args.overrides, checking_only=True)
    per_node = slurm.check_job(run, config, args.accelerate_config, args.nodes, args.replicas, args.first_replica)
    output_dir = Path(config.output_dir).resolve()
    # The job may start in another folder: every path it gets is absolute, the output folder given once, at the end.
    job = slurm.Job(recipe=str(Path(args.recipe).resolve()),
                    accelerate_config=str(Path(args.accelerate_config).resolve()),
                    overrides=slurm.without_output_dir(args.overrides), output_dir=str(output_dir),
                    job_name=args.job_name or output_dir.name, nodes=args.nodes, processes_per_node=per_node,
                    port=args.port, main_address=args.main_address or "", replicas=args.replicas,
                    first_replica=args.first_replica, total_replicas=args.total_replicas,
                    lighthouse=args.lighthouse or "", min_replicas=config.min_replicas,
                    grace_seconds=config.sync_grace_seconds,
                    sbatch={key.replace("_", "-"): getattr(args, key) for key in SBATCH_OPTIONS if getattr(args, key)})
    target = slurm.write(job, args.script)
    print(f"[hf-diloco slurm] wrote {target}")
    if not args.submit:
        print(f"[hf-diloco slurm] submit it with: sbatch {target}")
        return 0
    job_id = slurm.submit(target)
    print(f"[hf-diloco slurm] submitted job {job_id}; its log: {output_dir / 'slurm'}/slurm-{job_id}*.log")
    return 0


SBATCH_OPTIONS = ("partition", "time", "account", "gpus_per_node", "cpus_per_task", "mem")


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push

    try:
        push(args.output_dir, args.repo_id, private=args.private, merge_lora=args.merge_lora,
             commit_message=args.commit_message, allow_unfinished=args.allow_unfinished)
    except ConfigError:
        raise
    except Exception as error:  # network and Hub errors: the user needs the reason, not a traceback
        raise CLIError(f"push to {args.repo_id!r} failed: {first_line(error)}.") from None
    return 0


def cmd_app(args: argparse.Namespace) -> int:
    """Become the app (`python -m app.server`, which this process is replaced by): the library never imports it.
    The password travels in HF_DILOCO_APP_AUTH, not on a command line every user of the machine can read."""
    if not (REPO_ROOT / "app" / "server.py").is_file():
        raise CLIError("the app ships with the repository; run `hf-diloco app` from a clone.")
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *([path] if path else [])]),
           "HF_DILOCO_APP_AUTH": args.auth or ""}
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []  # the clone's `app`, not one in the current folder
    command = [sys.executable, *safe_path, "-m", "app.server", "--host", args.host, "--port", str(args.port),
               "--runs-dir", args.runs_dir, *(["--share"] if args.share else []),
               *[word for folder in args.data_dir for word in ("--data-dir", folder)]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, env)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hf-diloco", description="DiLoCo training for Hugging Face models.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = sub.add_parser(
        "train", help="train in this process (one replica per process under accelerate launch)", add_help=False
    )
    train.add_argument("--config", help="recipe YAML whose keys are DiLoCoConfig/RunArguments fields")
    train.add_argument("-h", "--help", action="store_true", help="list every field")
    train.set_defaults(func=cmd_train)

    launch = sub.add_parser("launch", help="print and run the accelerate launch command for a recipe")
    launch.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-pretrain.yaml")
    launch.add_argument(
        "--accelerate-config", required=True, help="accelerate YAML, e.g. accelerate_configs/cpu-2proc.yaml"
    )
    launch.add_argument("--port", type=int, help="rendezvous port of the main process (default: the config's)")
    # accelerate's own launch flags, in its spelling (dashes accepted too): checked with the config, then passed on.
    for flag, kind, text in LAUNCH_FLAGS:
        launch.add_argument(f"--{flag}", f"--{flag.replace('_', '-')}", dest=flag, type=kind, help=text)
    launch.add_argument("--dry-run", action="store_true", help="print the command without running it")
    launch.add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="start the launch again, up to N times, when it fails; each restart resumes from the newest complete "
             "checkpoint (resume_from_checkpoint auto). A run stopped by SIGTERM/SIGINT is not restarted (default 0)",
    )
    launch.add_argument(
        "--replicas", type=int, default=0, metavar="N",
        help="outer_backend torchft: start a Lighthouse (unless the recipe names one with lighthouse) and N replicas "
             "on this machine, replica r writing to <output_dir>/replica-r (default: start this one replica)",
    )
    launch.set_defaults(func=cmd_launch)

    slurm = sub.add_parser("slurm", help="write (and with --submit, submit) the SLURM batch script of a recipe")
    slurm.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-pretrain.yaml")
    slurm.add_argument("--accelerate-config", required=True,
                       help="accelerate YAML for one node (its num_processes are each node's processes)")
    slurm.add_argument("--nodes", type=int, default=1, help="torch backend: nodes of the job (default 1)")
    slurm.add_argument("--replicas", type=int, default=0,
                       help="outer_backend torchft: this site's replicas, one job array task each")
    slurm.add_argument("--first-replica", type=int, default=0,
                       help="torchft: id of this site's first replica (another site's ids come after; default 0)")
    slurm.add_argument("--total-replicas", type=int, default=0,
                       help="torchft: replicas over all sites (default: first replica + replicas)")
    slurm.add_argument("--lighthouse", help="torchft: URL of a running Lighthouse to join (default: array task 0 "
                                            "starts one on its node)")
    slurm.add_argument("--port", type=int, default=29500,
                       help="rendezvous port of the main node (torch), or the Lighthouse's (torchft); default 29500")
    slurm.add_argument("--main-address", help="torch: address of the main node (default: the job's first node)")
    slurm.add_argument("--job-name", help="SLURM job name (default: the output folder's name)")
    for option, text in (("partition", "partition"), ("time", "time limit, e.g. 24:00:00"), ("account", "account"),
                         ("gpus_per_node", "GPUs per node"), ("cpus_per_task", "CPUs per node's task"),
                         ("mem", "memory per node, e.g. 64G")):
        slurm.add_argument(f"--{option.replace('_', '-')}", dest=option, help=f"#SBATCH --{option.replace('_', '-')}: "
                                                                              f"{text}")
    slurm.add_argument("--script", help="where to write the script (default: <output_dir>/slurm/job.sbatch)")
    slurm.add_argument("--submit", action="store_true", help="submit it with sbatch")
    slurm.set_defaults(func=cmd_slurm)

    lighthouse = sub.add_parser(
        "lighthouse", help="start torchft's Lighthouse, which forms the rounds of outer_backend torchft replicas")
    lighthouse.add_argument("--host", default="127.0.0.1",
                            help="address to bind (default 127.0.0.1: replicas on this machine only; for replicas "
                                 "on other machines give this machine's private or overlay address)")
    lighthouse.add_argument("--port", type=int, default=29510, help="port (default 29510)")
    lighthouse.add_argument("--min-replicas", type=int, default=1,
                            help="a round starts once this many replicas have arrived (default 1)")
    lighthouse.add_argument("--grace-seconds", type=float, default=5.0,
                            help="then waits at most this long for the other live replicas (default 5)")
    lighthouse.add_argument("--heartbeat-timeout", type=float, default=5.0,
                            help="seconds without a heartbeat after which a replica counts as gone (default 5)")
    lighthouse.set_defaults(func=cmd_lighthouse)

    demo = sub.add_parser("demo", help="2-replica DiLoCo run on the built-in tiny model and corpus (CPU)")
    demo.add_argument("--output-dir", help="where the run goes (default: runs/demo-<time>)")
    demo.add_argument("--max-steps", type=int, default=300, help="inner steps per replica (default 300)")
    demo.add_argument("--inner-steps", type=int, default=50, help="H, steps between syncs (default 50)")
    demo.add_argument("--port", type=int, help="rendezvous port (default: the config's)")
    demo.add_argument("--verbose", action="store_true",
                      help="every process's progress bars and Trainer's dicts of logs (default: one bar, one line "
                           "per sync)")
    demo.set_defaults(func=cmd_demo)

    push = sub.add_parser("push", help="push a finished run's model to the Hugging Face Hub with a DiLoCo card")
    push.add_argument("output_dir", help="the run's output_dir (for a torchft launch, its folder or a replica's)")
    push.add_argument("--repo-id", required=True, help="'owner/name' or 'name'")
    push.add_argument("--private", action="store_true", help="create the repository as private")
    push.add_argument("--merge-lora", action="store_true", help="push the merged model instead of the LoRA adapter")
    push.add_argument("--commit-message", default="Upload DiLoCo model", help="commit message")
    push.add_argument("--allow-unfinished", action="store_true",
                      help="push a run that was stopped, failed or did not reach max_steps (its card says how it "
                           "ended); refused without it")
    push.set_defaults(func=cmd_push)

    app = sub.add_parser("app", help="the Gradio app: launch recipes, watch sync rounds, push to the Hub")
    app.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    app.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    app.add_argument("--runs-dir", default="runs",
                     help="the folder whose runs the app shows (its own, and every folder a run of hf-diloco wrote: "
                          "make demo's, a recipe's) and where it starts new ones (default runs/)")
    app.add_argument("--auth", default=os.environ.get("HF_DILOCO_APP_AUTH"),
                     help="'user:password' required to use the app (default: $HF_DILOCO_APP_AUTH)")
    app.add_argument("--data-dir", action="append", default=[], metavar="FOLDER",
                     help="a folder whose models and datasets runs started from the app may read (repeat for more; "
                          "default: the folder the app starts in); a local path elsewhere is refused")
    app.add_argument("--share", action="store_true", help="also open a public Gradio share link (off by default)")
    app.set_defaults(func=cmd_app)
    from . import plan  # `hf-diloco plan`: its flags and command live in hf_diloco.plan

    plan.add_subcommand(sub)
    return parser


# accelerate launch flags that `hf-diloco launch` takes, checks against its config, and hands on in this order.
LAUNCH_FLAGS = (
    ("num_processes", int, "processes in all, over every machine (default: the config's)"),
    ("num_machines", int, "machines taking part (default: the config's)"),
    ("machine_rank", int, "this machine's rank, from 0 (default: the config's)"),
    ("main_process_ip", str, "address of the machine of rank 0 (default: the config's)"),
    ("main_process_port", int, "rendezvous port, as --port (default: the config's)"),
)


def launch_args_of(args: argparse.Namespace) -> list[str]:
    """The accelerate launch flags given to `hf-diloco launch`, as accelerate spells them."""
    return [item for flag, _, _ in LAUNCH_FLAGS if getattr(args, flag, None) is not None
            for item in (f"--{flag}", str(getattr(args, flag)))]


# Sub-commands whose extra flags are recipe fields (checked against DiLoCoConfig/RunArguments when parsed).
TAKES_RECIPE_FIELDS = ("train", "launch", "slurm")


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The sub-command's arguments; `overrides` holds the recipe-field flags of train/launch (none elsewhere)."""
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.command not in TAKES_RECIPE_FIELDS and overrides:
        raise CLIError(f"unrecognized arguments: {' '.join(overrides)}; see `hf-diloco {args.command} --help`.")
    if "--" in overrides:
        overrides.remove("--")
    args.overrides = overrides
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_command_line(argv)
        if args.command == "train" and args.help:
            field_parser().print_help()
            return 0
        return args.func(args)
    except ConfigError as error:
        if not launch.report_input_error(str(error)):  # a worker of `hf-diloco launch` leaves it to its launcher
            print(f"hf-diloco: error: {error}", file=sys.stderr)
        return launch.INPUT_ERROR
    except RunError as error:  # the run itself could not go on (diverged, a replica lost): its reason, not a trace
        print(f"hf-diloco: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hf-diloco: interrupted", file=sys.stderr)
        return 130
    finally:
        launch.destroy_process_groups()


if __name__ == "__main__":
    launch.exit_process(main())
