"""A pretrained checkpoint as users bring it (all-MiniLM-L6-v2: tests/conftest.py `pretrained`, a BertModel with no
task head, and a masked-LM checkpoint made from it) loads for the tasks transformers loads it for, every weight it
holds kept and the new ones said in one line; what a task cannot train from it is refused in one sentence. In
process; the 2-replica fine-tunes from it are tests/test_tasks.py's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import cli
from safetensors import safe_open

from hf_diloco.config import RunArguments
from hf_diloco.data import class_names
from hf_diloco.models import load_model
from hf_diloco.tasks import TASKS


def checkpoint_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as saved:
        return {key: saved.get_tensor(key) for key in saved.keys()}  # noqa: SIM118 (safe_open is no mapping)


def assert_holds(model, saved: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Every tensor of the checkpoint is the model's, bit for bit (a BertModel's keys have no `bert.` prefix), but
    the position ids older checkpoints saved, a buffer transformers now makes itself."""
    state = model.state_dict()
    kept = {key: tensor for key, tensor in saved.items() if not key.endswith("position_ids")}
    assert kept and all(torch.equal(state[prefix + key], tensor) for key, tensor in kept.items())


@pytest.fixture(scope="module")
def masked_lm(pretrained, tmp_path_factory):
    """MiniLM saved as a BertForMaskedLM (the encoder as it is, a prediction head), with its tokenizer files."""
    from transformers import BertForMaskedLM

    folder = tmp_path_factory.mktemp("minilm-masked-lm")
    BertForMaskedLM.from_pretrained(pretrained).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(pretrained / name, folder / name)
    return folder


def test_a_headless_encoder_fine_tunes_as_a_classifier_under_a_new_head_said_in_one_line(pretrained):
    """The checkpoint every fine-tune starts from: a BertForSequenceClassification whose encoder is the
    checkpoint's, bit for bit (read from its file here), a new head of the labels given (id2label), and one line
    naming the new tensors."""
    loaded = load_model(str(pretrained), 64, task="sequence-classification", labels=["negative", "positive"])
    assert type(loaded.model).__name__ == "BertForSequenceClassification"
    assert_holds(loaded.model, checkpoint_tensors(pretrained), "bert.")
    assert loaded.model.config.id2label == {0: "negative", 1: "positive"}
    assert loaded.model.classifier.out_features == 2
    assert loaded.note == (f"model {str(pretrained)!r} is a BertModel (no task head), loaded as a "
                           f"BertForSequenceClassification: a new classification head of 2 labels (negative, positive) "
                           f"is initialised (classifier.bias, classifier.weight).")
    assert loaded.tokenizer("hello world")["input_ids"] == [101, 7592, 2088, 102]  # its WordPiece vocabulary


def test_a_masked_lm_checkpoint_fine_tunes_as_a_classifier_its_prediction_head_left_out(masked_lm):
    """A masked-LM checkpoint (how BERT-like encoders are usually published): the encoder kept, the prediction head
    left out, the pooler (which a masked LM has not) and the classifier new; for task masked-lm the same checkpoint
    loads whole, with nothing to say."""
    saved = checkpoint_tensors(masked_lm)
    loaded = load_model(str(masked_lm), 64, task="sequence-classification", labels=["a", "b", "c"])
    assert_holds(loaded.model, {k: v for k, v in saved.items() if k.startswith("bert.")})
    assert loaded.note == (f"model {str(masked_lm)!r} is a BertForMaskedLM, loaded as a BertForSequenceClassification: "
                           f"a new classification head of 3 labels (a, b, c) is initialised (bert.pooler.dense.bias, "
                           f"bert.pooler.dense.weight, classifier.bias, classifier.weight); the checkpoint's "
                           f"cls.predictions.bias, cls.predictions.transform.LayerNorm.bias, "
                           f"cls.predictions.transform.LayerNorm.weight, cls.predictions.transform.dense.bias and 1 "
                           f"more are left out.")
    whole = load_model(str(masked_lm), 64, task="masked-lm")
    assert whole.note is None and type(whole.model).__name__ == "BertForMaskedLM"
    assert_holds(whole.model, saved)


