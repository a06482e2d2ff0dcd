"""DiLoCo on one CUDA device, in one command: throughput against plain Trainer, two replicas sharing the device, the
cost of one outer sync and of each codec, and memory against the dry run's figure.

    python benchmarks/gpu.py [--preset llama-150m] [--steps 200] [--inner-steps 50] [--repeats 3]
        [--batch 8] [--block 1024]
    python benchmarks/gpu.py --smoke --out FOLDER    # the same code path on a tiny preset, on any machine

Every training run is `hf-diloco train` (bf16 autocast on fp32 weights, the preset built from its config, the
built-in corpus in `--block`-token blocks, no evaluation, no checkpoints inside the loop):
- **throughput**: plain Trainer (`--trainer ddp`, one process) and DiLoCoTrainer (M = 1, H = `--inner-steps`) with
  the same settings, interleaved, `--repeats` times; tokens/s = steps × batch × block ÷ Trainer's `train_runtime`.
  Checked against physics: 6 × parameters × tokens/s is the training FLOP/s, which must stay under the device's
  peak dense bf16 FLOP/s where hf_diloco.plan knows it (the model FLOP utilisation, MFU, is printed).
- **two replicas on the one device**: `hf-diloco launch ... --replicas 2` of the torchft backend, each replica its
  own process on device 0. NCCL refuses two ranks on one device, so the cross-replica exchange runs over gloo
  (torchft's ProcessGroupGloo, from host memory, where the outer state lives); both replicas' final models must be
  bit-identical and every sync committed by both.
- **one outer sync** of the whole model (pseudo-gradient, outer Nesterov step, copy back; M = 1, so no network),
  with the outer state offloaded to pinned host memory and kept on the device; median of 5.
- **codecs**: encode + decode of int8, int4 + error feedback and sparse + error feedback on a pseudo-gradient of the
  model's size on the device, median of 5, against the compute time of H inner steps (from the DiLoCo runs'
  records).
- **memory**: the DiLoCo run's peak device memory (Trainer's memory metrics, `skip_memory_metrics false`) against
  the dry run's parameters + gradients + inner optimizer on the device, plus the activations of one forward and
  backward of a batch, measured apart in this process.

Targets (issue "Ready for the GPU"): DiLoCoTrainer ≥ 99% of plain Trainer's tokens/s at H = 50; one outer sync of the
150M model under 1% of H steps' compute; peak memory within 10% of the dry run's figure plus the activations.
Writes results/gpu.json (naming the device), gpu.md and gpu.png; without CUDA (and without --smoke) it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    REPO,
    RESULTS,
    Processes,
    markdown_table,
    read_run,
    run_env,
    save,
    show,
    skip,
    spread,
    train_command,
)

TARGETS = {"throughput": 0.99, "sync_share": 0.01, "memory": 0.10}
CODEC_ROWS = {"int8": ("int8", False), "int4+EF": ("int4", True), "sparse+EF": ("sparse", True)}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(work, repeats: int = 5) -> float:
    """Median seconds of `work()` over `repeats` calls, after one warm-up call."""
    work()
    synchronize()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        synchronize()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


# --- the runs ---------------------------------------------------------------------------------------------------


def overrides(args: argparse.Namespace, steps: int) -> list[str]:
    """The settings every run shares (the same for plain Trainer and DiLoCo)."""
    return ["--model_name_or_path", args.preset, "--block_size", str(args.block), "--per_device_train_batch_size",
            str(args.batch), "--max_steps", str(steps), "--warmup_steps", str(min(20, steps // 4)), "--bf16", "true",
            "--eval_strategy", "no", "--eval_on_start", "false", "--save_every_rounds", "0", "--logging_steps",
            str(max(1, steps // 10)), "--report_to", "none", "--skip_memory_metrics", "false"]


def train(out: Path, extra: list[str]) -> dict:
    Processes([train_command(1, ["--output_dir", str(out), *extra])]).wait()
    return read_run(out)


def tokens_per_second(result: dict, args: argparse.Namespace) -> float:
    metrics = result["metrics"]
    return metrics["global_step"] * args.batch * args.block / float(metrics["train_runtime"])


# The interleaved throughput runs: plain Trainer, and DiLoCo (M = 1) with its outer state on the host (the default,
# pinned memory) and on the device (`--offload_outer_state false`).
THROUGHPUT_RUNS = {"plain": ["--trainer", "ddp"], "diloco": [], "diloco_device": ["--offload_outer_state", "false"]}


def throughput(args: argparse.Namespace, tmp: Path) -> dict:
    """Plain Trainer and the two DiLoCo runs, interleaved (each repeat in another order), args.repeats times."""
    found: dict[str, list[float]] = {name: [] for name in THROUGHPUT_RUNS}
    runs: dict[str, list[dict]] = {name: [] for name in THROUGHPUT_RUNS}
    names = list(THROUGHPUT_RUNS)
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]  # none always first
        for name in order:
            print(f"  repeat {repeat + 1}/{args.repeats}: {name}", flush=True)
            extra = THROUGHPUT_RUNS[name] + ([] if name == "plain" else ["--inner_steps", str(args.inner_steps)])
            result = train(tmp / f"{name}-{repeat}", [*overrides(args, args.steps), *extra])
            found[name].append(tokens_per_second(result, args))
            runs[name].append(result)
    ratios = {name: [d / p for d, p in zip(found[name], found["plain"], strict=True)]
              for name in ("diloco", "diloco_device")}
    # Seconds per inner step from the syncs' own records (the first, which holds the warm-up, left out where there
    # are others).
    diloco = runs["diloco"] + runs["diloco_device"]
    compute = [r["compute_seconds"] / max(1, r["sync_steps"]) for run in diloco
               for r in (run["rounds"][1:] or run["rounds"])]
    return {**{name: spread(values) for name, values in found.items()},
            "ratio": spread(ratios["diloco"]), "ratio_device": spread(ratios["diloco_device"]),
            "seconds_per_step": statistics.median(compute), "memory": runs["diloco"][-1]["metrics"],
            "sync_seconds": spread([r["sync_seconds"] for run in runs["diloco"] for r in run["rounds"]]),
            "sync_seconds_device": spread([r["sync_seconds"] for run in runs["diloco_device"] for r in run["rounds"]])}


def two_replicas(args: argparse.Namespace, tmp: Path) -> dict:
    """Two torchft replicas sharing device 0: every sync committed by both, the final models bit-identical."""
    import torch
    from safetensors.torch import load_file

    from hf_diloco.metrics import read_syncs

    config = tmp / "replica.yaml"  # one process per replica, on the device when there is one
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\n"
                      "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\ndynamo_config: {}\n"
                      f"use_cpu: {str(not torch.cuda.is_available()).lower()}\n")
    out = tmp / "two-replicas"
    steps = 2 * args.inner_steps
    command = [sys.executable, "-m", "hf_diloco.cli", "launch", str(REPO / "recipes" / "torchft-3.yaml"),
               "--accelerate-config", str(config), "--replicas", "2", "--max-restarts", "0",
               "--output_dir", str(out), *overrides(args, steps), "--inner_steps", str(args.inner_steps),
               "--min_replicas", "2", "--disable_tqdm", "true"]
    result = subprocess.run(command, cwd=REPO, env=run_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=3600)
    if result.returncode != 0:
        raise SystemExit(f"the two-replica run failed (exit {result.returncode}):\n{result.stdout[-6000:]}")
    models = [load_file(out / f"replica-{r}" / "model.safetensors") for r in (0, 1)]
    identical = models[0].keys() == models[1].keys() and all(torch.equal(models[0][k], models[1][k])
                                                             for k in models[0])
    syncs = read_syncs(out / "replica-0")
    return {"identical": identical, "syncs": len(syncs),
            "committed_by_both": sum(r.get("committed", True) and r["participants"] == 2 for r in syncs),
            "backend": "torchft (ProcessGroupGloo across replicas)"}


def sync_and_codecs(args: argparse.Namespace) -> dict:
    """One outer sync of the whole model with the outer state offloaded and on the device, each codec's encode +
    decode on a pseudo-gradient of the model's size, and one batch's activations; in this process, on device 0 (or
    the CPU)."""
    import torch

    from hf_diloco.codecs import ErrorFeedback, make_codec
    from hf_diloco.fragments import fragments_of
    from hf_diloco.models import load_model_and_tokenizer
    from hf_diloco.outer import OuterState

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = load_model_and_tokenizer(args.preset, args.block)[0].to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    generator = torch.Generator(device=device).manual_seed(0)
    result = {"parameters": numel, "sync_seconds": {}, "activations": activation_bytes(model, args, device)}
    for offload in (True, False):
        outer = OuterState(params, lr=0.7, momentum=0.9, nesterov=True, offload=offload)
        where = ("host (pinned)" if outer.global_params[0].is_pinned() else "host") if offload else "device"

        def one_sync(outer=outer):
            with torch.no_grad():  # the inner steps' doing, between syncs
                for p in params:
                    p.add_(torch.randn(p.shape, generator=generator, device=device, dtype=p.dtype), alpha=1e-3)
            for fragment in fragments_of(outer):
                for bucket in fragment.buckets:
                    delta = fragment.pseudo_gradient(bucket, device)
                    fragment.outer_step(bucket, delta)
                    fragment.copy_back(bucket)

        result["sync_seconds"][where] = timed(one_sync)
        del outer
    delta = torch.randn(numel, generator=generator, device=device) * 1e-3
    result["codec_seconds"] = {}
    for row, (name, feedback) in CODEC_ROWS.items():
        codec = make_codec(name)
        errors = ErrorFeedback(decay=1.0, device=device) if feedback else None

        def encode_decode(codec=codec, errors=errors):
            sent = errors.accumulate("all", delta) if errors else delta
            decoded = codec.decode(codec.encode(sent), numel)
            if errors:
                sent.sub_(decoded)

        result["codec_seconds"][row] = timed(encode_decode)
    return result


def dry_run_memory(args: argparse.Namespace) -> dict:
    """The dry run's bytes per process for this model and batch (parameters, gradients, inner optimizer, outer)."""
    import re

    command = train_command(1, ["--dry-run", *overrides(args, args.steps), "--inner_steps", str(args.inner_steps)])
    text = subprocess.run(command, cwd=REPO, env=run_env(1), capture_output=True, text=True, timeout=600).stdout
    units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    parts = dict(re.findall(r"(parameters|gradients|inner optimizer|outer state) ([\d.]+ [KMGT]?B)", text))
    if len(parts) != 4:
        raise SystemExit(f"the dry run printed no memory per process:\n{text[-2000:]}")
    return {part: float(value.split()[0]) * units[value.split()[1]] for part, value in parts.items()}


