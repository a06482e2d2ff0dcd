"""How far a sync travels through the code: from the DiLoCo callback's `on_step_end` to the network
(`ReplicaComm.sum_replicas`, or torchft's) and to the copy back (`Fragment.copy_back`), on one replica in this
process (tiny model, H = 2): a blocking sync, or with `--sync-delay` an overlapped one (its exchange runs in the
engine's background thread, its copy back at the landing τ steps later), on the torch backend or on torchft (a
Lighthouse served in this process, one replica).

Prints each call chain (every hf_diloco frame from on_step_end, or from the top of the background thread, down to
the target: the "hops"), the modules it crosses, and how many distinct hf_diloco functions, over how many modules,
the steps that sync call. A measure of the code's shape, not of time. `--repo` picks the tree to import (default:
this one), so that two trees compare:

    python benchmarks/hops.py [--backend torch|torchft] [--sync-delay 1] [--repo /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

TARGETS = ("sum_replicas", "copy_back")  # the network, and θ_i ← θ_global


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--backend", choices=("torch", "torchft"), default="torch")
    parser.add_argument("--sync-delay", type=int, default=0, help="τ: 0 blocks, 1 overlaps one inner step")
    args = parser.parse_args()
    sys.path.insert(0, args.repo)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, default_data_collator

    from hf_diloco import DiLoCoConfig, DiLoCoTrainer

    package = str(Path(args.repo) / "hf_diloco")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=16))
    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64} for _ in range(16)]
    chains: dict[str, list[str]] = {}
    called: set[str] = set()
    state = {"inside": False}

    def name(frame) -> str:
        return f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"

    def is_step_end(frame) -> bool:
        return frame.f_code.co_name == "on_step_end" and "callback" in frame.f_code.co_filename

    def chain_of(frame) -> list[str]:
        stack, walk = [], frame
        while walk is not None:
            if walk.f_code.co_filename.startswith(package):
                stack.append(name(walk))
            if is_step_end(walk):
                break
            walk = walk.f_back
        return list(reversed(stack))

    def profile(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return
        background = threading.current_thread() is not threading.main_thread()
        if not background:
            if event == "return" and is_step_end(frame):
                state["inside"] = False
            if event != "call":
                return
            state["inside"] |= is_step_end(frame)
            if not state["inside"]:
                return
        elif event != "call":
            return
        called.add(name(frame))
        target = frame.f_code.co_name
        key = f"{target} (background thread)" if background else target
        if target in TARGETS and key not in chains:
            chains[key] = chain_of(frame)

    settings = {}
    lighthouse = None
    if args.backend == "torchft":
        from hf_diloco.launch import start_lighthouse

        lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=1, grace_seconds=0.1)
        settings = dict(outer_backend="torchft", lighthouse=lighthouse.address(), min_replicas=1,
                        replica_address="127.0.0.1")
    try:
        with tempfile.TemporaryDirectory() as out:
            config = DiLoCoConfig(output_dir=out, inner_steps=2, max_steps=6, per_device_train_batch_size=2,
                                  sync_delay=args.sync_delay, save_strategy="no", save_every_rounds=0,
                                  report_to="none", disable_tqdm=True, use_cpu=True, eval_strategy="no", **settings)
            trainer = DiLoCoTrainer(model=model, args=config, train_dataset=data,
                                    data_collator=default_data_collator)
            sys.setprofile(profile)
            threading.setprofile(profile)
            try:
                trainer.train()
            finally:
                sys.setprofile(None)
                threading.setprofile(None)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    kind = "blocking" if args.sync_delay == 0 else f"overlapped (sync_delay {args.sync_delay})"
    print(f"tree: {args.repo}; backend {args.backend}; {kind} sync")
    for key, chain in chains.items():
        modules = sorted({hop.split(".")[0] for hop in chain})
        print(f"hops to {key}: {len(chain) - 1} over {len(modules)} modules ({', '.join(modules)})")
        for depth, hop in enumerate(chain):
            print(f"  {'  ' * depth}{hop}")
    touched = sorted({function.split(".")[0] for function in called})
    print(f"the steps that sync (every call in hf_diloco under on_step_end and in the background thread): "
          f"{len(called)} distinct functions over {len(touched)} modules ({', '.join(touched)})")
    return 0 if "copy_back" in chains else 1


if __name__ == "__main__":
    sys.exit(main())
