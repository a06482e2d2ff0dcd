"""Every shipped recipe dry-runs to the plan its YAML describes; the baselines and LoRA fine-tuning do what they
claim."""

import json
import re

import pytest
import torch
import yaml
from helpers import REPO, cli, hf_diloco, train_runs
from safetensors.torch import load_file

from hf_diloco.hub import model_card

RECIPES = REPO / "recipes"
SHORT = ["--max_steps", "4", "--inner_steps", "2", "--block_size", "64", "--eval_strategy", "no",
         "--eval_on_start", "false", "--disable_tqdm", "true"]


def read_plan(stdout: str) -> dict[str, str]:
    """The dry run's table: `  <key padded to a common width>  <value>` per line."""
    lines = stdout[stdout.index("hf-diloco dry run"):].splitlines()[1:]
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines if line.startswith("  "))


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_every_recipe_dry_runs_to_the_plan_its_yaml_describes(recipe, tmp_path):
    """Each shipped recipe parses, and the plan shows the recipe's own values (read here from the YAML, with the
    DiLoCoConfig defaults for keys it leaves out); the bytes per round follow from the trainable parameters."""
    overrides = []
    if recipe == "lora-finetune.yaml":  # its default model is tiny-pretrain's output; any model dry-runs
        overrides = ["--model_name_or_path", "tiny-llama"]
    result = cli("train", "--config", str(RECIPES / recipe), "--dry_run", "true",
                       "--output_dir", str(tmp_path / "out"), *overrides)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    values = {"inner_steps": 500, "outer_optimizer": "sgd", "outer_lr": 0.7, "outer_momentum": 0.9,
              "outer_nesterov": True, "trainer": "diloco", "gradient_accumulation_steps": 1, "weight_decay": 0.0,
              **yaml.safe_load((RECIPES / recipe).read_text())}
    plan = read_plan(result.stdout)
    assert plan["trainer"] == values["trainer"]
    if values["trainer"] == "ddp":  # no rounds: no H, outer optimizer or codecs, a gradient all-reduce per step
        assert not any(key.startswith(("inner_steps", "outer", "per round", "streaming")) for key in plan)
        trainable = int(re.search(r"([\d,]+) trainable", plan["model"]).group(1).replace(",", ""))
        assert as_bytes(plan["sent per process per step (gradient all-reduce)"]) == pytest.approx(
            trainable * 4 * 2 * 7 / 8, rel=0.01)
        return
    assert plan["inner_steps (H)"] == str(values["inner_steps"])
    nesterov = values["outer_nesterov"] and values["outer_momentum"] > 0
    assert plan["outer optimizer"] == (f"{values['outer_optimizer']} lr {float(values['outer_lr'])} momentum "
                                       f"{float(values['outer_momentum'])}" + (" Nesterov" if nesterov else ""))
    assert (f"lr {float(values['learning_rate'])} weight decay {float(values['weight_decay'])}, "
            f"warmup {values['warmup_steps']}, {values['lr_scheduler_type']}") in plan["inner optimizer"]
    if values["trainer"] in ("sft", "dpo"):  # TRL's rows: at most max_length tokens each
        tokens = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] * values["max_length"]
        assert plan["tokens per inner step per process"] == f"at most {tokens:,}"
        assert f"at most {values['max_length']} tokens each" in plan["data"]
    else:
        tokens = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"] * values["block_size"]
        assert plan["tokens per inner step per process"] == f"{tokens:,}"
    total, trainable = (int(x.replace(",", "")) for x in re.findall(r"([\d,]+) (?:parameters|trainable)",
                                                                      plan["model"]))
    assert (trainable < total / 10) if values.get("lora_r", 0) > 0 else trainable == total
    # Ring all-reduce with M = 8 (a torchft recipe: its num_replicas) sends 2 * 7/8 of the fp32 pseudo-gradient
    # (of its 1/g share, in a replica of g processes) per process per round; a codec sends
    # what its own entry in the per-codec row says.
    by_codec = {name: as_bytes(amount) for name, amount in
                (entry.split(" ", 1) for entry in plan["per round by codec"].split(", "))}
    m = values.get("num_replicas", 8) if values.get("outer_backend") == "torchft" else 8
    group = values.get("replica_group_size", 1)  # each member of a replica sends its 1/g slice or shard
    if values.get("tp_size", 1) > 1:  # tensor parallel: the pieces of the attention and MLP projections it holds,
        from hf_diloco.models import build_preset, byte_tokenizer  # and the norms and tied embedding whole

        model = build_preset(values["model_name_or_path"], byte_tokenizer(), values["block_size"])
        split = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight"))
        assert 0 < split < trainable
        # With FSDP2 beside it, each piece and whole value is sharded over replica_group_size / tp_size processes.
        trainable, group = trainable - split + split / values["tp_size"], max(1, group // values["tp_size"])
    assert by_codec["none"] == pytest.approx(trainable * 4 * 2 * (m - 1) / m / group, rel=0.01)
    sent = as_bytes(plan[f"sent across replicas per process per round, M={m}"])
    assert sent == by_codec[values.get("compression", "none")]
    # The end: staggered where syncs overlap inner steps on the torch backend (final_sync auto), else blocking.
    staggered = values.get("sync_delay", 0) not in (0, "0") and values.get("outer_backend", "torch") == "torch"
    assert plan["streaming"].endswith("the end staggered (each fragment's last sync overlapped)" if staggered
                                      else "the end blocking (every fragment syncs at the last step)")


def as_bytes(text: str) -> float:
    """'7.58 MB ...' -> 7.58e6."""
    number, unit = text.split()[:2]
    return float(number) * {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}[unit]


def test_paper_recipe_dry_run_describes_the_paper_setup():
    result = cli("train", "--config", str(RECIPES / "paper-150m-c4.yaml"), "--dry_run", "true")
    assert result.returncode == 0, result.stderr[-2000:]
    plan = result.stdout
    assert "allenai/c4 [en], streamed" in plan
    assert "sgd lr 0.7 momentum 0.9 Nesterov" in plan and "lr 0.0004 weight decay 0.1, warmup 1000" in plan
    params = int(plan.split("llama-150m (")[1].split(" parameters")[0].replace(",", ""))
    assert 140e6 < params < 170e6
    # Ring all-reduce with M = 8 sends 2 * 7/8 of the fp32 pseudo-gradient per replica per round.
    sent_gb = float(plan.split("M=8")[1].split()[0])
    assert sent_gb == pytest.approx(params * 4 * 2 * 7 / 8 / 1e9, abs=0.01)


# The runs of two processes below, trained in turn by one launch (tests/scripts/train_runs.py: `hf-diloco train`'s
# own path; the start-up paid once). MUON: DiLoCo and its DDP baseline with `--inner_optimizer muon`, evaluated at
# the start and the end, saving at step 20.
MUON = ["--max_steps", "20", "--inner_steps", "10", "--block_size", "32", "--per_device_train_batch_size", "4",
        "--eval_strategy", "steps", "--eval_steps", "20", "--eval_on_start", "true", "--disable_tqdm", "true",
        "--report_to", "none", "--inner_optimizer", "muon", "--save_strategy", "steps", "--save_steps", "20"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """name → output folder of each run of two processes; "base" is the tiny-llama the LoRA run fine-tunes."""
    folder = tmp_path_factory.mktemp("recipes")
    from hf_diloco.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    runs = {
        "ddp": ("ddp-baseline.yaml", [*SHORT, "--warmup_steps", "0"]),  # full learning rate: the weights move
        "lora": ("lora-finetune.yaml", [*SHORT, "--model_name_or_path", str(folder / "base"), "--compression",
                                        "int8"]),
        "diloco-muon": ("tiny-pretrain.yaml", MUON),
        "ddp-muon": ("ddp-baseline.yaml", MUON),
    }
    train_runs([{"name": name, "recipe": str(RECIPES / recipe), "args": [*args, "--output_dir", str(folder / name)]}
                for name, (recipe, args) in runs.items()])
    return {name: folder / name for name in [*runs, "base"]}


@pytest.mark.process
def test_ddp_baseline_is_data_parallel_training(two_processes, tmp_path):
    """trainer: ddp all-reduces gradients every step: two processes with batch 8 end where one process with batch 16
    does (same shuffle, equal token counts, so the mean of the two gradients is the batch-16 gradient); tol 1e-5.
    Independent replicas would end far apart from it."""
    out = two_processes["ddp"]
    short = [*SHORT, "--warmup_steps", "0"]
    assert not (out / "syncs.jsonl").exists(), "DDP has no outer rounds"
    single = tmp_path / "single"
    result = hf_diloco("train", "--config", str(RECIPES / "ddp-baseline.yaml"), *short, "--output_dir", str(single),
                       "--per_device_train_batch_size", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    ddp, one = load_file(out / "model.safetensors"), load_file(single / "model.safetensors")
    worst = max((ddp[k] - one[k]).abs().max().item() for k in one)
    assert worst < 1e-5, f"largest parameter difference {worst:.2e}"
    from hf_diloco.models import load_model_and_tokenizer

    start = load_model_and_tokenizer("tiny-llama")[0].state_dict()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3, "training moved the weights"
    metrics = json.loads((out / "run_metrics.json").read_text())
    assert metrics["global_step"] == 4


@pytest.mark.process
def test_lora_finetune_syncs_only_adapters_and_saves_merged_model(two_processes):
    """Two replicas fine-tune LoRA adapters with the int8 codec: only the adapters are synced (and counted), int8
    sends about a quarter of their fp32 bytes, and the merged model holds the trained attention weights."""
    out = two_processes["lora"]
    original = load_file(two_processes["base"] / "model.safetensors")
    adapter = load_file(out / "adapter_model.safetensors")
    adapter_numel = sum(t.numel() for t in adapter.values())
    rounds = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert {r["synced_parameters"] for r in rounds} == {adapter_numel}
    assert {r["num_replicas"] for r in rounds} == {2} and all(3.9 < r["compression_ratio"] < 4.0 for r in rounds)
    assert adapter_numel < sum(t.numel() for t in original.values()) / 10
    merged = load_file(out / "merged" / "model.safetensors")
    changed = [k for k in merged if "q_proj" in k and not (merged[k] == original[k]).all()]
    assert changed, "merging the trained adapters changes the attention weights"


@pytest.mark.process
def test_recipes_train_with_muon_for_diloco_and_its_ddp_baseline(two_processes):
    """recipes/tiny-pretrain.yaml and recipes/ddp-baseline.yaml with `--inner_optimizer muon` on two processes:
    the checkpoint each saves holds Muon's and AdamW's states (DiLoCo: each replica's own; DDP: the one
    optimizer), Muon's a momentum for each of the 7 weight matrices of every layer, the run's record and model card
    name the inner optimizer, and DiLoCo's held-out loss fell from its evaluation at the start."""
    diloco = two_processes["diloco-muon"]
    saved = {"diloco": diloco / "checkpoint-20" / "process-1" / "optimizer.pt",
             "ddp": two_processes["ddp-muon"] / "checkpoint-20" / "optimizer.pt"}
    layers = json.loads((diloco / "config.json").read_text())["num_hidden_layers"]
    for name, path in saved.items():
        state = torch.load(path, weights_only=True)
        assert set(state) == {"muon", "adamw"}, name
        muon = state["muon"]["state"]
        assert len(muon) == 7 * layers and all("momentum_buffer" in s for s in muon.values()), name
    assert "(`inner_optimizer`) | muon | adamw |" in model_card(diloco)
    assert json.loads((diloco / "run_config.json").read_text())["diloco"]["inner_optimizer"] == "muon"
    log = [json.loads(line) for line in (diloco / "trainer_log.jsonl").read_text().splitlines()]
    evaluations = [entry["eval_loss"] for entry in log if "eval_loss" in entry]
    assert len(evaluations) == 2 and evaluations[1] < evaluations[0] - 0.3, evaluations


def test_launch_refuses_the_sharded_layouts_it_cannot_keep_inside_a_replica(tmp_path):
    """FSDP1, DeepSpeed, FSDP2 with no processes to shard over, and FSDP2 with tensor parallel and no processes to
    shard a piece over: one sentence each, no traceback."""
    cases = {"fsdp1": ("distributed_type: FSDP\nnum_processes: 2\n", "fsdp_version: 2"),
             "deepspeed": ("distributed_type: DEEPSPEED\nnum_processes: 2\n", "FSDP"),
             "unsharded": ("distributed_type: FSDP\nnum_processes: 2\nfsdp_config: {fsdp_version: 2}\n",
                           "dp_shard_size"),
             "fsdp+tp": ("distributed_type: FSDP\nnum_processes: 4\nfsdp_config: {fsdp_version: 2}\n"
                         "parallelism_config: {parallelism_config_tp_size: 2}\n", "per tensor-parallel piece")}
    for name, (text, hint) in cases.items():
        config = tmp_path / f"{name}.yaml"
        config.write_text(text)
        result = cli("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config", str(config),
                           "--dry-run")
        assert result.returncode == 2 and hint in result.stderr and "Traceback" not in result.stderr, (name,
                                                                                                       result.stderr)


def test_launch_dry_run_prints_the_memory_per_process_of_the_config_s_layout():
    """The shipped FSDP2 configs against DDP inside the replica: each process holds 1/g of parameters, gradients,
    AdamW's state and the outer state (the 7B preset is built on the meta device, so this runs anywhere)."""
    def memory(config: str, *extra: str) -> list[float]:
        result = cli("launch", str(RECIPES / "paper-150m-c4.yaml"), "--accelerate-config",
                           str(REPO / "accelerate_configs" / config), "--dry-run", "--", *extra)
        assert result.returncode == 0, result.stderr[-2000:]
        row = read_plan(result.stdout)["memory per process"]
        return [as_bytes(amount) for amount in re.findall(r"[\d.]+ [kMG]?B", row)]

    sharded = memory("fsdp-nodes.yaml", "--model_name_or_path", "llama-7b")
    whole = memory("hybrid.yaml", "--model_name_or_path", "llama-7b", "--replica_group_size", "8")
    assert len(sharded) == len(whole) == 5  # total, parameters, gradients, inner optimizer, outer state
    assert whole[1] == pytest.approx(6_477_332_480 * 4, rel=1e-3)  # fp32 parameters, all of them
    for part, full in zip(sharded, whole, strict=True):
        assert part == pytest.approx(full / 8, rel=1e-3)
    tiny = memory("cpu-fsdp-2x2.yaml", "--model_name_or_path", "tiny-llama")
    assert tiny[1] == pytest.approx(1_082_880 * 4 / 2, rel=1e-2)


def test_launch_dry_run_of_the_tensor_parallel_configs_prints_their_memory_and_bytes_per_process():
    """accelerate_configs/tp-nodes.yaml (2 nodes x 8 GPUs, each layer split over a node's GPUs) and
    fsdp-tp-nodes.yaml (split over 4, each piece sharded over 2 by FSDP2) with the 7B preset, cpu-tp-2x2.yaml and
    cpu-fsdp-tp-2x4.yaml with tiny-llama: each process holds 1/tp of every attention and MLP projection and the
    rest whole, and 1/dp_shard of that (counted here from the preset's parameter names), for parameters and for
    the bytes it syncs."""
    from hf_diloco.models import build_preset, byte_tokenizer

    cases = (("tp-nodes.yaml", "llama-7b", 8, 1), ("cpu-tp-2x2.yaml", "tiny-llama", 2, 1),
             ("fsdp-tp-nodes.yaml", "llama-7b", 4, 2), ("cpu-fsdp-tp-2x4.yaml", "tiny-llama", 2, 2))
    for config, model_name, tp, shards in cases:
        result = cli("launch", str(RECIPES / "paper-150m-c4.yaml"), "--accelerate-config",
                           str(REPO / "accelerate_configs" / config), "--dry-run", "--", "--model_name_or_path",
                           model_name)
        assert result.returncode == 0, result.stderr[-2000:]
        plan = read_plan(result.stdout)
        assert (f"2 of {tp} process(es) each, each split over its {tp} processes by tensor parallel" if shards == 1
                else f"2 of {tp * shards} process(es) each, each split over {tp} processes by tensor parallel and "
                     f"each piece sharded over {shards} by FSDP2") in plan["replicas in this launch"]
        with torch.device("meta"):
            model = build_preset(model_name, byte_tokenizer())
        split = sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight"))
        held = (split / tp + sum(p.numel() for p in model.parameters()) - split) / shards
        parameters = [as_bytes(x) for x in re.findall(r"parameters ([\d.]+ [kMG]?B)", plan["memory per process"])]
        assert parameters == [pytest.approx(held * 4, rel=1e-2)], plan["memory per process"]
        sent = as_bytes(plan["sent across replicas per process per round, M=2"])
        assert sent == pytest.approx(held * 4, rel=1e-2)  # fp32 ring all-reduce over 2 replicas: its bytes once


def test_launch_checks_replica_group_size_divides_the_processes():
    result = cli("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config",
                       str(REPO / "accelerate_configs" / "hybrid.yaml"), "--dry-run", "--",
                       "--replica_group_size", "3")
    assert result.returncode == 2 and "does not divide" in result.stderr and "Traceback" not in result.stderr
    ok = cli("launch", str(RECIPES / "tiny-pretrain.yaml"), "--accelerate-config",
                   str(REPO / "accelerate_configs" / "hybrid.yaml"), "--dry-run", "--", "--replica_group_size", "8")
    assert ok.returncode == 0, ok.stderr[-2000:]
