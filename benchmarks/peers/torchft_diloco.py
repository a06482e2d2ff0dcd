"""torchft's DiLoCo on the peer task: one replica per process, coordinated by a torchft Lighthouse.

    python torchft_diloco.py REPLICA REPLICAS LIGHTHOUSE_ADDR STEPS H OUT.json
Replica 0 writes OUT.json. The benchmark driver starts the Lighthouse (torchft's own coordination server).
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from task import SteadyClock, evaluate, report, setup, train_step
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

replica, replicas, lighthouse = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
steps, inner, out = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
model, optimizer, scheduler, batches, held_out = setup(steps, replica, replicas)
store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)
manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
    min_replica_size=replicas,
    use_async_quorum=False,
    load_state_dict=lambda state: (model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optim"])),
    state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
    replica_id=str(replica),
    store_addr="localhost",
    store_port=store.port,
    rank=0,
    world_size=1,
    lighthouse_addr=lighthouse,
    timeout=timedelta(seconds=60),
)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
clock = SteadyClock(steps)
with DiLoCo(manager, [model], optimizer, outer, sync_every=inner, backup_device=torch.device("cpu")):
    for step in range(1, steps + 1):
        train_step(model, optimizer, scheduler, next(batches))
        clock.step_done(step)
if replica == 0:
    report(out, tokens_per_second=clock.tokens_per_second(replicas), eval_loss=evaluate(model, held_out))
manager.shutdown(wait=False)
