"""How far one blocking sync travels through the code: from the DiLoCo callback's `on_step_end` to the copy back
(`Fragment.copy_back`), on one replica in this process (torch backend, tiny model, H = 2, one sync).

Prints the call chain at the copy back (each hf_diloco frame from on_step_end down: the "hops"), the modules it
crosses, and how many distinct hf_diloco functions, over how many modules, the step that syncs calls. A measure
of the code's shape, not of time. `--repo` picks the tree to import (default: this one), so that two trees compare:

    python benchmarks/hops.py [--repo /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
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
    data = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64} for _ in range(8)]
    chain: list[str] = []
    called: set[str] = set()
    state = {"inside": False}

    def name(frame) -> str:
        return f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}"

    def profile(frame, event, arg):
        if not frame.f_code.co_filename.startswith(package):
            return
        step_end = frame.f_code.co_name == "on_step_end" and "callback" in frame.f_code.co_filename
        if event == "return" and step_end:
            state["inside"] = False
        if event != "call":
            return
        state["inside"] |= step_end
        if not state["inside"]:
            return
        called.add(name(frame))
        if frame.f_code.co_name == "copy_back" and not chain:
            stack, walk = [], frame
            while walk is not None:
                if walk.f_code.co_filename.startswith(package):
                    stack.append(name(walk))
                if walk.f_code.co_name == "on_step_end" and "callback" in walk.f_code.co_filename:
                    break
                walk = walk.f_back
            chain.extend(reversed(stack))

    with tempfile.TemporaryDirectory() as out:
        config = DiLoCoConfig(output_dir=out, inner_steps=2, max_steps=2, per_device_train_batch_size=2,
                              save_strategy="no", save_every_rounds=0, report_to="none", disable_tqdm=True,
                              use_cpu=True, eval_strategy="no")
        trainer = DiLoCoTrainer(model=model, args=config, train_dataset=data, data_collator=default_data_collator)
        sys.setprofile(profile)
        try:
            trainer.train()
        finally:
            sys.setprofile(None)
    modules = sorted({hop.split(".")[0] for hop in chain})
    print(f"tree: {args.repo}")
    print(f"hops from on_step_end to the copy back: {len(chain) - 1} over {len(modules)} modules "
          f"({', '.join(modules)})")
    for depth, hop in enumerate(chain):
        print(f"  {'  ' * depth}{hop}")
    touched = sorted({function.split(".")[0] for function in called})
    print(f"the whole sync (on_step_end of the step that syncs, every call in hf_diloco): {len(called)} distinct "
          f"functions over {len(touched)} modules ({', '.join(touched)})")
    return 0 if chain else 1


if __name__ == "__main__":
    sys.exit(main())