def test_a_classifier_checkpoint_for_other_labels_gets_a_head_of_the_datas(masked_lm, tmp_path):
    """A classifier saved for 2 labels, fine-tuned on data of 3: its head is replaced (and said), the rest kept."""
    two = load_model(str(masked_lm), 64, task="sequence-classification", labels=["x", "y"]).model
    two.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(masked_lm / name, tmp_path / name)
    again = load_model(str(tmp_path), 64, task="sequence-classification", labels=["x", "y"])
    assert again.note is None and torch.equal(again.model.classifier.weight, two.classifier.weight)
    three = load_model(str(tmp_path), 64, task="sequence-classification", labels=["x", "y", "z"])
    assert three.model.classifier.out_features == 3 and "a new classification head of 3 labels" in three.note
    assert "(classifier.bias, classifier.weight)" in three.note
    assert torch.equal(three.model.bert.pooler.dense.weight, two.bert.pooler.dense.weight)


def test_what_a_task_cannot_train_from_the_encoder_is_refused_in_one_sentence(pretrained, masked_lm, tmp_path):
    """Next-token training of an encoder whose attention sees the next tokens, headless or masked-LM: one sentence,
    no traceback, before any weight is read; masked LM from the headless checkpoint gets a new prediction head."""
    for folder, saved in [(pretrained, "a BertModel (no task head), an encoder whose attention sees every token"),
                          (masked_lm, "a BertForMaskedLM, a masked language model (task masked-lm trains it)")]:
        result = cli("train", "--model_name_or_path", str(folder), "--max_steps", "2", "--inner_steps", "1",
                     "--output_dir", str(tmp_path / "out"))
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert last.startswith(f"hf-diloco: error: model {str(folder)!r} is {saved}"), last
        assert last.endswith("task causal-lm trains a causal language model (AutoModelForCausalLM), which would be "
                             "the wrong objective for it."), last
    headless = load_model(str(pretrained), 64, task="masked-lm")
    assert type(headless.model).__name__ == "BertForMaskedLM" and "new weights are initialised" in headless.note
    assert headless.note.endswith("the checkpoint's pooler.dense.bias, pooler.dense.weight are left out.")
    saved = checkpoint_tensors(pretrained)
    assert_holds(headless.model, {k: v for k, v in saved.items() if not k.startswith("pooler.")}, "bert.")


@pytest.mark.parametrize("rows, names", [
    ([("good", "positive"), ("bad", "negative"), ("fine", "positive")], ["negative", "positive"]),
    ([("a", 0), ("b", 2), ("c", 1)], ["0", "1", "2"]),
])
def test_a_classifiers_labels_come_from_its_data(tmp_path, rows, names):
    """Class names in id order: the sorted distinct strings, or 0 to the largest number; the built-in data's own;
    labels of neither kind, and a negative number, refused in one sentence (also by a launch's dry run)."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in rows))
    task = TASKS["sequence-classification"]
    assert class_names(RunArguments(task=task.name, dataset_name=str(data)), task) == names
    assert class_names(RunArguments(task=task.name), task) == ["written", "mirrored"]
    assert class_names(RunArguments(task="masked-lm"), TASKS["masked-lm"]) is None
    for bad, words in [([("a", 1.5), ("b", 0)], "has labels that are not all class numbers (0, 1, ...) or all class "
                                                  "names (e.g. 1.5)"),
                       ([("a", -1), ("b", 0)], "has label -1: integer labels number the classes from 0")]:
        data.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in bad))
        result = cli("launch", "recipes/sequence-classification.yaml", "--accelerate-config",
                     "accelerate_configs/cpu-2proc.yaml", "--dry-run", "--", "--dataset_name", str(data))
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and last == f"hf-diloco: error: dataset {str(data)!r} {words}" + (
            "; a classifier's label is one or the other." if "1.5" in words else " (or give the classes' names as "
                                                                                 "strings)."), last
