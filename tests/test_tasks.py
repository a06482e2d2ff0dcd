"""Trainer's other tasks with DiLoCo: seq2seq (Seq2SeqTrainer through the mixin), masked LM, text and image
classification. Fast tests of the pieces (the model check, the built-in data, the presets, the collator, the
metric); then each task's recipe trains as 2 replicas (accelerate launch, gloo), the replicas identical after every
sync and the task's metric better than at the start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ACCELERATE_CPU_2PROC, REPO, TORCHFT_REPLICA, cli, start_train_runs, train_runs

from hf_diloco.config import ConfigError, RunArguments
from hf_diloco.data import build_task_datasets, builtin_digits, builtin_labelled_texts, builtin_pairs
from hf_diloco.models import load_model_and_tokenizer
from hf_diloco.tasks import TASKS, accuracy, check_fits_task, task_collator


def saved_config(architecture: str, model_type: str):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    config.architectures = [architecture]
    return config


@pytest.mark.parametrize("architecture, model_type, task, words", [
    ("BertForMaskedLM", "bert", "causal-lm", "is a BertForMaskedLM, a masked language model (task masked-lm "
                                             "trains it): task causal-lm trains a causal language model"),
    ("BertModel", "bert", "causal-lm", "is a BertModel (no task head), an encoder whose attention sees every token"),
    ("BertLMHeadModel", "bert", "masked-lm", "is a BertLMHeadModel, a causal language model (task causal-lm trains "
                                             "it): task masked-lm trains a masked language model"),
    ("LlamaForCausalLM", "llama", "seq2seq", "is a LlamaForCausalLM, and its architecture (llama) has no class of the "
                                             "kind task seq2seq trains: an encoder-decoder"),
    ("ViTForImageClassification", "vit", "masked-lm", "its architecture (vit) has no class of the kind task masked-lm "
                                                      "trains"),
    ("ViTModel", "vit", "sequence-classification", "is a ViTModel (no task head), and its architecture (vit) has no "
                                                   "class of the kind task sequence-classification trains"),
])
def test_a_model_the_task_cannot_train_is_refused_naming_what_it_is(architecture, model_type, task, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_fits_task(saved_config(architecture, model_type), TASKS[task], "m")


@pytest.mark.parametrize("architecture, model_type, task", [
    ("T5ForConditionalGeneration", "t5", "seq2seq"), ("BertForMaskedLM", "bert", "masked-lm"),
    ("BertForSequenceClassification", "bert", "sequence-classification"),
    ("ViTForImageClassification", "vit", "image-classification"), ("LlamaForCausalLM", "llama", "causal-lm"),
    # a classifier takes any checkpoint of its architecture, under a new head
    ("BertModel", "bert", "sequence-classification"), ("BertForMaskedLM", "bert", "sequence-classification"),
    ("T5ForConditionalGeneration", "t5", "sequence-classification"), ("ViTModel", "vit", "image-classification"),
    # a generative task gives a checkpoint with no head a new one
    ("BertModel", "bert", "masked-lm"), ("T5Model", "t5", "seq2seq"), ("LlamaModel", "llama", "causal-lm"),
])
def test_a_model_the_task_trains_passes(architecture, model_type, task):
    assert check_fits_task(saved_config(architecture, model_type), TASKS[task], "m") is None


def test_presets_build_the_tasks_model_and_refuse_another_task():
    classes = {"seq2seq": ("tiny-t5", "T5ForConditionalGeneration"), "masked-lm": ("tiny-bert", "BertForMaskedLM"),
               "sequence-classification": ("tiny-bert", "BertForSequenceClassification"),
               "image-classification": ("tiny-vit", "ViTForImageClassification")}
    for task, (preset, name) in classes.items():
        model, tokenizer = load_model_and_tokenizer(preset, 64, task=task)
        again, _ = load_model_and_tokenizer(preset, 64, task=task)
        assert type(model).__name__ == name and TASKS[task].preset == preset
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
        assert (tokenizer is None) == (task == "image-classification")
    assert load_model_and_tokenizer("tiny-bert", 64, task="masked-lm")[1].mask_token_id == 259
    with pytest.raises(ConfigError, match="preset 'tiny-vit' does not train task seq2seq; it trains "
                                          "image-classification"):
        load_model_and_tokenizer("tiny-vit", 64, task="seq2seq")
    with pytest.raises(ConfigError, match="preset 'tiny-llama' is a causal language model; task masked-lm starts "
                                          "from preset 'tiny-bert'"):
        load_model_and_tokenizer("tiny-llama", 64, task="masked-lm")


def test_the_built_in_data_is_what_it_says():
    """Digits: the same for the same seed, each class a tenth, every image the font's glyph plus noise (the
    noiseless glyph is the nearest of the ten to the image, checked against an independent rendering). Texts: every
    other passage reversed, label 1 exactly for those. Pairs: each passage with its topic's title."""
    images, labels = builtin_digits()
    again, _ = builtin_digits()
    assert images.shape == (2000, 1, 8, 8) and np.array_equal(images, again) and 0 <= images.min() <= images.max() <= 1
    assert np.bincount(labels).tolist() == [200] * 10
    from hf_diloco.data import FONT

    def rendered(digit: int, top: int, left: int) -> np.ndarray:
        frame = np.zeros((8, 8), dtype=np.float32)
        frame[top:top + 5, left:left + 3] = np.array([int(c) for c in FONT[digit]]).reshape(5, 3)
        return frame

    for image, label in zip(images[:50], labels[:50], strict=True):
        distance = {(d, t, le): np.abs(image[0] - rendered(d, t, le)).sum() for d in range(10) for t in (1, 2)
                    for le in (2, 3)}
        assert min(distance, key=distance.get)[0] == label
    texts = builtin_labelled_texts()
    assert len(texts) > 1000 and [label for _t, label in texts[:4]] == [0, 1, 0, 1]
    from hf_diloco.data import _reference_passages

    passages = [p for _title, p in _reference_passages()]
    assert all(text == (passages[i][::-1] if label else passages[i]) for i, (text, label) in enumerate(texts))
    pairs = builtin_pairs()
    assert len(pairs) == len(passages) and pairs[0][1] == _reference_passages()[0][0]


