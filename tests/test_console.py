"""The console of a run `hf-diloco train` starts (hf_diloco.console): calm by default, Trainer's with `verbose`; and
where such a run writes when its recipe names no folder."""

import json

import pytest

from hf_diloco import DiLoCoConfig, RunArguments
from hf_diloco.train import train as train_run


@pytest.mark.parametrize("verbose", [False, True], ids=["calm", "verbose"])
def test_trainers_dicts_of_logs_reach_the_console_only_with_verbose(tmp_path, capsys, verbose):
    """One replica, 4 steps, H = 2, a log every step and an evaluation at each sync. Calm: the console holds the two
    `[diloco]` sync lines, each with its held-out loss, and no dict of logs, while trainer_log.jsonl holds every
    one of them; verbose: Trainer's dicts of logs (loss, eval_loss) are printed as Trainer prints them."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"document {i}: " + "some words " * 10}) for i in range(60)))
    out = tmp_path / "run"
    train_run(RunArguments(dataset_name=str(corpus), block_size=32, verbose=verbose),
              DiLoCoConfig(output_dir=str(out), inner_steps=2, max_steps=4, per_device_train_batch_size=4,
                           logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="no",
                           report_to="none", use_cpu=True))
    console = capsys.readouterr()
    printed = (console.out + console.err).replace("\r", "\n").splitlines()
    syncs = [line for line in printed if line.startswith("[diloco] round")]
    assert len(syncs) == 2 and all("eval loss" in line for line in syncs), printed
    dicts = [line for line in printed if line.lstrip().startswith("{'")]
    logged = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert sum("loss" in entry for entry in logged) >= 4 and sum("eval_loss" in entry for entry in logged) == 2
    if verbose:
        assert any("'loss'" in line for line in dicts) and any("'eval_loss'" in line for line in dicts), dicts
    else:
        assert dicts == [], dicts


def test_a_recipe_without_an_output_folder_writes_under_runs_where_the_app_looks(tmp_path):
    """`hf-diloco train --config RECIPE` for a recipe that names no output_dir: the run goes to runs/<recipe name>,
    the app's default runs folder; a recipe's own output_dir, and a flag, still win."""
    from hf_diloco.recipes import parse_train_args

    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text("max_steps: 4\ninner_steps: 2\n")
    assert parse_train_args(str(recipe), [])[1].output_dir == "runs/my-recipe"
    assert parse_train_args(str(recipe), ["--output_dir", str(tmp_path / "elsewhere")])[1].output_dir == \
        str(tmp_path / "elsewhere")
    recipe.write_text("max_steps: 4\noutput_dir: mine\n")
    assert parse_train_args(str(recipe), [])[1].output_dir == "mine"
