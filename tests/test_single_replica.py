"""One replica, H = 1, outer SGD lr 1, no momentum: DiLoCoTrainer must train exactly like plain Trainer."""

import pytest
import torch
from helpers import pattern_dataset, tiny_llama
from transformers import Trainer, TrainingArguments, default_data_collator

from hf_diloco import DiLoCoConfig, DiLoCoTrainer

COMMON = dict(
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    warmup_steps=3,
    lr_scheduler_type="cosine",
    weight_decay=0.1,
    max_grad_norm=1.0,
    max_steps=20,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    use_cpu=True,
    seed=0,
)


def train(trainer_cls, args):
    model = tiny_llama(seed=0)
    trainer = trainer_cls(model=model, args=args, train_dataset=pattern_dataset(), data_collator=default_data_collator)
    trainer.train()
    return model.state_dict()


def test_m1_h1_lr1_matches_plain_trainer(tmp_path):
    plain = train(Trainer, TrainingArguments(output_dir=str(tmp_path / "plain"), **COMMON))
    diloco = train(DiLoCoTrainer, DiLoCoConfig(output_dir=str(tmp_path / "diloco"), inner_steps=1, outer_lr=1.0,
                                               outer_momentum=0.0, outer_nesterov=False, **COMMON))
    worst = max((plain[k] - diloco[k]).abs().max().item() for k in plain)
    assert worst <= 1e-6, f"largest parameter difference {worst:.2e}"
    start = tiny_llama(seed=0).state_dict()
    assert max((plain[k] - start[k]).abs().max().item() for k in plain) > 1e-2, "training must move the weights"


def test_paper_outer_settings_give_the_hand_computed_first_round(tmp_path):
    """The comparison above can fail, and the outer step is the paper's: one round of H = 5 with outer Nesterov SGD
    (lr 0.7, momentum 0.9) from θ0, where plain Trainer reaches θ5 in the same 5 steps.

    Δ = θ0 − θ5; v = Δ; update = Δ + 0.9 v = 1.9 Δ; θ = θ0 − 0.7 · 1.9 Δ = θ0 + 1.33 (θ5 − θ0).
    Tolerance 1e-6 (fp32 rounding of the outer step); the result is far from θ5 itself.
    """
    settings = {**COMMON, "max_steps": 5}
    plain = train(Trainer, TrainingArguments(output_dir=str(tmp_path / "plain"), **settings))
    diloco = train(DiLoCoTrainer, DiLoCoConfig(output_dir=str(tmp_path / "diloco"), inner_steps=5, outer_lr=0.7,
                                               outer_momentum=0.9, outer_nesterov=True, **settings))
    start = tiny_llama(seed=0).state_dict()
    expected = {k: start[k] + 1.33 * (plain[k] - start[k]) for k in plain}
    worst = max((diloco[k] - expected[k]).abs().max().item() for k in plain)
    assert worst <= 1e-6, f"largest difference from the hand-computed round {worst:.2e}"
    assert max((plain[k] - diloco[k]).abs().max().item() for k in plain) > 1e-3


def test_outer_adamw_first_round_matches_hand_computation(tmp_path):
    """outer_optimizer adamw through the trainer, one round of H = 5 from θ0: AdamW's first step (bias-corrected
    m̂ = Δ, v̂ = Δ²) moves every value by lr · Δ / (|Δ| + eps), so θ = θ0 − 0.05 · Δ / (|Δ| + 1e-8) with
    Δ = θ0 − θ5 and θ5 plain Trainer's parameters after the same 5 steps. Tolerance 1e-6."""
    settings = {**COMMON, "max_steps": 5}
    plain = train(Trainer, TrainingArguments(output_dir=str(tmp_path / "plain"), **settings))
    diloco = train(DiLoCoTrainer, DiLoCoConfig(output_dir=str(tmp_path / "diloco"), inner_steps=5, outer_lr=0.05,
                                               outer_momentum=0.9, outer_optimizer="adamw", **settings))
    start = tiny_llama(seed=0).state_dict()
    worst = 0.0
    for k in plain:
        delta = start[k] - plain[k]
        expected = start[k] - 0.05 * delta / (delta.abs() + 1e-8)
        worst = max(worst, (diloco[k] - expected).abs().max().item())
    assert worst <= 1e-6, f"largest difference from the hand-computed AdamW round {worst:.2e}"


