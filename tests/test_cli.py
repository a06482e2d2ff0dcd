"""The command line: bad input gets one sentence and a non-zero exit, never a traceback; launch builds the command."""

import json

import pytest
from helpers import REPO, hf_diloco

RECIPE = str(REPO / "recipes" / "tiny-pretrain.yaml")


def assert_one_sentence_error(result, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("hf-diloco: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def bad_inputs(tmp_path):
    unknown_key = tmp_path / "unknown.yaml"
    unknown_key.write_text("inner_steps: 10\nouter_lerning_rate: 0.5\n")
    no_text = tmp_path / "no_text.jsonl"
    no_text.write_text("\n".join(json.dumps({"content": f"line {i}"}) for i in range(5)))
    out = str(tmp_path / "out")
    return {
        "H = 0": (["--inner_steps", "0"], ["inner_steps"]),
        "negative outer lr": (["--outer_lr", "-0.1"], ["outer_lr"]),
        "unknown recipe key": (["--config", str(unknown_key)], ["outer_lerning_rate"]),
        "no text column": (["--dataset_name", str(no_text)], ["text", "content"]),
        "missing model path": (["--model_name_or_path", str(tmp_path / "nowhere")], ["does not exist"]),
        "missing recipe": (["--config", str(tmp_path / "absent.yaml")], ["absent.yaml"]),
        "_out": out,
    }


@pytest.mark.parametrize("case", ["H = 0", "negative outer lr", "unknown recipe key", "no text column",
                                  "missing model path", "missing recipe"])
def test_bad_input_is_one_sentence_and_nonzero_exit(bad_inputs, case):
    args, words = bad_inputs[case]
    base = [] if "--config" in args else ["--config", RECIPE]
    result = hf_diloco("train", *base, "--output_dir", bad_inputs["_out"], "--max_steps", "2", *args)
    assert_one_sentence_error(result, *words)


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    rounds = out / "sync_rounds.jsonl"
    rounds.write_text('{"round": 1}\n')
    result = hf_diloco("train", "--config", RECIPE, "--output_dir", str(out), "--max_steps", "2")
    assert_one_sentence_error(result, "already holds a run")
    assert rounds.read_text() == '{"round": 1}\n'


def test_launch_checks_the_accelerate_config_before_starting(tmp_path):
    result = hf_diloco("launch", RECIPE, "--accelerate-config", str(tmp_path / "nope.yaml"))
    assert_one_sentence_error(result, "nope.yaml")


def test_launch_dry_run_prints_the_accelerate_command(tmp_path):
    config = str(REPO / "accelerate_configs" / "cpu-2proc.yaml")
    result = hf_diloco("launch", RECIPE, "--accelerate-config", config, "--dry-run", "--",
                       "--output_dir", str(tmp_path / "x"), "--inner_steps", "25")
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1].split()
    assert command[1:4] == ["-m", "accelerate.commands.launch", "--config_file"]
    assert command[command.index("--config") + 1] == RECIPE
    assert command[-2:] == ["--inner_steps", "25"]
    assert not (tmp_path / "x").exists(), "a dry run starts nothing"


def test_train_help_lists_diloco_fields():
    result = hf_diloco("train", "--help")
    assert result.returncode == 0
    for name in ("--inner_steps", "--outer_lr", "--outer_momentum", "--model_name_or_path", "--dataset_name"):
        assert name in result.stdout
