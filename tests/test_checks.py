"""One set of value checks (hf_diloco.checks) behind DiLoCoConfig and the app's form: a value one of them refuses,
the other refuses too, in the same sentence; and the layers stay apart (config imports no backend, the app no
torch, the library not the app)."""

import subprocess
import sys
from dataclasses import fields

import pytest
from helpers import REPO

sys.path.insert(0, str(REPO))
from app import forms  # noqa: E402
from hf_diloco import checks  # noqa: E402
from hf_diloco.config import DiLoCoConfig, RunArguments  # noqa: E402
from hf_diloco.errors import ConfigError  # noqa: E402

# Text typed into the form -> what the command line hands DiLoCoConfig for the same text (argparse converts it
# with the field's own type).
AS_FLAG = {"inner_steps": int, "outer_lr": float, "outer_momentum": float}
BAD = [("outer_momentum", "1.0"), ("outer_momentum", "1"), ("outer_momentum", "-0.1"), ("outer_momentum", "nan"),
       ("outer_lr", "-0.1"), ("outer_lr", "0"), ("outer_lr", "inf"), ("outer_lr", "nan"),
       ("inner_steps", "0"), ("inner_steps", "-3")]
GOOD = [("outer_momentum", "0"), ("outer_momentum", "0.99"), ("outer_lr", "0.7"), ("outer_lr", "1e-3"),
        ("inner_steps", "1"), ("inner_steps", "500")]


def form_sentence(name: str, text: str) -> str | None:
    try:
        forms.check_knobs(forms.Knobs(**{name: text}))
    except forms.FormError as error:
        return str(error)
    return None


def config_sentence(name: str, value, tmp_path) -> str | None:
    try:
        DiLoCoConfig(output_dir=str(tmp_path / "out"), use_cpu=True, **{name: value})
    except ConfigError as error:
        return str(error)
    return None


def test_the_forms_config_knobs_are_exactly_the_checked_fields_it_shows():
    """Every knob of the form that is a DiLoCoConfig field with a range goes through hf_diloco.checks (a knob added
    later cannot drift from the config), and the list of cases below covers each of them."""
    config_fields = {f.name for f in fields(DiLoCoConfig)} | {f.name for f in fields(RunArguments)}
    shown = {f.name for f in fields(forms.Knobs)} & config_fields & set(checks.FIELDS)
    assert shown == set(forms.CONFIG_KNOBS) == set(AS_FLAG) == {name for name, _ in BAD} == {name for name, _ in GOOD}


@pytest.mark.parametrize(("name", "text"), BAD)
def test_the_form_and_the_config_refuse_the_same_value_in_the_same_sentence(name, text, tmp_path):
    said = form_sentence(name, text)
    assert said is not None and said == config_sentence(name, AS_FLAG[name](text), tmp_path), said
    assert said.startswith(name) and said.endswith(f"got {AS_FLAG[name](text)!r}."), said


@pytest.mark.parametrize(("name", "text"), GOOD)
def test_good_values_pass_both(name, text, tmp_path):
    assert form_sentence(name, text) is None
    assert config_sentence(name, AS_FLAG[name](text), tmp_path) is None


def test_auto_h_passes_both_and_text_that_is_no_number_gets_the_fields_sentence(tmp_path):
    assert form_sentence("inner_steps", "auto") is None and config_sentence("inner_steps", "auto", tmp_path) is None
    assert form_sentence("inner_steps", "5.5") == "inner_steps (H) must be a whole number of at least 1, got '5.5'."
    assert form_sentence("outer_lr", "fast") == "outer_lr must be a positive number, got 'fast'."


@pytest.mark.process
def test_torchft_fields_are_checked_without_importing_the_backend(tmp_path):
    """The torchft ranges are refused by the config in one sentence, and building a torchft config loads neither
    hf_diloco.torchft_backend nor torchft itself (only looks for it)."""
    assert config_sentence("min_replicas", 0, tmp_path) is None, "a torch-backend run ignores the torchft fields"
    for field, value, words in (("min_replicas", 0, "min_replicas must be at least 1, got 0."),
                                ("replica_id", 3, "replica_id must be in [0, num_replicas=2), got 3."),
                                ("round_seconds", float("inf"), "round_seconds must be 0 (off) or a positive number"),
                                ("end_linger_seconds", -1.0, "end_linger_seconds must be 0 or more, got -1.0.")):
        with pytest.raises(ConfigError) as refused:
            DiLoCoConfig(output_dir=str(tmp_path), use_cpu=True, outer_backend="torchft", num_replicas=2,
                         lighthouse="http://127.0.0.1:1", **{field: value})
        assert words in str(refused.value)
    program = ("import sys; from hf_diloco.config import DiLoCoConfig; "
               "DiLoCoConfig(output_dir='x', use_cpu=True, outer_backend='torchft', lighthouse='http://127.0.0.1:1'); "
               "import hf_diloco.launch, hf_diloco.cli; "
               "print(sorted(m for m in sys.modules if 'torchft' in m or m.split('.')[0] == 'app'))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", "config, launch and cli import no backend and not the app"


def test_the_forms_task_is_one_of_the_tasks_or_blank():
    """The task picker offers the tasks hf_diloco.tasks defines; anything else sent to the form is refused."""
    assert form_sentence("task", "translation") == ("task must be one of causal-lm, seq2seq, masked-lm, "
                                                    "sequence-classification, image-classification, got "
                                                    "'translation'.")
    assert all(form_sentence("task", name) is None for name in ("", "seq2seq", "image-classification"))
