"""The peer task, shared by the peer scripts: model, data shard, inner optimizer, schedule, evaluation.

Every implementation gets the same tiny Llama (seed 0), the same blocks and held-out tail, AdamW lr 1e-3 wd 0.1,
20 warmup steps then cosine, clip 1.0, batch 8 per replica. Only the cross-replica algorithm differs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

from hf_diloco.config import RunArguments
from hf_diloco.data import build_datasets
from hf_diloco.models import load_model_and_tokenizer

BATCH = 8


def setup(steps: int, replica: int, replicas: int, seed: int = 0):
    """(model, optimizer, scheduler, batches of this replica, held-out set)."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    train, held_out = build_datasets(RunArguments(), tokenizer)
    shard = train.shard(num_shards=replicas, index=replica, contiguous=False).with_format("torch")
    generator = torch.Generator().manual_seed(seed + replica)
    loader = DataLoader(shard, batch_size=BATCH, shuffle=True, drop_last=True, generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 20, steps)
    return model, optimizer, scheduler, forever(loader), held_out.with_format("torch")


def forever(loader):
    while True:
        yield from loader


def train_step(model, optimizer, scheduler, batch) -> float:
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


@torch.no_grad()
def evaluate(model, held_out) -> float:
    model.eval()
    total, count = 0.0, 0
    for batch in DataLoader(held_out, batch_size=16):  # weighted by batch size, as Trainer's eval_loss is
        total += model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item() * len(batch["input_ids"])
        count += len(batch["input_ids"])
    model.train()
    return total / count


class SteadyClock:
    """Times the steps after the first tenth, as hf-diloco's run_metrics.json does."""

    def __init__(self, steps: int):
        self.first = max(1, steps // 10)
        self.started = self.ended = None
        self.counted = 0

    def step_done(self, step: int) -> None:
        """Call after step `step` (1-based) finished."""
        now = time.perf_counter()
        if step == self.first:
            self.started = now
        elif step > self.first:
            self.ended, self.counted = now, step - self.first

    def tokens_per_second(self, replicas: int) -> float:
        return self.counted * BATCH * 256 * replicas / (self.ended - self.started)


def report(path: str, **numbers) -> None:
    Path(path).write_text(json.dumps(numbers) + "\n")
    print(json.dumps(numbers), file=sys.stderr)
