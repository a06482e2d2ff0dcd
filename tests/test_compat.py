"""Each patch in hf_diloco.compat against the transformers and accelerate installed: one test per patch, checking
what the patch relies on upstream. When one fails, upstream changed: the patch is either broken or no longer needed
(its docstring names the change it waits for).

No training: a Trainer over a tiny Llama is built and its methods are called directly; what only a distributed
process shows (accelerate's state and DDP wrapping on CPU processes) is read from one single-process gloo launch.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers.trainer
from helpers import REPO, env, free_port, tiny_llama
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_diloco import compat


def plain_trainer(tmp_path, callbacks=(), **settings) -> Trainer:
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, use_cpu=True, **settings)
    return Trainer(model=tiny_llama(), args=args, callbacks=list(callbacks))


def log_a_step(trainer: Trainer, loss: float) -> dict:
    """What Trainer does when a step's loss is due to be logged; returns the entry it logged."""
    trainer.state.global_step += 1
    trainer._globalstep_last_logged, trainer._total_loss_scalar = trainer.state.global_step - 1, 0.0
    trainer.control.should_log = True
    trainer._maybe_log_save_evaluate(torch.tensor(loss), None, trainer.model, None, 0.0, None, None,
                                     learning_rate=1e-3)
    return trainer.state.log_history[-1]


def test_trainer_logs_the_loss_through_the_module_level_nested_gather(tmp_path, monkeypatch):
    """replica_local_loss_logging: Trainer's logging all-gathers the loss by calling `transformers.trainer.
    nested_gather`, and while the patch is on that name is not called and the process's own loss is logged."""
    gathered = []

    def recording(tensors, parallel_mode, name=None):
        gathered.append(tensors)
        return tensors

    monkeypatch.setattr(transformers.trainer, "nested_gather", recording)
    trainer = plain_trainer(tmp_path)
    assert log_a_step(trainer, 2.0)["loss"] == 2.0
    assert len(gathered) == 1, "Trainer's logging no longer calls transformers.trainer.nested_gather"
    with compat.replica_local_loss_logging():
        assert log_a_step(trainer, 3.0)["loss"] == 3.0
    assert len(gathered) == 1, "the patch did not keep Trainer from gathering"
    assert transformers.trainer.nested_gather is recording, "the original is put back"


def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh state, as Trainer's arguments start from
    return Accelerator(cpu=True)