def test_each_tasks_rows_have_fixed_shapes_and_the_held_out_tail():
    for task in ("seq2seq", "sequence-classification", "image-classification", "masked-lm"):
        run = RunArguments(task=task, model_name_or_path=TASKS[task].preset, block_size=64)
        _model, tokenizer = load_model_and_tokenizer(run.model_name_or_path, 64, task=task)
        train, held = build_task_datasets(run, TASKS[task], tokenizer)
        row = train[0]
        assert len(held) == pytest.approx(0.05 * (len(train) + len(held)), abs=1)
        if task == "image-classification":
            assert row["pixel_values"].shape == (1, 8, 8) and 0 <= int(row["labels"]) < 10
        elif task == "masked-lm":
            assert set(row) == {"input_ids"} and len(row["input_ids"]) == 64  # the collator makes the labels
        else:
            assert len(row["input_ids"]) == len(row["attention_mask"]) == 64
        if task == "seq2seq":  # the title, then -100 where the target is padded
            labels = row["labels"].tolist()
            ids = [i for i in labels if i != -100]
            assert tokenizer.decode(ids, skip_special_tokens=True) == builtin_pairs()[0][1]
            assert labels[len(ids):] == [-100] * (len(labels) - len(ids))
        if task == "sequence-classification":
            assert [int(train[i]["labels"]) for i in range(4)] == [0, 1, 0, 1]


def image_folder(folder, classes: int = 3, each: int = 40, size: int = 16):
    """An image dataset as a user keeps one: a sub-folder per class (named after it) of RGB PNGs, the built-in
    digits 0..classes-1 drawn `size` pixels wide. Returns the folder."""
    from PIL import Image

    images, labels = builtin_digits(count=classes * each * 4)
    for digit in range(classes):
        (folder / f"digit-{digit}").mkdir(parents=True)
        for n, image in enumerate(images[labels == digit][:each]):
            gray = Image.fromarray((image[0] * 255).astype(np.uint8), mode="L").resize((size, size), Image.NEAREST)
            gray.convert("RGB").save(folder / f"digit-{digit}" / f"{n}.png")
    return folder


