"""accelerate's LocalSGD on the peer task: parameter averaging every H steps, one replica per process.

    accelerate launch --multi_gpu --num_processes 2 ... accelerate_localsgd.py STEPS H OUT.json
"""

import sys

from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.local_sgd import LocalSGD
from task import SteadyClock, evaluate, report, setup, train_step

steps, inner, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# cpu=True: MULTI_CPU over gloo; without broadcast_buffers=False DDP would broadcast buffers every forward.
accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
model, optimizer, scheduler, batches, held_out = setup(steps, accelerator.process_index, accelerator.num_processes)
model, optimizer = accelerator.prepare(model, optimizer)  # the scheduler is stepped by hand, once per step
clock = SteadyClock(steps)
with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=inner, enabled=True) as sgd:
    for step in range(1, steps + 1):
        train_step(model, optimizer, scheduler, next(batches))
        sgd.step()
        clock.step_done(step)
if accelerator.is_main_process:
    report(out, tokens_per_second=clock.tokens_per_second(accelerator.num_processes),
           eval_loss=evaluate(accelerator.unwrap_model(model), held_out))
accelerator.end_training()