def memory(metrics: dict, planned: dict, activations: float | None) -> dict:
    """The DiLoCo run's peak device memory (Trainer's memory metrics) against the dry run's figure on the device
    (parameters, gradients, inner optimizer; the outer state is on the host) plus the activations of one batch,
    measured apart."""
    on_device = planned["parameters"] + planned["gradients"] + planned["inner optimizer"]
    found = {"planned_on_device": on_device, "planned_outer_on_host": planned["outer state"],
             "activations": activations, "peak": None, "expected_peak": None, "against_plan": None}
    if "train_mem_gpu_peaked_delta" in metrics and activations is not None:
        end = metrics.get("before_init_mem_gpu", 0) + metrics["init_mem_gpu_alloc_delta"] + \
            metrics["train_mem_gpu_alloc_delta"]
        found["peak"] = end + metrics["train_mem_gpu_peaked_delta"]
        found["expected_peak"] = on_device + activations
        found["against_plan"] = found["peak"] / found["expected_peak"] - 1
    return found


def activation_bytes(model, args: argparse.Namespace, device) -> float | None:
    """Device memory one forward and backward of a batch takes beyond the weights and their gradients (bf16
    autocast); None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.block), device=device)
    model.zero_grad(set_to_none=True)
    synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    synchronize()
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return float(peak - before - gradients)


def peak_flops() -> float | None:
    """The device's peak dense bf16 FLOP/s, where hf_diloco.plan lists its kind."""
    from hf_diloco.plan import GPUS

    name = device_name().lower()
    return next((gpu.peak_flops for key, gpu in GPUS.items() if key.lower() in name), None)