def test_a_folder_of_images_per_class_becomes_rows_of_the_models_size_and_classes(tmp_path):
    """A user's images (RGB, 16 pixels): gray for the 1-channel preset, 8 pixels, values in [0, 1], each image the
    digit it was drawn from (compared with the built-in digit downsampled here by averaging 2x2 blocks, within 0.1
    on average), the classes in the folders' order, shuffled so that the held-out tail holds more than one class.
    A label beyond the model's classes is refused in one sentence."""
    from types import SimpleNamespace

    folder = image_folder(tmp_path / "digits")
    run = RunArguments(task="image-classification", model_name_or_path="tiny-vit", dataset_name=str(folder))
    config = SimpleNamespace(image_size=8, num_channels=1, num_labels=10)
    train, held = build_task_datasets(run, TASKS["image-classification"], None, config)
    assert len(train) + len(held) == 120 and train[0]["pixel_values"].shape == (1, 8, 8)
    rows = [*train, *held]
    assert {int(r["labels"]) for r in rows} == {0, 1, 2} and len({int(r["labels"]) for r in held}) > 1
    assert all(0 <= float(r["pixel_values"].min()) <= float(r["pixel_values"].max()) <= 1 for r in rows)
    images, labels = builtin_digits(count=480)
    for row in rows[:20]:
        label = int(row["labels"])
        distance = [np.abs(row["pixel_values"][0].numpy() - image[0]).mean() for image in images[labels == label][:40]]
        assert min(distance) < 0.1, (label, min(distance))
    with pytest.raises(ConfigError, match=r"has labels 0 to 2, but the model predicts 2 classes \(0 to 1\)"):
        build_task_datasets(run, TASKS["image-classification"], None, SimpleNamespace(image_size=8, num_channels=1,
                                                                                      num_labels=2))


def test_a_text_classifiers_file_sorted_by_label_is_held_out_with_every_class(tmp_path):
    """A JSONL of 40 texts kept in the order of their labels (20 "alpha", then 20 "beta"), a quarter held out: the
    held-out rows hold both classes, every row is there once with its own label, and a second build (another
    replica) gives the same split, row for row."""
    from types import SimpleNamespace

    from hf_diloco.models import byte_tokenizer

    data = tmp_path / "sorted.jsonl"
    texts = [(f"row {n} of {label}", label) for label in ("alpha", "beta") for n in range(20)]
    data.write_text("".join(json.dumps({"text": text, "label": label}) + "\n" for text, label in texts))
    run = RunArguments(task="sequence-classification", dataset_name=str(data), block_size=16, eval_fraction=0.25)
    config = SimpleNamespace(label2id={"alpha": 0, "beta": 1})
    tokenizer = byte_tokenizer()
    builds = [build_task_datasets(run, TASKS["sequence-classification"], tokenizer, config) for _ in range(2)]
    (train, held), (again_train, again_held) = builds
    assert len(held) == 10 and {int(r["labels"]) for r in held} == {0, 1}
    assert [r["input_ids"].tolist() for r in held] == [r["input_ids"].tolist() for r in again_held]
    assert [r["input_ids"].tolist() for r in train] == [r["input_ids"].tolist() for r in again_train]
    decoded = sorted((tokenizer.decode([t for t, m in zip(r["input_ids"], r["attention_mask"], strict=True) if m],
                                       skip_special_tokens=True), int(r["labels"])) for r in [*train, *held])
    assert decoded == sorted((text, config.label2id[label]) for text, label in texts)