def batches(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_trl_gathers_its_step_metrics_through_the_accelerator_and_the_patch_makes_them_local():
    """replica_local_metric_gathers: TRL 1.16's SFTTrainer and DPOTrainer call the Accelerator's `gather_for_metrics`
    and `gather` inside compute_loss (when they stop, the patch has nothing left to do), and inside the block both
    give this process's values back untouched while the class's methods are whole again afterwards."""
    import inspect

    from accelerate import Accelerator
    from trl import DPOTrainer, SFTTrainer

    assert "self.accelerator.gather_for_metrics(" in inspect.getsource(SFTTrainer.compute_loss)
    dpo = inspect.getsource(DPOTrainer.compute_loss) + inspect.getsource(DPOTrainer._compute_loss)
    assert "self.accelerator.gather(" in dpo and "self.accelerator.gather_for_metrics(" in dpo
    accelerator = Accelerator(cpu=True)
    value = torch.tensor([3.0])
    with compat.replica_local_metric_gathers(accelerator):
        assert accelerator.gather(value) is value and accelerator.gather_for_metrics(value) is value
    assert "gather" not in vars(accelerator) and accelerator.gather.__func__ is Accelerator.gather


def test_accelerate_prepares_data_loaders_through_the_module_level_prepare_data_loader():
    """data_loader_shard: `Accelerator.prepare_data_loader` calls `accelerate.accelerator.prepare_data_loader` with
    num_processes, process_index and torch_device_mesh, so one process can be given shard 1 of 2."""
    prepared = accelerator()
    assert batches(prepared.prepare_data_loader(DataLoader(range(8), batch_size=2))) == [[0, 1], [2, 3], [4, 5],
                                                                                          [6, 7]]
    with compat.data_loader_shard(1, 2):
        shard = prepared.prepare_data_loader(DataLoader(range(8), batch_size=2))
    assert batches(shard) == [[2, 3], [6, 7]]


def test_accelerates_batch_sharding_reads_its_process_count_at_each_pass():
    """pass_through_batch_sharding: the loader accelerate shards wraps the batch sampler (whose sampler DiLoCoTrainer
    looks for) in a BatchSamplerShard, which reads num_processes and process_index when iterated."""
    from accelerate.data_loader import BatchSamplerShard

    data = DataLoader(range(8), batch_size=2)
    with compat.data_loader_shard(1, 2):
        loader = accelerator().prepare_data_loader(data)
    assert isinstance(loader.batch_sampler, BatchSamplerShard)
    assert loader.batch_sampler.batch_sampler.sampler is data.sampler
    assert batches(loader) == [[2, 3], [6, 7]]
    compat.pass_through_batch_sharding(loader)
    assert batches(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_trainer_hands_accelerate_the_parallelism_config_of_its_arguments_and_of_the_environment(tmp_path,
                                                                                                  monkeypatch):
    """parallelism_config_hidden: Trainer passes `args.parallelism_config` to its Accelerator, and accelerate makes
    one of its own when `accelerate launch` set ACCELERATE_USE_PARALLELISM_CONFIG; with the patch on, neither
    reaches the accelerator, and both are back afterwards."""
    from accelerate import ParallelismConfig

    given = ParallelismConfig(dp_shard_size=1)
    assert plain_trainer(tmp_path, parallelism_config=given).accelerator.parallelism_config is given
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    assert plain_trainer(tmp_path).accelerator.parallelism_config is not None, \
        "accelerate no longer reads ACCELERATE_USE_PARALLELISM_CONFIG"

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, parallelism_config=given)
    with compat.parallelism_config_hidden(args):
        trainer = Trainer(model=tiny_llama(), args=args)
    assert trainer.accelerator.parallelism_config is None
    assert args.parallelism_config is given and os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"


# One CPU process launched as accelerate launches one (LOCAL_RANK set, gloo): accelerate's state is MULTI_CPU.
ON_GLOO = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_diloco import compat
    from hf_diloco.parallel import ReplicaSharding

    facts = {}
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    facts["type"] = accelerator.state.distributed_type.name
    facts["fsdp_plugin"] = getattr(accelerator.state, "fsdp_plugin", None) is not None
    facts["prepared"] = type(accelerator.prepare_model(torch.nn.Linear(2, 2))).__name__

    wrapped = []
    compat.prepare_models_without_ddp(accelerator, lambda model: wrapped.append(model) or model)
    facts["prepared_patched"] = type(accelerator.prepare(torch.nn.Linear(2, 2))).__name__
    facts["evaluated_patched"] = type(accelerator.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)).__name__
    facts["wrapped"] = len(wrapped)

    trainer = SimpleNamespace(accelerator=accelerator, args=SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2}))
    compat.fsdp2_over_gloo(trainer, ReplicaSharding(dp_shard_size=1))
    facts["type_patched"] = accelerator.state.distributed_type.name
    facts["is_fsdp2"] = accelerator.is_fsdp2 and trainer.is_fsdp_enabled
    facts["type_made_again"] = AcceleratorState().distributed_type.name
    print(json.dumps(facts))
""")


@pytest.fixture(scope="module")
def on_gloo() -> dict:
    environment = {**env(), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-c", ON_GLOO], capture_output=True, text=True, env=environment,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.process
def test_accelerate_leaves_fsdp_off_on_cpu_processes_and_the_state_keeps_what_is_written(on_gloo):
    """fsdp2_over_gloo: on CPU processes accelerate ignores an FSDP plugin (the reason for the patch; when this
    fails accelerate enables FSDP on CPU and the patch can go); once written, the state is FSDP2, and a state
    made again copies PartialState._shared_state's 'distributed_type'."""
    assert on_gloo["type"] == "MULTI_CPU" and not on_gloo["fsdp_plugin"], \
        "accelerate now enables FSDP on CPU processes: compat.fsdp2_over_gloo is no longer needed"
    assert on_gloo["type_patched"] == "FSDP" and on_gloo["is_fsdp2"]
    assert on_gloo["type_made_again"] == "FSDP", "a state made again no longer starts from PartialState's type"


