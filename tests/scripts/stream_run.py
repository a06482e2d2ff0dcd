"""A streamed corpus trained by DiLoCo replicas under `accelerate launch`; each rank records what it trained on.

Argument: a JSON object, or a list of them trained in turn by the same processes (the start-up paid once).
`mode: cli` runs what `hf-diloco train` runs with `args` (its command line parsed by hf_diloco.cli, then
hf_diloco.train.train), where the corpus is split between replicas before it is tokenized; `mode: python` hands
DiLoCoTrainer an unsplit `datasets.IterableDataset` of `documents` one-block documents in `shards` shards (block i
starts with token i), which the trainer splits itself. Every training step's input rows are recorded; each rank writes
`rank<r>.json` into its `out`: per step, the document of each row (cli: the number written in its text, "doc-00012"
or, in a conversation, "q-00012"; python: its first token); `record: false` records nothing.
"""

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_diloco import launch  # noqa: E402
from hf_diloco.trainer import DiLoCoMixin  # noqa: E402

rank = int(os.environ.get("RANK", "0"))

settings: dict = {}
seen: list[list[int]] = []
tokenizer = None
training_step = DiLoCoMixin.training_step


def recording(self, model, inputs, num_items_in_batch=None):
    rows = inputs["input_ids"].tolist()
    if not settings.get("record", True):
        pass
    elif settings["mode"] == "cli":  # "doc-00012 xxx..." (or a conversation asking "q-00012"): that number
        seen.append([int(re.search(r"(?:doc|q)-(\d{5})", tokenizer.decode(row)).group(1)) for row in rows])
    else:
        seen.append([row[0] for row in rows])
    return training_step(self, model, inputs, num_items_in_batch)


DiLoCoMixin.training_step = recording


def train() -> None:
    global tokenizer
    if settings["mode"] == "cli":
        from hf_diloco import cli
        from hf_diloco import train as training
        from hf_diloco.models import byte_tokenizer
        from hf_diloco.recipes import parse_train_args

        tokenizer = byte_tokenizer()
        args = cli.parse_command_line(["train", *settings["args"]])
        training.train(*parse_train_args(args.config, args.overrides))
    else:
        from datasets import Dataset
        from helpers import tiny_llama
        from transformers import default_data_collator

        from hf_diloco import DiLoCoConfig, DiLoCoTrainer

        n = settings["documents"]
        blocks = [[i] + [(i + t) % 64 for t in range(1, 16)] for i in range(n)]
        stream = Dataset.from_dict({"input_ids": blocks, "labels": blocks}).to_iterable_dataset(
            num_shards=settings["shards"])
        config = DiLoCoConfig(output_dir=str(Path(settings["out"]) / "run"), inner_steps=settings["inner_steps"],
                              max_steps=settings["max_steps"], per_device_train_batch_size=settings["batch"],
                              learning_rate=1e-3, report_to="none", save_strategy="no", use_cpu=True,
                              logging_steps=1000, disable_tqdm=True)
        DiLoCoTrainer(model=tiny_llama(), args=config, train_dataset=stream,
                      data_collator=default_data_collator).train()


given = json.loads(sys.argv[1])
for settings in given if isinstance(given, list) else [given]:
    seen = []
    try:
        train()
    finally:
        (Path(settings["out"]) / f"rank{rank}.json").write_text(json.dumps(seen))
# Leave as `hf-diloco train` does (hf_diloco.cli): gloo's threads torn down at interpreter exit can abort a process
# that finished every run.
launch.destroy_process_groups()
launch.exit_process(0)