def test_syncs_written_for_single_replica(tmp_path):
    args = DiLoCoConfig(output_dir=str(tmp_path), inner_steps=6, **COMMON)
    train(DiLoCoTrainer, args)
    from hf_diloco.metrics import read_syncs

    rounds = read_syncs(tmp_path)
    assert [r["step"] for r in rounds] == [6, 12, 18, 20]
    assert all(r["bytes_per_replica"] == 0 and r["num_replicas"] == 1 for r in rounds)
    assert rounds[0]["loss"] == pytest.approx(rounds[0]["replica_losses"][0])
    assert torch.isfinite(torch.tensor([r["pseudo_grad_norm"] for r in rounds])).all()


def test_an_h_above_max_steps_trains_warns_once_and_syncs_at_the_end(tmp_path, caplog):
    """H = 30 over 20 steps, from Python as from the CLI: the run is allowed, says in one warning that the replicas
    sync once, at the last step (the words of the dry run and the app), and its only sync is the last step's."""
    import logging

    from hf_diloco.checks import rounds_note
    from hf_diloco.metrics import read_syncs

    with caplog.at_level(logging.WARNING, logger="hf_diloco"):
        train(DiLoCoTrainer, DiLoCoConfig(output_dir=str(tmp_path), inner_steps=30, **COMMON))
    said = [r.getMessage() for r in caplog.records if "inner steps is above max steps" in r.getMessage()]
    assert said == [f"DiLoCo: {rounds_note(30, 20)}"], said
    assert [r["step"] for r in read_syncs(tmp_path)] == [20]


def test_gradient_accumulation_counts_as_one_inner_step(tmp_path):
    """With 2 micro-batches per optimizer step, H = 3 means 3 optimizer steps, not 3 micro-batches."""
    settings = {**COMMON, "max_steps": 6, "gradient_accumulation_steps": 2}
    train(DiLoCoTrainer, DiLoCoConfig(output_dir=str(tmp_path), inner_steps=3, **settings))
    from hf_diloco.metrics import read_syncs

    assert [(r["step"], r["sync_steps"]) for r in read_syncs(tmp_path)] == [(3, 3), (6, 3)]