@pytest.mark.process
def test_accelerate_wraps_a_model_for_training_in_ddp_over_every_process_through_prepare_model(on_gloo):
    """prepare_models_without_ddp: prepared for training on CPU processes, accelerate wraps the model in DDP over
    the whole launch; `Accelerator.prepare` reaches the model through the instance's `prepare_model`, so with the
    patch no model is wrapped, and the ones prepared for training (not for evaluation) go to the caller's wrap."""
    assert on_gloo["prepared"] == "DistributedDataParallel"
    assert on_gloo["prepared_patched"] == on_gloo["evaluated_patched"] == "Linear"
    assert on_gloo["wrapped"] == 1


def test_trainer_rotates_checkpoints_inside_save_checkpoint_by_save_total_limit(tmp_path):
    """trainer_rotation_off: Trainer's `_save_checkpoint` ends by rotating with `args.save_total_limit`, counting
    every checkpoint-* folder (an unfinished one too) by mtime: with a limit of 2 it removes the complete
    checkpoint-1 for the unfinished checkpoint-2. With the patch on it removes nothing, and the limit is back."""
    for step in (1, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
        os.utime(tmp_path / f"checkpoint-{step}", (step, step))
    trainer = plain_trainer(tmp_path, save_total_limit=2, save_only_model=True)
    trainer.state.global_step = 3
    trainer._save_checkpoint(trainer.model, None)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"], \
        "Trainer no longer rotates inside _save_checkpoint (or no longer counts every folder): see the patch"

    trainer.state.global_step = 4
    with compat.trainer_rotation_off(trainer.args) as limit:
        trainer._save_checkpoint(trainer.model, None)
    assert limit == trainer.args.save_total_limit == 2
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]


def test_trainer_divides_a_process_own_token_count_by_get_tp_size(tmp_path):
    """trainer_tp_size: with average_tokens_across_devices off (the counts are the process's own), Trainer still
    divides each batch's token count by `get_tp_size()`, which would scale a tensor-parallel replica's loss."""

    class TensorParallel(Trainer):
        tp_size = 2

        def get_tp_size(self):
            return self.tp_size

    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                             average_tokens_across_devices=False)
    trainer = TensorParallel(model=tiny_llama(), args=args)
    batch = [{"labels": torch.ones(1, 8, dtype=torch.long)}]
    split = trainer._get_num_items_in_batch(batch, torch.device("cpu"))
    trainer.tp_size = compat.trainer_tp_size()
    own = trainer._get_num_items_in_batch(batch, torch.device("cpu"))
    assert own == 7, "the labels' 7 predicted tokens (a causal LM shifts its labels by one)"
    assert split == own / 2, \
        "Trainer no longer divides a process's own token count by get_tp_size(): compat.trainer_tp_size can go"


class Recorder(TrainerCallback):
    def __init__(self):
        self.calls = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.calls.append((state.global_step, dict(logs), sorted(kwargs)))


class LeftOut(Recorder):
    pass


def test_callbacks_take_on_log_as_the_callback_handler_calls_it(tmp_path, capsys):
    """dispatch_log: each callback's on_log gets what CallbackHandler.call_event passes (the same names), at the
    round's step, with Trainer's printers, flow callback and the classes skipped left out, and Trainer's state,
    control and log history untouched."""
    recorder, left_out = Recorder(), LeftOut()
    trainer = plain_trainer(tmp_path, callbacks=[recorder, left_out])
    trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, logs={"loss": 1.0})
    capsys.readouterr()
    upstream = recorder.calls.pop()

    trainer.control.should_log = True
    compat.dispatch_log(trainer, {"diloco/loss": 0.5}, step=7, skip=(LeftOut,))
    assert recorder.calls == [(7, {"diloco/loss": 0.5}, upstream[2])], \
        "CallbackHandler now passes on_log other arguments than compat.dispatch_log does"
    assert len(left_out.calls) == 1 and capsys.readouterr().out == "", "printers and skipped classes left out"
    assert trainer.state.global_step == 0 and trainer.control.should_log and trainer.state.log_history == []


