"""A DiLoCoTrainer built from Python stops as `hf-diloco train` does: SIGTERM, or the stop file in its output folder,
ends training at the next sync boundary with a complete checkpoint of that step, and the process exits cleanly.

Each test runs a small script in a real process (a tiny Llama on learnable sequences, rounds of 5 steps, far more
steps than it will take, no checkpoint but the stop's), waits until two rounds are recorded, asks for the stop and
reads what the run left.
"""

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO, env, wait_for

from hf_diloco import checkpoints
from hf_diloco.metrics import read_syncs
from hf_diloco.runs import STOP_FILE, STOPPED_FILE

pytestmark = pytest.mark.process  # every test here starts processes

INNER_STEPS, MAX_STEPS = 5, 100_000

# The script's own SIGTERM handler is there before train() and must be back after it, never called meanwhile.
SCRIPT = textwrap.dedent(f"""
    import json, signal, sys

    sys.path.insert(0, "tests")
    from helpers import pattern_dataset, tiny_llama
    from transformers import default_data_collator

    from hf_diloco import DiLoCoConfig, DiLoCoTrainer

    def before(signum, frame):
        print("the handler from before train() was called", flush=True)

    signal.signal(signal.SIGTERM, before)
    args = DiLoCoConfig(output_dir=sys.argv[1], inner_steps={INNER_STEPS}, max_steps={MAX_STEPS},
                        per_device_train_batch_size=4, save_strategy="no", save_every_rounds=0, logging_steps=1000,
                        report_to="none", disable_tqdm=True, use_cpu=True)
    trainer = DiLoCoTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset(),
                            data_collator=default_data_collator)
    trainer.train()
    print(json.dumps({{"step": trainer.state.global_step,
                       "handler_restored": signal.getsignal(signal.SIGTERM) is before}}), flush=True)
""")


def ask_to_stop(how: str, process: subprocess.Popen, out: Path) -> None:
    if how == "SIGTERM":
        process.send_signal(signal.SIGTERM)
    else:
        (out / STOP_FILE).write_text("stop\n")


@pytest.mark.parametrize("how", ["SIGTERM", "stop file"])
def test_a_python_built_trainer_stops_at_a_round_boundary_with_a_complete_checkpoint(tmp_path, how):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(out)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
    try:
        wait_for(lambda: len(read_syncs(out)) >= 2 or process.poll() is not None, timeout=90,
                 what="two rounds", every=0.1)
        assert process.poll() is None, f"the run ended before it was asked to stop:\n{process.stderr.read()[-3000:]}"
        ask_to_stop(how, process, out)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    result = json.loads(stdout.strip().splitlines()[-1])
    step = result["step"]

    assert 2 * INNER_STEPS <= step < MAX_STEPS and step % INNER_STEPS == 0, f"stopped at step {step}, mid-round"
    assert read_syncs(out)[-1]["step"] == step, "the last round recorded is the one it stopped after"
    assert checkpoints.is_complete(out / f"checkpoint-{step}")
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == [f"checkpoint-{step}"]
    stopped = json.loads((out / STOPPED_FILE).read_text())
    assert (stopped["step"], stopped["checkpoint"]) == (step, f"checkpoint-{step}")
    assert not (out / STOP_FILE).exists(), "the request is consumed"
    assert result["handler_restored"] and "handler from before" not in stdout, \
        "train() catches SIGTERM only while it runs and hands the previous handler back"
    if how == "SIGTERM":
        assert "SIGTERM: stopping at the end of this round" in stdout
