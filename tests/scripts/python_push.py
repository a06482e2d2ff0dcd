"""Train a DiLoCoTrainer from Python (no CLI, so no run_config.json) and push it with `trainer.push_to_hub()`.

Argument: the output folder. The Hub endpoint and token come from HF_ENDPOINT and HF_TOKEN (the test's local server).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import pattern_dataset, tiny_llama  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from hf_diloco import DiLoCoConfig, DiLoCoTrainer  # noqa: E402

config = DiLoCoConfig(output_dir=sys.argv[1], inner_steps=4, max_steps=8, outer_lr=0.6, outer_momentum=0.8,
                      learning_rate=2e-3, per_device_train_batch_size=4, save_strategy="no", report_to="none",
                      disable_tqdm=True, use_cpu=True, hub_model_id="alice/from-python")
trainer = DiLoCoTrainer(model=tiny_llama(), args=config, train_dataset=pattern_dataset(),
                        data_collator=default_data_collator)
trainer.train()
trainer.push_to_hub()