# --- report -----------------------------------------------------------------------------------------------------


def report(args: argparse.Namespace, raw: dict, seconds: float) -> None:
    th, sync, mem = raw["throughput"], raw["sync"], raw["memory"]
    h_compute = th["seconds_per_step"] * args.inner_steps
    flops = 6 * sync["parameters"] * th["diloco"]["median"]
    peak = peak_flops()
    raw["mfu"] = None if peak is None else flops / peak
    if raw["mfu"] is not None and raw["mfu"] > 1:
        raise SystemExit(f"tokens/s beyond the device's peak ({100 * raw['mfu']:.0f}% MFU): a measuring bug")
    sync_share = {where: s / h_compute for where, s in sync["sync_seconds"].items()}
    raw["checks"] = {
        "throughput ≥ 99% of plain Trainer (outer state on the host)": th["ratio"]["median"] >= TARGETS["throughput"],
        "throughput ≥ 99% of plain Trainer (outer state on the device)":
            th["ratio_device"]["median"] >= TARGETS["throughput"],
        # A replica takes the same steps as plain Trainer plus its syncs: a DiLoCo run faster than every plain
        # run says the two did not do the same work per step.
        "no DiLoCo run faster than every plain Trainer run (else a measuring fault)":
            max(th["diloco"]["min"], th["diloco_device"]["min"]) <= th["plain"]["max"],
        "one outer sync (state offloaded) < 1% of H steps": next(share for where, share in sync_share.items()
                                                                 if where.startswith("host")) < TARGETS["sync_share"],
        "peak memory within 10% of the dry run + activations": None if mem["against_plan"] is None
        else abs(mem["against_plan"]) <= TARGETS["memory"],
        "two replicas on one device bit-identical": raw["replicas"]["identical"]
        and raw["replicas"]["committed_by_both"] == raw["replicas"]["syncs"],
    }
    gb = 1e9
    rows = [
        ["plain Trainer tokens/s", show(th["plain"]), ""],
        *[[f"DiLoCoTrainer M = 1, H = {args.inner_steps}, outer state on the {where}, tokens/s", show(th[name]),
           f"{100 * th[ratio]['median']:.1f}% [{100 * th[ratio]['min']:.1f}%, {100 * th[ratio]['max']:.1f}%] of plain"
           f"; a sync {th[seconds]['median']:.3f} s" + ("" if raw["mfu"] is None or name != "diloco"
                                                        else f"; MFU {100 * raw['mfu']:.1f}%")]
          for name, ratio, seconds, where in [("diloco", "ratio", "sync_seconds", "host"),
                                              ("diloco_device", "ratio_device", "sync_seconds_device", "device")]],
        ["compute of H steps (s)", f"{h_compute:.3f}", f"{th['seconds_per_step'] * 1000:.1f} ms a step"],
        *[[f"one outer sync, state on {where} (s)", f"{s:.4f}", f"{100 * sync_share[where]:.2f}% of H steps"]
          for where, s in sync["sync_seconds"].items()],
        *[[f"{row} encode + decode (s)", f"{s:.4f}", f"{100 * s / h_compute:.2f}% of H steps"]
          for row, s in sync["codec_seconds"].items()],
        ["peak memory of the DiLoCo run (GB)", "n/a" if mem["peak"] is None else f"{mem['peak'] / gb:.2f}",
         f"dry run {mem['planned_on_device'] / gb:.2f} on the device (+ {mem['planned_outer_on_host'] / gb:.2f} "
         f"outer state on the host)" + ("" if mem["activations"] is None else
                                        f" + activations {mem['activations'] / gb:.2f} measured apart = "
                                        f"{mem['expected_peak'] / gb:.2f}")],
        ["two replicas on one device", f"{raw['replicas']['committed_by_both']} of {raw['replicas']['syncs']} "
         f"syncs by both", ("bit-identical" if raw["replicas"]["identical"] else "DIFFERENT")
         + (f"; from {raw['replicas']['from']}" if "from" in raw["replicas"] else "")],
    ]
    checks = "\n".join(f"- {name}: {'met' if ok else 'not measured here' if ok is None else 'MISSED'}"
                       for name, ok in raw["checks"].items())
    table = (f"### {raw['device']}: {args.preset} ({sync['parameters']:,} parameters), batch {args.batch} × "
             f"{args.block} tokens, bf16 autocast, {args.steps} steps, {args.repeats} interleaved repeats\n\n"
             + markdown_table(["measure", "value", "against"], rows) + "\n\n" + checks)
    figure = plot(args, raw, h_compute)
    save("gpu", table, raw, figure, quick=args.smoke, seconds=seconds, folder=args.out)