def test_a_users_dataset_without_the_tasks_columns_is_refused_before_anything_starts(tmp_path):
    """The launch asks a dataset of the user's for its task's columns: a pairs file passes for seq2seq, images
    sorted into class folders for image classification; images not sorted so, and texts without labels, are refused
    in one sentence naming the columns."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"source": "a passage", "target": "its title"}\n' * 8)
    loose = tmp_path / "loose"
    loose.mkdir()
    from PIL import Image

    for n in range(4):
        Image.new("L", (8, 8), color=n * 60).save(loose / f"{n}.png")
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "no label here"}\n' * 8)
    for recipe, data, words in [
            ("seq2seq", pairs, None),
            ("image-classification", image_folder(tmp_path / "sorted", classes=2, each=4), None),
            ("image-classification", loose, "task image-classification reads columns image and label of its "
                                             "dataset, and '{}' has no label (it has image): a folder of images "
                                             "needs one sub-folder per class."),
            ("sequence-classification", texts, "task sequence-classification reads columns text and label of its "
                                               "dataset, and '{}' has no label (it has text).")]:
        result = cli("launch", f"recipes/{recipe}.yaml", "--accelerate-config", "accelerate_configs/cpu-2proc.yaml",
                     "--dry-run", "--", "--dataset_name", str(data))
        if words is None:
            assert result.returncode == 0, result.stderr[-1500:]
            continue
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and last == f"hf-diloco: error: {words.format(data)}", last


def test_masked_lm_masks_about_15_percent_and_scores_only_those():
    _model, tokenizer = load_model_and_tokenizer("tiny-bert", 64, task="masked-lm")
    collate = task_collator(TASKS["masked-lm"], tokenizer)
    torch.manual_seed(0)
    ids = torch.randint(3, 259, (64, 128))
    batch = collate([{"input_ids": row} for row in ids])
    scored = batch["labels"] != -100
    assert 0.13 < scored.float().mean().item() < 0.17, "BERT's 15%, within 2 points over 8,192 tokens"
    assert torch.equal(batch["labels"][scored], ids[scored]), "the label of a scored token is the original"
    assert (batch["input_ids"][scored] == tokenizer.mask_token_id).float().mean().item() == pytest.approx(0.8, abs=0.05)
    assert torch.equal(batch["input_ids"][~scored], ids[~scored])


def test_accuracy_is_the_share_of_rows_whose_top_logit_is_their_label():
    from transformers import EvalPrediction

    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.3, 0.2], [0.0, 5.0]])
    labels = np.array([1, 0, 1, 1])
    assert accuracy(EvalPrediction(predictions=logits, label_ids=labels)) == {"accuracy": 0.75}


def test_muon_takes_each_tasks_block_matrices_and_one_step_trains_every_part():
    """inner_optimizer muon on each task's preset: Muon gets exactly the nn.Linear weights inside the encoder and
    decoder blocks (counted here from the module types and the block names alone), AdamW the embeddings (T5's
    relative position biases, ViT's patch convolution and position embeddings), the heads (BERT's pooler and
    prediction head, the classifiers) and every vector; one step on a batch of the task's built-in data moves every
    parameter that has a gradient and lowers nothing to NaN."""
    from torch import nn

    from hf_diloco.inner import muon_parameter_names, muon_with_adamw

    for task in ("seq2seq", "masked-lm", "sequence-classification", "image-classification"):
        run = RunArguments(task=task, model_name_or_path=TASKS[task].preset, block_size=64)
        model, tokenizer = load_model_and_tokenizer(run.model_name_or_path, 64, task=task)
        blocks = sorted(f"{name}.weight" for name, module in model.named_modules() if isinstance(module, nn.Linear)
                        and re.search(r"\.(block|layers?)\.\d+\.", name))
        assert blocks and sorted(muon_parameter_names(model)) == blocks, task
        train, _held = build_task_datasets(run, TASKS[task], tokenizer)
        batch = task_collator(TASKS[task], tokenizer)([train[i] for i in range(8)])
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = muon_with_adamw(model, [n for n, p in model.named_parameters() if p.dim() > 1], lr=1e-3,
                                    weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        assert torch.isfinite(loss) and with_grad and with_grad <= moved, (task, sorted(with_grad - moved))
        assert all(torch.isfinite(p).all() for p in model.parameters()), task


def test_task_settings_that_cannot_go_together_are_refused_in_one_sentence(tmp_path):
    for flags, words in [(["--task", "translation"], "argument --task: invalid choice: 'translation'"),
                         (["--task", "seq2seq", "--trainer", "sft"], "trainer sft trains a causal language model"),
                         (["--task", "masked-lm", "--model_name_or_path", "tiny-llama"],
                          "preset 'tiny-llama' is a causal language model")]:
        result = cli("train", "--max_steps", "2", "--inner_steps", "1", "--output_dir", str(tmp_path / "out"), *flags)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode != 0 and "Traceback" not in result.stderr and words in last, result.stderr[-1500:]


# --- each task's recipe, 2 replicas ------------------------------------------------------------------------------

TASK_RUNS = {  # name → recipe, flags: each task's recipe; seq2seq with int4 + EF and streaming fragments (an
    # encoder-decoder's), the image classifier with Muon inside and int8, and on a folder of the user's images. (Each
    # recipe as it is: on torchft below; seq2seq's and the digits' plain DiLoCo: from Python too.)
    "masked-lm": ("masked-lm", []),
    "sequence-classification": ("sequence-classification", []),
    "seq2seq-int4-fragments": ("seq2seq", ["--compression", "int4", "--error_feedback", "true", "--num_fragments",
                                           "2"]),
    "image-classification-muon-int8": ("image-classification", ["--inner_optimizer", "muon", "--compression", "int8"]),
    # A folder of the user's images, one sub-folder per class (image_folder below; {images} is its path).
    "image-classification-user-folder": ("image-classification", ["--dataset_name", "{images}", "--eval_fraction",
                                                                  "0.2"]),
}
TASKS_ON_TORCHFT = ["seq2seq", "masked-lm", "sequence-classification", "image-classification"]
# Where the whole model is the same on both replicas: after every sync, or (fragments sync part of it at a time) at
# the end.
AT_THE_END = {"seq2seq-int4-fragments"}
SHORT = ["--max_steps", "60", "--eval_steps", "20", "--report_to", "none", "--disable_tqdm", "true"]
# Text tasks in blocks of 64 tokens, 8 rows a step (the recipes: 128, 16); the digits as their recipe says.
SMALLER = ["--block_size", "64", "--per_device_train_batch_size", "8"]


def task_flags(name: str, images: str = "") -> list[str]:
    """A run's flags: a TASK_RUNS name, or a task's name for its recipe as it is."""
    recipe, flags = TASK_RUNS.get(name, (name, []))
    return [*SHORT, *([] if recipe == "image-classification" else SMALLER), *(f.format(images=images) for f in flags)]


def torchft_steps(task: str) -> int:
    """The torchft runs' length: two syncs of text, three of the digits (fewer do not move the untrained ViT)."""
    return 60 if task == "image-classification" else 40


