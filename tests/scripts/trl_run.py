"""One replica of TRL's SFTTrainer or DPOTrainer with DiLoCo (hf_diloco.trl), run under `accelerate launch`.

Argument: a JSON object: `out` (folder), `trainer` ("sft" or "dpo"), `lora` (bool, or "peft_config": LoRA given
to the trainer as TRL takes it), or `out` and `guide_block`:
"sft" or "dpo" (that block of docs/guides/your-model.md, run as written into `<out>/run`); or a list of them, trained in
turn by the same processes. The tiny-llama preset with the
byte tokenizer (and its chat template) trains on the first 64 rows of the built-in chat or preference data, H = 2,
4 steps, logging every step. Each rank writes `rank<r>.json`: the torch.distributed collectives it made inside
training steps (TRL gathers its metrics there), a digest of its parameters after every sync, and the metrics TRL
logged; the model (or adapter) is saved to `<out>/saved`.
"""

import copy
import hashlib
import json
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import set_seed

from hf_diloco import launch
from hf_diloco.config import RunArguments
from hf_diloco.data import builtin_chat, builtin_preferences
from hf_diloco.models import give_chat_template, load_model_and_tokenizer
from hf_diloco.train import add_lora
from hf_diloco.trl import DiLoCoDPOConfig, DiLoCoDPOTrainer, DiLoCoSFTConfig, DiLoCoSFTTrainer

inside_step = [False]
calls: list[str] = []


def counting(name, original):
    def wrapper(*args, **kwargs):
        if inside_step[0]:
            calls.append(name)
        return original(*args, **kwargs)

    return wrapper


for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce", "gather", "scatter", "barrier", "all_to_all", "send", "recv"):
    original = getattr(dist, name, None)
    if original is not None:
        setattr(dist, name, counting(name, original))
        setattr(dist.distributed_c10d, name, getattr(dist, name))


def digest(module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(settings: dict) -> None:
    out = Path(settings["out"])
    calls.clear()
    set_seed(0)  # the same LoRA initialisation on every replica, as hf-diloco train seeds it
    model, tokenizer = load_model_and_tokenizer("tiny-llama", max_positions=256)
    give_chat_template(tokenizer)
    reference = copy.deepcopy(model) if settings["trainer"] == "dpo" and not settings["lora"] else None
    peft = {}
    if settings["lora"] == "peft_config":  # TRL's own way: the trainer wraps the model
        from peft import LoraConfig

        peft = {"peft_config": LoraConfig(r=4, target_modules="all-linear")}
    elif settings["lora"]:
        model = add_lora(model, RunArguments(lora_r=4))
    common = dict(output_dir=str(out / "run"), inner_steps=2, max_steps=4, per_device_train_batch_size=2,
                  learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", save_every_rounds=0,
                  gradient_checkpointing=False, bf16=False, disable_tqdm=True, seed=0, max_length=128)
    if settings["trainer"] == "sft":
        trainer = DiLoCoSFTTrainer(model=model, args=DiLoCoSFTConfig(**common), train_dataset=builtin_chat().select(
            range(64)), processing_class=tokenizer, **peft)
    else:
        trainer = DiLoCoDPOTrainer(model=model, ref_model=reference, args=DiLoCoDPOConfig(**common),
                                   train_dataset=builtin_preferences().select(range(64)), processing_class=tokenizer)
    step = trainer.training_step

    def counted_step(*args, **kwargs):
        inside_step[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            inside_step[0] = False

    trainer.training_step = counted_step
    sync = trainer.diloco.sync
    digests = []

    def recorded_sync(step, max_steps):
        outcome = sync(step, max_steps)
        if outcome.synced:
            digests.append((trainer.state.global_step, digest(trainer.model)))
        return outcome

    trainer.diloco.sync = recorded_sync
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    sizes = {"trainable": [n for n, p in trainer.model.named_parameters() if p.requires_grad],
             "synced": sum(p.numel() for p in trainer.diloco.outer.params),
             "trainable_values": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"calls": list(calls), "digests": digests,
                                                                  "logged": logged, **sizes}))
    trainer.save_model(str(out / "saved"))


def run_guide_block(settings: dict) -> None:
    """The SFT or DPO block (`guide_block`: "sft" or "dpo") of docs/guides/your-model.md as a user saves and
    launches it, its output_dir moved to `out`."""
    import re

    kind = settings["guide_block"]
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "your-model.md").read_text()
    trainer = "DiLoCoSFTTrainer(" if kind == "sft" else "DiLoCoDPOTrainer("
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if trainer in block)
    folder = f'output_dir="runs/{kind}"'
    assert folder in code, code
    exec(code.replace(folder, f"output_dir={str(Path(settings['out']) / 'run')!r}"), {})


given = json.loads(sys.argv[1])
for settings in given if isinstance(given, list) else [given]:
    run_guide_block(settings) if settings.get("guide_block") else run(settings)
launch.destroy_process_groups()
launch.exit_process(0)