def test_accelerate_still_reads_the_properties_replica_sharding_overrides():
    """hf_diloco.parallel.ReplicaSharding overrides three properties of accelerate's ParallelismConfig; accelerate
    must still read them for FSDP2's mesh (fsdp_dim_names), its own tensor-parallel preparation (tp_enabled) and
    the dimensions that share a batch (non_dp_dim_names), or the overrides change nothing."""
    import inspect

    import accelerate.accelerator
    import accelerate.parallelism_config
    import accelerate.utils.fsdp_utils

    from hf_diloco.parallel import ReplicaSharding

    assert "parallelism_config.fsdp_dim_names" in inspect.getsource(accelerate.utils.fsdp_utils.fsdp2_prepare_model)
    assert "parallelism_config.tp_enabled" in inspect.getsource(accelerate.accelerator.Accelerator)
    assert "self.non_dp_dim_names" in inspect.getsource(accelerate.parallelism_config.ParallelismConfig)
    sharding = ReplicaSharding(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    assert (sharding.fsdp_dim_names, sharding.tp_enabled, sharding.non_dp_dim_names) == (["dp_shard_cp"], False,
                                                                                          ["tp"])


def listening(pid: int | None = None) -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_torchft_binds_its_manager_and_checkpoint_servers_through_the_module_level_names():
    """torchft's Manager starts its gRPC server through `torchft.manager.ManagerServer` with `bind="[::]:PORT"`,
    and its HTTPTransport serves on `torchft.checkpointing.http_transport._IPv6HTTPServer(("", 0), ...)`: unpatched
    both listen on every interface; under compat.torchft_listeners_on("127.0.0.1") both listen on loopback only."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing import HTTPTransport
    from torchft.coordination import LighthouseServer

    timeout = timedelta(seconds=10)
    before = listening()
    wildcard = HTTPTransport(timeout=timeout, num_chunks=0)
    assert {ip for ip, _ in listening() - before} == {"::"}
    wildcard.shutdown()
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    before = listening()
    try:
        with compat.torchft_listeners_on("127.0.0.1"):
            transport = HTTPTransport(timeout=timeout, num_chunks=0)
            manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda _: None,
                              state_dict=lambda: {}, min_replica_size=1, rank=0, world_size=1,
                              store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse.address(),
                              replica_id="compat", hostname="127.0.0.1", checkpoint_transport=transport)
        opened = listening() - before
        assert len(opened) >= 2 and {ip for ip, _ in opened} == {"127.0.0.1"}, opened  # the manager and transport
        assert transport._server.server_address[0] == "127.0.0.1"
        manager.shutdown(wait=False)
    finally:
        lighthouse.shutdown()


def test_torchruns_static_rendezvous_builds_its_store_through_the_module_level_tcpstore():
    """The static rendezvous (every shipped accelerate config's) of torchrun's agent builds its store through
    `static_tcp_rendezvous.TCPStore`: unpatched the store listens on every interface; under
    compat.rendezvous_store_on_its_address on the rendezvous address only, and a worker's store reaches it."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    def serve(patched: bool) -> tuple[set[str], StaticTCPRendezvous, int]:
        port, before = free_port(), listening()
        rendezvous = StaticTCPRendezvous("127.0.0.1", port, rank=0, world_size=1, run_id="compat",
                                         timeout=10)
        if patched:
            with compat.rendezvous_store_on_its_address():
                info = rendezvous.next_rendezvous()
        else:
            info = rendezvous.next_rendezvous()
        info.store.set("seen", "yes")
        return {ip for ip, p in listening() - before if p == port}, rendezvous, port

    everywhere, first, _ = serve(patched=False)
    assert everywhere & {"::", "0.0.0.0"}, everywhere
    bound, second, port = serve(patched=True)
    assert bound == {"127.0.0.1"}
    worker = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    assert worker.get("compat/seen") == b"yes"