def plot(args: argparse.Namespace, raw: dict, h_compute: float):
    from common import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    th = raw["throughput"]
    kinds = ("plain", "diloco", "diloco_device")
    labels = ["plain Trainer", *(f"DiLoCo H={args.inner_steps}\nstate on {w}" for w in ("host", "device"))]
    left.bar(labels, [th[k]["median"] for k in kinds], capsize=4, color=["#9ca3af", "#2563eb", "#16a34a"],
             yerr=[[th[k]["median"] - th[k]["min"] for k in kinds], [th[k]["max"] - th[k]["median"] for k in kinds]])
    left.set_ylabel("tokens/s (median, [min, max])")
    left.set_title(f"{raw['device']}: throughput")
    costs = {**{f"sync, {w}": s for w, s in raw["sync"]["sync_seconds"].items()}, **raw["sync"]["codec_seconds"]}
    right.barh(list(costs), [100 * s / h_compute for s in costs.values()], color="#ea580c")
    right.axvline(100 * TARGETS["sync_share"], color="#111827", linestyle="--", label="1% target")
    right.set_xlabel(f"% of the compute of H = {args.inner_steps} steps")
    right.set_title("one outer sync and each codec")
    right.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-150m", help="model preset (default llama-150m)")
    parser.add_argument("--steps", type=int, default=200, help="steps of each throughput run (default 200)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H of the DiLoCo runs (default 50)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (at least 3)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--block", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, 4 steps, H = 2, one repeat, blocks of "
                                                            "32: the code path on any machine, figures meaningless")
    parser.add_argument("--replicas-from", type=Path, help="take the two-replica part from an earlier run's "
                        "gpu-partial.json or gpu.json on the same device instead of running it again (the report "
                        "says so)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of gpu.json, gpu.md and gpu.png")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.steps, args.inner_steps, args.repeats, args.batch, args.block = \
            "tiny-llama", 4, 2, 1, 2, 32
    else:
        import torch

        if not torch.cuda.is_available():
            skip("gpu", "no CUDA device here (python benchmarks/gpu.py --smoke runs its code path on any machine)")
        if args.repeats < 3:
            sys.exit("--repeats must be at least 3: a median and a spread need three runs.")
    if args.steps % args.inner_steps:
        sys.exit("--steps must be a multiple of --inner-steps.")
    began = time.time()
    raw = {"device": device_name(), "preset": args.preset, "steps": args.steps, "inner_steps": args.inner_steps,
           "batch": args.batch, "block": args.block, "targets": TARGETS}
    failed = {}

    def phase(name: str, title: str, work):
        """One part of the benchmark; a failure is recorded and the next part still runs, so that one call on a
        borrowed machine brings back every figure that could be measured. What is done so far is saved as it goes."""
        print(title, flush=True)
        try:
            raw[name] = work()
        except (Exception, SystemExit) as error:  # noqa: BLE001 (reported below, and the exit is non-zero)
            failed[name] = f"{type(error).__name__}: {error}"[-6000:]
            print(f"{name} failed: {failed[name]}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-partial.json").write_text(json.dumps({**raw, "failed": failed}, indent=2, default=str))

    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        phase("throughput", "throughput: plain Trainer and DiLoCo, interleaved", lambda: throughput(args, tmp))
        if args.replicas_from:
            earlier = json.loads(args.replicas_from.read_text())
            if earlier.get("device") != raw["device"] or "replicas" not in earlier:
                sys.exit(f"{args.replicas_from} holds no two-replica part measured on {raw['device']}.")
            raw["replicas"] = {**earlier["replicas"], "from": f"an earlier call on the same device "
                                                              f"({args.replicas_from.name})"}
        else:
            phase("replicas", "two replicas on one device", lambda: two_replicas(args, tmp))
    phase("sync", "one outer sync and the codecs", lambda: sync_and_codecs(args))
    phase("planned", "the dry run's memory", lambda: dry_run_memory(args))
    if failed:
        sys.exit(f"gpu: {', '.join(failed)} failed; what was measured is in {args.out / 'gpu-partial.json'}")
    raw["memory"] = memory(raw["throughput"].pop("memory"), raw.pop("planned"), raw["sync"]["activations"])
    report(args, raw, time.time() - began)
    (args.out / "gpu-partial.json").unlink()

if __name__ == "__main__":
    main()
