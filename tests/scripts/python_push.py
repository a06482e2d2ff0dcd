"""Train a DiLoCoTrainer from Python (no CLI, so no run_config.json) and push it with `trainer.push_to_hub()`.

Arguments: the output folder, a private folder and optionally `--push-while-training`. The base model is saved to
and loaded from `<private>/tiny-base` and the corpus read from `<private>/corpus.jsonl`, as a user's own files would
be; the model gets LoRA adapters (peft writes the base model's path into adapter_config.json and its README). With
`--push-while-training`, the args also say `push_to_hub=True` and `hub_strategy="all_checkpoints"` with a
checkpoint every 4 steps, so Trainer pushes at each save during training (and would push each checkpoint folder).
Prints the type and URL of what push_to_hub returned. The Hub endpoint and token come from HF_ENDPOINT and HF_TOKEN
(the test's local server).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from datasets import load_dataset  # noqa: E402
from helpers import pattern_blocks, tiny_llama  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer  # noqa: E402

output_dir, private = sys.argv[1], Path(sys.argv[2])
while_training = "--push-while-training" in sys.argv[3:]
tiny_llama().save_pretrained(private / "tiny-base")
corpus = private / "corpus.jsonl"
corpus.write_text("".join(json.dumps({"input_ids": b, "labels": b}) + "\n" for b in pattern_blocks()))

model = AutoModelForCausalLM.from_pretrained(private / "tiny-base")
model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
train = load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(private / "cache"))
saving = {"save_strategy": "no"}
if while_training:
    saving = {"push_to_hub": True, "hub_strategy": "all_checkpoints", "save_strategy": "steps", "save_steps": 4}
config = DiLoCoConfig(output_dir=output_dir, inner_steps=4, max_steps=8, outer_lr=0.6, outer_momentum=0.8,
                      learning_rate=2e-3, per_device_train_batch_size=4, report_to="none", disable_tqdm=True,
                      use_cpu=True, hub_model_id="alice/from-python", **saving)
trainer = DiLoCoTrainer(model=model, args=config, train_dataset=train, data_collator=default_data_collator)
trainer.train()
commit = trainer.push_to_hub(commit_message="DiLoCo from Python")
print(f"push_to_hub returned {type(commit).__name__} {commit.commit_url}")