def test_peft_model_syncs_only_trainable_parameters(tmp_path):
    """With LoRA, only adapter weights form the pseudo-gradient; the frozen base stays bit-identical."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed=0)
    frozen_before = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    args = DiLoCoConfig(output_dir=str(tmp_path), inner_steps=5, **{**COMMON, "max_steps": 10})
    trainer = DiLoCoTrainer(model=model, args=args, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator)
    trainer.train()
    from hf_diloco.metrics import read_syncs

    rounds = read_syncs(tmp_path)
    assert {r["synced_parameters"] for r in rounds} == {trainable}
    assert trainable < sum(p.numel() for p in model.parameters()) / 10
    assert rounds[-1]["pseudo_grad_norm"] > 0
    for name, value in model.get_base_model().state_dict().items():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.equal(value, frozen_before[key]), name


def test_library_train_function_runs_a_whole_run_and_never_overwrites_one(tmp_path):
    """`hf_diloco.train.train(run, config)` (what `hf-diloco train` calls) builds the model and data, trains with
    the trainer the arguments name, and writes the model, run_config.json and run_metrics.json; a second call into
    the same folder is refused in one sentence and leaves the saved model as it was."""
    import json

    from safetensors.torch import load_file

    from hf_diloco import RunArguments
    from hf_diloco.errors import ConfigError
    from hf_diloco.metrics import read_syncs
    from hf_diloco.train import train as train_run

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "some words " * 10}) for i in range(60)))
    data = dict(dataset_name=str(corpus), block_size=32)
    settings = dict(max_steps=4, per_device_train_batch_size=4, eval_strategy="no", save_strategy="no",
                    report_to="none", disable_tqdm=True, use_cpu=True)
    out = tmp_path / "diloco"
    trainer = train_run(RunArguments(**data), DiLoCoConfig(output_dir=str(out), inner_steps=2, **settings))
    assert isinstance(trainer, DiLoCoTrainer)
    assert [r["step"] for r in read_syncs(out)] == [2, 4]
    stored = json.loads((out / "run_config.json").read_text())
    assert stored["trainer"] == "diloco" and stored["diloco"]["inner_steps"] == 2
    assert stored["run"]["block_size"] == 32 and json.loads((out / "run_metrics.json").read_text())["global_step"] == 4
    weights = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        train_run(RunArguments(**data), DiLoCoConfig(output_dir=str(out), inner_steps=2, **settings))
    assert (out / "model.safetensors").read_bytes() == weights

    baseline = tmp_path / "ddp"
    trainer = train_run(RunArguments(**data, trainer="ddp"), DiLoCoConfig(output_dir=str(baseline), **settings))
    assert type(trainer) is Trainer and not (baseline / "syncs.jsonl").exists()
    assert json.loads((baseline / "run_config.json").read_text())["trainer"] == "ddp"
    assert set(load_file(baseline / "model.safetensors")) == set(load_file(out / "model.safetensors"))


def test_round_metrics_reach_every_tracker_callback(tmp_path):
    """Any callback Trainer reports to (its integrations for trackio, W&B, MLflow, ... are such callbacks) gets each
    round's numbers as diloco/<name> through on_log, at the round's step, equal to the round record; the console
    printers do not (the round's line is printed already)."""
    from transformers import TrainerCallback

    from hf_diloco.metrics import read_syncs

    class Tracker(TrainerCallback):
        def __init__(self):
            self.logged = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if any(key.startswith("diloco/") for key in logs):
                self.logged.append((state.global_step, dict(logs)))

    tracker = Tracker()
    args = DiLoCoConfig(output_dir=str(tmp_path / "run"), inner_steps=5, outer_lr=0.7, outer_momentum=0.9,
                        **{**COMMON, "max_steps": 12})
    trainer = DiLoCoTrainer(model=tiny_llama(seed=0), args=args, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator, callbacks=[tracker])
    trainer.train()
    rounds = read_syncs(tmp_path / "run")
    assert [step for step, _ in tracker.logged] == [r["step"] for r in rounds] == [5, 10, 12]
    for (_, logs), record in zip(tracker.logged, rounds, strict=True):
        assert logs["diloco/loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert logs["diloco/bytes_per_replica"] == record["bytes_per_replica"]
        assert logs["diloco/replica_0/loss"] == pytest.approx(record["replica_losses"][0], rel=1e-12)
    assert not any(key.startswith("diloco/") for entry in trainer.state.log_history for key in entry), \
        "round metrics stay out of Trainer's own log history and console"


@pytest.mark.process
def test_round_metrics_read_back_from_a_local_trackio_project(tmp_path):
    """`report_to: trackio` (its local SQLite store, no Space): each round's diloco/ numbers are in the project, at
    the round's step and equal to syncs.jsonl, read back from trackio's own storage in another process."""
    import json
    import subprocess
    import sys

    from helpers import REPO, env

    from hf_diloco.metrics import read_syncs

    out, store = tmp_path / "run", tmp_path / "trackio"
    environment = {**env(), "TRACKIO_DIR": str(store), "HF_HUB_OFFLINE": "1"}
    train = [sys.executable, "-m", "hf_diloco.cli", "train", "--config", str(REPO / "recipes" / "tiny-pretrain.yaml"),
             "--output_dir", str(out), "--max_steps", "6", "--inner_steps", "3", "--block_size", "64",
             "--eval_steps", "3", "--disable_tqdm", "true", "--report_to", "trackio", "--project", "hfd",
             "--run_name", "round-metrics"]
    result = subprocess.run(train, capture_output=True, text=True, env=environment, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('hfd', 'round-metrics')))")
    logs = json.loads(subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, check=True,
                                     env=environment, cwd=REPO, timeout=120).stdout)
    logged = [entry for entry in logs if "train/diloco/loss" in entry]
    rounds = read_syncs(out)
    assert [entry["train/global_step"] for entry in logged] == [r["step"] for r in rounds] == [3, 6]
    for entry, record in zip(logged, rounds, strict=True):
        assert entry["train/diloco/loss"] == pytest.approx(record["loss"], rel=1e-9)
        assert entry["train/diloco/eval_loss"] == pytest.approx(record["eval_loss"], rel=1e-9)
        assert entry["train/diloco/pseudo_grad_norm"] == pytest.approx(record["pseudo_grad_norm"], rel=1e-9)
        assert entry["train/diloco/replica_0/loss"] == pytest.approx(record["replica_losses"][0], rel=1e-9)
