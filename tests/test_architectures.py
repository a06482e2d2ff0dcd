"""Six architectures a user might bring, each built tiny from its config and saved with `save_pretrained` as a
user's own model folder (tests/helpers.py ARCHITECTURES): Llama, GPT-2 (Conv1D layers, tied head), Qwen3,
Qwen3-MoE (router and experts), Gemma 3 and Mistral. Each trains as 2 replicas x 2 rounds (tests/scripts/
replica_run.py, accelerate launch, gloo; in the session's shared launch of its layout); three of them with
FSDP2 inside each replica of two processes, the others as replicas of one process; GPT-2
with LoRA through `hf-diloco launch` of the LoRA recipe. A masked LM and an encoder-decoder are refused:
tests/test_models.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    ACCELERATE_CPU_2PROC,
    ACCELERATE_CPU_4PROC,
    REPO,
    env,
    free_port,
    share,
    tiny_model_folder,
)
from safetensors import safe_open

from hf_diloco.metrics import read_syncs

pytestmark = pytest.mark.process  # every test here starts processes

CAUSAL = ["llama", "gpt2", "qwen3", "qwen3-moe", "gemma3", "mistral"]
SHARDED = ["llama", "gpt2", "qwen3-moe"]  # also trained with FSDP2 inside each replica


def saved_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def folders_of(base, kind: str) -> dict:
    """Where kind's run lives: `model` the folder its model was built in, `run` its records, `saved` the model saved
    at the end."""
    return {"model": base / kind / "model", "run": base / kind, "saved": base / kind / "saved"}


def runs_of(kinds: list[str], **settings):
    """The runs of `kinds`' tiny models, each built and saved as a user's folder first, trained H = 2, 4 steps (two
    syncs), then saved: a function of their folder, for the shared launches (tests/helpers.py share)."""
    def make(base) -> dict[str, dict]:
        made = {}
        for kind in kinds:
            folders = folders_of(base, kind)
            tiny_model_folder(kind, folders["model"])
            made[kind] = {"model_folder": str(folders["model"]), "save_to": str(folders["saved"]),
                          "inner_steps": 2, "max_steps": 4, **settings}
        return made

    return make


share("architectures", runs_of([kind for kind in CAUSAL if kind not in SHARDED]))
share("architectures", runs_of(SHARDED, replica_group_size=2, fsdp=True), ACCELERATE_CPU_4PROC)


def trained(shared_runs, config=ACCELERATE_CPU_2PROC) -> dict[str, tuple[list[dict], dict]]:
    """kind → (every rank's record, its folders) of the shared launch of `config`."""
    return {kind: (ranks, folders_of(folder.parent, kind))
            for kind, (folder, ranks) in shared_runs("architectures", config).items()}


@pytest.fixture(scope="module")
def one_process_replicas(shared_runs):
    return trained(shared_runs)


@pytest.fixture(scope="module")
def sharded_replicas(shared_runs):
    return trained(shared_runs, ACCELERATE_CPU_4PROC)


def assert_saved_as_trained(folders: dict) -> None:
    """The saved model loads with from_pretrained and equals the trained parameters (rank 0's, after the last
    sync); its file holds the tensors `save_pretrained` of the untrained model wrote, each once (a tied head once;
    a MoE's experts one by one, as transformers writes its fused experts); and training moved every weight."""
    from transformers import AutoModelForCausalLM

    saved = folders["saved"]
    assert saved_names(saved) == saved_names(folders["model"])
    loaded = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    start = AutoModelForCausalLM.from_pretrained(folders["model"]).state_dict()
    trained = torch.load(folders["run"] / "final.pt")
    assert set(loaded) <= set(trained)
    for name, value in loaded.items():
        assert torch.equal(value, trained[name]), name
    unmoved = [name for name in loaded if torch.equal(loaded[name], start[name])]
    assert not [n for n in unmoved if "norm" not in n and "bias" not in n], unmoved


@pytest.mark.parametrize("kind", [kind for kind in CAUSAL if kind not in SHARDED])
def test_an_architecture_trains_as_replicas_that_agree_after_every_sync_and_saves_as_trained(one_process_replicas,
                                                                                            kind):
    """2 replicas x 2 rounds, one process each: both replicas hold the same parameters after each sync (a digest of
    every tensor), and the saved model is what was trained. (Llama, GPT-2 and Qwen3-MoE run the same with FSDP2
    inside each replica, below; replicas of one process are every other test's layout.)"""
    ranks, folders = one_process_replicas[kind]
    assert [step for step, _ in ranks[0]["digests"]] == [2, 4]
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert_saved_as_trained(folders)


@pytest.mark.parametrize("kind", SHARDED)
def test_fsdp2_inside_each_replica_trains_and_saves_a_tied_head_once(sharded_replicas, kind):
    """2 replicas x FSDP2 over 2 processes: member j of both replicas holds the same shard after every sync (the
    MoE's router and experts included), and the consolidated save holds each tensor once (a tied head is not
    written a second time) and is what was trained."""
    ranks, folders = sharded_replicas[kind]
    assert ranks[0]["digests"] == ranks[2]["digests"] and ranks[1]["digests"] == ranks[3]["digests"]
    assert [step for step, _ in ranks[0]["digests"]] == [2, 4]
    assert_saved_as_trained(folders)
    if kind == "qwen3-moe":
        from transformers import AutoModelForCausalLM

        names = set(AutoModelForCausalLM.from_pretrained(folders["model"]).state_dict())
        assert any(".mlp.gate." in n for n in names) and any(".experts." in n for n in names), sorted(names)[:20]


def test_the_lora_recipe_adapts_gpt2_with_targets_chosen_for_it(tmp_path):
    """`hf-diloco launch recipes/lora-finetune.yaml` on a GPT-2 folder (Conv1D layers, no q_proj): the recipe's
    `lora_target_modules: auto` puts the adapters on c_attn, the run syncs only them and saves the adapter."""
    folder = tiny_model_folder("gpt2", tmp_path / "gpt2")
    out = tmp_path / "lora"
    result = subprocess.run(
        [sys.executable, "-m", "hf_diloco.cli", "launch", "recipes/lora-finetune.yaml", "--accelerate-config",
         "accelerate_configs/cpu-2proc.yaml", "--port", str(free_port()), "--", "--model_name_or_path", str(folder),
         "--max_steps", "4", "--inner_steps", "2", "--block_size", "32", "--per_device_train_batch_size", "2",
         "--eval_strategy", "no", "--eval_on_start", "false", "--save_every_rounds", "0", "--report_to", "none",
         "--disable_tqdm", "true", "--merge_lora", "false", "--output_dir", str(out)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"c_attn"}
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("c_attn" in n and "lora_" in n for n in names), names
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        lora_values = sum(f.get_tensor(n).numel() for n in f.keys())
    assert [r["synced_parameters"] for r in read_syncs(out)] == [lora_values, lora_values]