def guide_example(out) -> str:
    """The seq2seq block of docs/guides/your-model.md, its run shortened to 40 steps of 8 rows of 64 tokens in
    `out`, each rank writing the digest of its parameters after every sync."""
    page = (REPO / "docs" / "guides" / "your-model.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "DiLoCoSeq2SeqTrainer" in block)
    shorter = {'output_dir="runs/my-seq2seq"': f"output_dir={str(out)!r}", "max_steps=200": "max_steps=40",
               "block_size=128": "block_size=64", "per_device_train_batch_size=16": "per_device_train_batch_size=8",
               "trainer.train()": "trainer.add_callback(SyncDigests(args))\ntrainer.train()"}
    assert all(setting in code for setting in shorter), "the example's settings are where the test expects them"
    for setting, short in shorter.items():
        code = code.replace(setting, short)
    return code


PYTHON_TASKS = ["masked-lm", "sequence-classification", "image-classification"]  # the guide's DiLoCoTrainer block


def guide_trainer_example(out, task: str) -> str:
    """The guide's DiLoCoTrainer block for `task`, shortened as the recipes' runs are: text in 8-row batches for 40
    steps, the digits in the block's 16-row batches for 60 (fewer do not move the untrained ViT's accuracy)."""
    page = (REPO / "docs" / "guides" / "your-model.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "task_collator(task" in block)
    image = task == "image-classification"
    shorter = {'TASKS["image-classification"]': f"TASKS[{task!r}]", 'output_dir="runs/my-task"':
               f"output_dir={str(out)!r}", "max_steps=200": f"max_steps={60 if image else 40}",
               "per_device_train_batch_size=16": f"per_device_train_batch_size={16 if image else 8}",
               "trainer.train()": "trainer.add_callback(SyncDigests(args))\ntrainer.train()"}
    assert all(setting in code for setting in shorter), "the example's settings are where the test expects them"
    for setting, short in shorter.items():
        code = code.replace(setting, short)
    return code


def labelled_jsonl(path) -> Path:
    """A classifier's data as users keep it: a JSONL of texts whose labels are the classes' names (the built-in
    written and mirrored prose, 400 rows)."""
    path.write_text("".join(json.dumps({"text": text, "label": ["written", "mirrored"][label]}) + "\n"
                            for text, label in builtin_labelled_texts()[:400]))
    return path


def pretrained_flags(pretrained, data) -> list[str]:
    """The text classifier's recipe fine-tuning the pretrained encoder (tests/conftest.py `pretrained`: no head) on
    `data`: two syncs of H = 10, 8 rows of 32 tokens a step, fine-tuning's learning rate, the held-out tenth
    evaluated on start and at each sync."""
    return ["--model_name_or_path", str(pretrained), "--dataset_name", str(data), "--eval_fraction", "0.1",
            "--block_size", "32", "--per_device_train_batch_size", "8", "--learning_rate", "5e-5", "--warmup_steps",
            "2", "--max_steps", "20", "--inner_steps", "10", "--eval_steps", "10", "--report_to", "none",
            "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    return labelled_jsonl(tmp_path_factory.mktemp("labelled") / "mine.jsonl")


@pytest.fixture(scope="module")
def task_runs(tmp_path_factory, pretrained, labelled):
    folder = tmp_path_factory.mktemp("tasks")
    scripts = {"python-seq2seq": guide_example(folder / "python-seq2seq"),
               **{f"python-{task}": guide_trainer_example(folder / f"python-{task}", task) for task in PYTHON_TASKS}}
    for name, code in scripts.items():
        (folder / f"{name}.py").write_text(code)
    images = str(image_folder(folder / "my-digits", classes=3, each=60))
    launch = train_runs([*({"name": name, "recipe": f"recipes/{TASK_RUNS[name][0]}.yaml", "digests": True,
                            "args": [*task_flags(name, images), "--output_dir", str(folder / name)]}
                           for name in TASK_RUNS),
                         *({"name": name, "script": str(folder / f"{name}.py")} for name in scripts),
                         {"name": "pretrained", "recipe": "recipes/sequence-classification.yaml", "digests": True,
                          "args": [*pretrained_flags(pretrained, labelled), "--output_dir",
                                   str(folder / "pretrained")]}],
                        ACCELERATE_CPU_2PROC)
    (folder / "launch.log").write_text(launch.stdout + launch.stderr)
    return {name: folder / name for name in [*TASK_RUNS, *scripts, "pretrained"]}


@pytest.fixture(scope="module")
def torchft_task_runs(tmp_path_factory, pretrained, labelled):
    """The four tasks' recipes on outer_backend torchft: two replicas, each one process (its own launch, as `hf-diloco
    launch --replicas 2` starts them) that trains the four in turn, each task against a Lighthouse of its own.
    Task → the run's folder (replica-k/ inside)."""
    from hf_diloco.launch import start_lighthouse

    folder = tmp_path_factory.mktemp("torchft-tasks")
    flags = {**{name: [*task_flags(name), "--max_steps", str(torchft_steps(name))] for name in TASKS_ON_TORCHFT},
             "pretrained": pretrained_flags(pretrained, labelled)}
    recipes = {**{name: name for name in TASKS_ON_TORCHFT}, "pretrained": "sequence-classification"}
    houses = {name: start_lighthouse("127.0.0.1:0", 2, 5.0) for name in flags}
    try:
        launches = [start_train_runs([{
            "name": name, "recipe": f"recipes/{recipes[name]}.yaml", "digests": True,
            "args": [*flags[name], "--outer_backend", "torchft", "--lighthouse", houses[name].address(),
                     "--replica_id", str(k), "--num_replicas", "2", "--min_replicas", "2", "--replica_address",
                     "127.0.0.1", "--output_dir", str(folder / name / f"replica-{k}")]} for name in flags],
            TORCHFT_REPLICA, log=folder / f"replica-{k}.log") for k in range(2)]
        for k, launch in enumerate(launches):
            assert launch.wait(timeout=600) == 0, (folder / f"replica-{k}.log").read_text()[-4000:]
    finally:
        for house in houses.values():
            house.shutdown()
    return {name: folder / name for name in flags}


def assert_trained(summary: dict, name: str) -> None:
    task = next(t for t in TASKS.values() if name.startswith(t.name))
    if task.metric == "accuracy":
        assert summary["eval_accuracy_final"] > summary["eval_accuracy_initial"], summary
    else:
        assert summary["eval_loss_final"] < summary["eval_loss_initial"], summary


@pytest.mark.process
def test_the_guides_seq2seq_example_trains_two_replicas_from_python_identical_after_every_sync(task_runs):
    """DiLoCoSeq2SeqTrainer (DiLoCoMixin on Seq2SeqTrainer) from the guide's Python block, under a launch of two
    processes: two replicas, identical after each of the two syncs, the held-out loss lower than at the first."""
    out = task_runs["python-seq2seq"]
    digests = [json.loads((out / f"digests-rank{r}.json").read_text()) for r in (0, 1)]
    assert list(digests[0]) == ["20", "40"] and digests[0] == digests[1], digests
    records = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert [[r["replica"] for r in record["replicas"] if r["participated"]] for record in records] == [[0, 1]] * 2
    assert records[-1]["eval_loss"] < records[0]["eval_loss"], records


@pytest.mark.process
@pytest.mark.parametrize("task", PYTHON_TASKS)
def test_the_guides_trainer_example_trains_each_other_task_from_python(task_runs, task):
    """The guide's DiLoCoTrainer block with the task's collator and metric, for masked LM and both classifiers, under
    a launch of two processes: two replicas, identical after every sync, the task's metric better at the end than at
    the start."""
    out = task_runs[f"python-{task}"]
    digests = [json.loads((out / f"digests-rank{r}.json").read_text()) for r in (0, 1)]
    syncs = 3 if task == "image-classification" else 2
    assert list(digests[0]) == ["20", "40", "60"][:syncs] and digests[0] == digests[1], digests
    records = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
    assert [[r["replica"] for r in record["replicas"] if r["participated"]] for record in records] == [[0, 1]] * syncs
    assert_trained(json.loads((out / "diloco_summary.json").read_text()), task)  # against the evaluation on start


@pytest.mark.process
@pytest.mark.parametrize("name", list(TASK_RUNS))
def test_each_task_trains_as_two_replicas_identical_after_every_sync_and_its_metric_improves(task_runs, name):
    """Two replicas of each task's recipe on the torch backend (TASK_RUNS: as it is, with a codec plus fragments or
    Muon inside, on a folder of the user's images): the replicas' parameters identical after every sync (at the end
    where a sync covers part of the model), three rounds, the task's metric (accuracy for classifiers, else the
    held-out loss) better at the end than at the start."""
    out = task_runs[name]
    digests = [json.loads((out / f"digests-rank{r}.json").read_text()) for r in (0, 1)]
    assert list(digests[0]) == ["20", "40", "60"], digests
    if name in AT_THE_END:
        assert digests[0]["60"] == digests[1]["60"] and digests[0]["20"] != digests[1]["20"], digests
    else:
        assert digests[0] == digests[1], digests
    summary = json.loads((out / "diloco_summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["rounds"] == 3
    task = next(t for t in TASKS.values() if name.startswith(t.name))
    settings = json.loads((out / "run_config.json").read_text())
    assert settings["run"]["task"] == task.name
    assert settings["diloco"]["inner_optimizer"] == ("muon" if "muon" in name else "adamw")
    assert_trained(summary, name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"][0] in {"T5ForConditionalGeneration", "BertForMaskedLM",
                                          "BertForSequenceClassification", "ViTForImageClassification"}


@pytest.mark.process
@pytest.mark.parametrize("name", TASKS_ON_TORCHFT)
def test_each_task_trains_on_torchft_as_two_replicas_identical_after_every_sync(torchft_task_runs, name):
    """Each task's recipe on outer_backend torchft, two replicas through a Lighthouse: every sync committed by both,
    their parameters identical after each, the task's metric better at the end than at the start."""
    out = torchft_task_runs[name]
    digests = [json.loads((out / f"replica-{k}" / "digests-rank0.json").read_text()) for k in (0, 1)]
    steps = list(range(20, torchft_steps(name) + 1, 20))
    assert list(digests[0]) == [str(s) for s in steps] and digests[0] == digests[1], digests
    for k in (0, 1):
        records = [json.loads(line) for line in (out / f"replica-{k}" / "syncs.jsonl").read_text().splitlines()]
        assert [(r["step"], r["committed"], r["participants"]) for r in records] == [(s, True, 2) for s in steps]
    summary = json.loads((out / "replica-0" / "diloco_summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["syncs"] == len(steps)
    assert_trained(summary, name)


@pytest.mark.process
@pytest.mark.parametrize("backend", ["torch", "torchft"])
def test_a_pretrained_encoder_fine_tunes_as_two_replicas_into_a_classifier_named_by_its_datas_labels(request, backend):
    """all-MiniLM-L6-v2 (a BertModel: no head) fine-tuned as a text classifier on a JSONL of one's own whose labels
    are names, two replicas on each backend: the new head said once, the replicas identical after both syncs,
    held-out accuracy well above the start's, and the saved model a BertForSequenceClassification that
    transformers' text-classification pipeline loads and answers with the data's label names."""
    from transformers import pipeline

    if backend == "torch":
        out = request.getfixturevalue("task_runs")["pretrained"]
        digests = [json.loads((out / f"digests-rank{r}.json").read_text()) for r in (0, 1)]
        log = (out.parent / "launch.log").read_text()
    else:
        out = request.getfixturevalue("torchft_task_runs")["pretrained"]
        digests = [json.loads((out / f"replica-{k}" / "digests-rank0.json").read_text()) for k in (0, 1)]
        out, log = out / "replica-0", (out.parent / "replica-0.log").read_text()
    said = [line for line in log.splitlines() if "(no task head), loaded as a BertForSequenceClassification" in line]
    assert len(said) == 1 and said[0].endswith("a new classification head of 2 labels (mirrored, written) is "
                                               "initialised (classifier.bias, classifier.weight)."), said
    assert list(digests[0]) == ["10", "20"] and digests[0] == digests[1], digests
    summary = json.loads((out / "diloco_summary.json").read_text())
    assert summary["eval_accuracy_final"] >= max(0.8, summary["eval_accuracy_initial"] + 0.25), summary
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    assert config["id2label"] == {"0": "mirrored", "1": "written"}, config["id2label"]
    classify = pipeline("text-classification", model=str(out), device="cpu")
    texts = [text for text, _label in builtin_labelled_texts()[400:440]]
    answers = [answer["label"] for answer in classify(texts, truncation=True, max_length=32)]
    assert set(answers) <= {"mirrored", "written"}
    assert sum(a == ["written", "mirrored"][i % 2] for i, a in enumerate(answers)) >= 0.8 * len(texts), answers


@pytest.mark.process
def test_an_image_classifier_trains_with_fsdp2_inside_each_replica(tmp_path):
    """accelerate_configs/cpu-fsdp-2x2.yaml: two replicas of two processes, the ViT sharded by FSDP2 in each (its
    patch embedding a unit of its own, not inside the embedding block its `_no_split_modules` names): member j of
    both replicas holds the same shard after each sync, the two members different shards, accuracy up."""
    out = tmp_path / "vit-fsdp2"
    train_runs([{"name": "vit-fsdp2", "recipe": "recipes/image-classification.yaml", "digests": True,
                 "args": [*SHORT, "--max_steps", "40", "--fsdp", "true", "--replica_group_size", "2", "--use_cpu",
                          "false", "--output_dir", str(out)]}], REPO / "accelerate_configs" / "cpu-fsdp-2x2.yaml")
    digests = [json.loads((out / f"digests-rank{r}.json").read_text()) for r in range(4)]
    assert list(digests[0]) == ["20", "40"], digests
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0]["40"] != digests[1]["40"], digests
    summary = json.loads((out / "diloco_summary.json").read_text())
    assert summary["num_replicas"] == 2 and summary["replica_group_size"] == 2
    assert_trained(summary, "image-classification")


@pytest.mark.parametrize("recipe, words", [
    ("seq2seq", "this T5ForConditionalGeneration: its parameter 'shared.weight' is tied across 4 modules (shared, "
                "encoder.embed_tokens, decoder.embed_tokens, lm_head)"),
    ("masked-lm", "this BertForMaskedLM: its parameter 'cls.predictions.bias' is tied across 2 modules"),
])
def test_fsdp2_refuses_a_model_tied_beyond_its_embeddings_in_one_sentence(recipe, words):
    """accelerate's FSDP2 shards a tied input and output embedding as one unit; a weight with another holder would
    be sharded twice, so the launch refuses before it starts anything."""
    result = cli("launch", f"recipes/{recipe}.yaml", "--accelerate-config", "accelerate_configs/cpu-fsdp-2x2.yaml",
                 "--dry-run", "--", "--fsdp", "true", "--replica_group_size", "2")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-1500:]
    assert last.startswith("hf-diloco: error: FSDP2 inside a replica cannot shard ") and words in last, last


@pytest.mark.parametrize("recipe, instead", [("seq2seq", "train it as replicas of one process each"),
                                              ("masked-lm", "train it as replicas of one process each"),
                                              ("sequence-classification", "use FSDP2 inside the replica instead"),
                                              ("image-classification", "use FSDP2 inside the replica instead")])
def test_tensor_parallel_is_refused_for_the_task_models_with_what_works_instead(recipe, instead):
    """None of the task presets has a tensor-parallel plan in transformers: the launch refuses tp_size 2 in one
    sentence that points to FSDP2 where FSDP2 shards the model (tested above), else to replicas of one process."""
    result = cli("launch", f"recipes/{recipe}.yaml", "--accelerate-config", "accelerate_configs/cpu-tp-2x2.yaml",
                 "--dry-run")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-1500:]
    assert "has no tensor-parallel plan in transformers, so its layers cannot be split" in last and \
        last.endswith(f"; {instead}."), last


def test_fsdp2_units_leave_out_the_blocks_holding_the_embeddings():
    from hf_diloco.parallel import check_shardable, fsdp_units

    for preset, task, units in [("tiny-bert", "sequence-classification", ["BertLayer"]),
                                ("tiny-vit", "image-classification", ["ViTLayer"]),
                                ("tiny-llama", "causal-lm", ["LlamaDecoderLayer"])]:
        model, _ = load_model_and_tokenizer(preset, 64, task=task)
        assert sorted(fsdp_units(model, None)) == units, preset
        assert len(model._no_split_modules) == len(units) + (preset != "tiny-llama")
        assert check_shardable(model) is None


def test_the_model_card_names_the_tasks_pipeline_and_no_preset_as_base_model(tmp_path):
    from hf_diloco.hub import model_card

    for task in TASKS.values():
        (tmp_path / "run_config.json").write_text(json.dumps({"trainer": "diloco", "run": {
            "task": task.name, "model_name_or_path": task.preset, "dataset_name": "builtin"}}))
        card = model_card(tmp_path, curve=False)
        head = card.split("---")[1]
        assert f"pipeline_tag: {task.pipeline_tag}" in head and "base_model" not in head, head
