"""What a run trains its model to do: the tasks transformers' Trainer trains, each with the model class, the
built-in data, the collator, the metric and the Trainer class that transformers uses for it.

DiLoCo does not care what the model predicts: a replica trains alone and its pseudo-gradient is a difference of
weights. So a task is only what the inner loop needs:

- causal-lm (ForCausalLM): the corpus in token blocks; eval loss.
- seq2seq (ForSeq2SeqLM): each corpus passage → the title of its topic (a one-line summary), padded pairs; eval loss.
- masked-lm (ForMaskedLM): the corpus in token blocks, 15% of the tokens masked by the collator; eval loss.
- sequence-classification (ForSequenceClassification): corpus passages, every other one reversed letter by letter
  (label 1); accuracy.
- image-classification (ForImageClassification): the digits 0-9 drawn in code on an 8x8 grey frame; accuracy.

Design choices:
- Presets are small models built from a config, like the Llama ones: `tiny-t5` (encoder-decoder), `tiny-bert`
  (its head follows the task: masked LM or classifier) and `tiny-vit` (8x8 images in four 4x4 patches), so every task
  trains on 2 CPU cores with nothing downloaded.
- The built-in data (hf_diloco.data) are derived from the built-in corpus (pydoc topics) or drawn by code from a fixed
  seed: the same on every machine. The held-out part is the last `eval_fraction` of the rows, as for text.
- A checkpoint is taken as transformers' `from_pretrained` takes it for the task: a classifier's backbone may come
  from any checkpoint of its architecture (none, a masked LM's head: the usual pretrained encoder), under a new
  head sized to the data's labels; a generative task reuses a saved head only where it was trained for that task.
  What would train a head for another objective, or has no class for the task, is refused in one sentence before
  anything is loaded (`check_fits_task`).
- Seq2seq trains with `Seq2SeqTrainer` through `DiLoCoMixin` (hf_diloco.trainer.DiLoCoSeq2SeqTrainer); the other
  tasks with `DiLoCoTrainer`. Their streaming fragments cut layers by number: an encoder-decoder's encoder block
  l and decoder block l travel in the same fragment.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

CAUSAL_LM = "causal-lm"
SEQ2SEQ = "seq2seq"
MASKED_LM = "masked-lm"
SEQUENCE_CLASSIFICATION = "sequence-classification"
IMAGE_CLASSIFICATION = "image-classification"


@dataclass(frozen=True)
class Task:
    name: str
    mapping: str  # transformers.models.auto.modeling_auto's table of this task's model classes
    auto_class: str  # the Auto class that loads a model for it
    pipeline_tag: str  # the Hub's name for it (model cards)
    preset: str  # the preset a recipe starts from
    metric: str  # what the task's evaluation reports beside the loss: "loss" (the loss itself) or "accuracy"
    noun: str  # what its models are called in a sentence, with its article
    new_head: bool = False  # classifiers: any checkpoint of the architecture loads, under a new head for the labels


TASKS: dict[str, Task] = {task.name: task for task in [
    Task(CAUSAL_LM, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", "text-generation", "tiny-llama",
         "loss", "a causal language model"),
    Task(SEQ2SEQ, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", "text2text-generation",
         "tiny-t5", "loss", "an encoder-decoder (sequence-to-sequence) model"),
    Task(MASKED_LM, "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", "fill-mask", "tiny-bert", "loss",
         "a masked language model"),
    Task(SEQUENCE_CLASSIFICATION, "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
         "AutoModelForSequenceClassification", "text-classification", "tiny-bert", "accuracy", "a text classifier",
         new_head=True),
    Task(IMAGE_CLASSIFICATION, "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification",
         "image-classification", "tiny-vit", "accuracy", "an image classifier", new_head=True),
]}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}.") from None


def task_classes(task: Task) -> set[str]:
    """The model classes transformers lists for `task` (e.g. LlamaForCausalLM, T5ForConditionalGeneration)."""
    from transformers.models.auto import modeling_auto

    table = getattr(modeling_auto, task.mapping)
    return {name for names in table.values() for name in ((names,) if isinstance(names, str) else names)}


def task_of_architectures(names: list[str]) -> Task | None:
    """The task a saved model's architectures name (the first task whose table lists one of them), or None."""
    for task in TASKS.values():
        if set(names) & task_classes(task):
            return task
    return None


def saved_as(config) -> str:
    """What a checkpoint was saved as, for a sentence: "a BertModel (no task head)", "a BertForMaskedLM", or "a bert
    model" when its config names no architecture."""
    from transformers.models.auto import modeling_auto

    named = list(getattr(config, "architectures", None) or [])
    if not named:
        return f"a {config.model_type} model"
    bare = {name for names in modeling_auto.MODEL_MAPPING_NAMES.values()
            for name in ((names,) if isinstance(names, str) else names)}
    return f"a {named[0]}" + (" (no task head)" if named[0] in bare else "")


def check_fits_task(config, task: Task, shown: str) -> None:
    """Whether the checkpoint whose config is `config` trains for `task`, decided before any weight is read: a
    ConfigError in one sentence where it would not.

    - Saved as one of the task's classes: its head is reused.
    - An architecture with no class for the task (a Llama for seq2seq, a ViT for text): refused.
    - A classifier (`Task.new_head`) takes any other checkpoint of its architecture, as transformers does: the
      backbone loads and a new head is initialised, whatever head it was saved with (none, a masked LM's).
    - A generative task (causal-lm, seq2seq, masked-lm) gives a checkpoint with no head a new one; a checkpoint
      saved with another task's head is refused (that head's training would serve another objective), and causal-lm
      refuses an encoder (a BERT-like model not configured as a decoder), whose attention sees the tokens it is to
      predict.

    >>> from transformers import BertConfig
    >>> check_fits_task(BertConfig(architectures=["BertModel"]), TASKS[SEQUENCE_CLASSIFICATION], "m")
    >>> check_fits_task(BertConfig(architectures=["BertModel"]), TASKS[CAUSAL_LM], "m")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    hf_diloco.errors.ConfigError: model 'm' is a BertModel (no task head), an encoder whose attention sees every ...
    """
    from transformers.models.auto import modeling_auto

    named = list(getattr(config, "architectures", None) or [])
    if set(named) & task_classes(task):
        return
    saved = saved_as(config)
    wanted = f"task {task.name} trains {task.noun} ({task.auto_class})"
    if config.model_type not in getattr(modeling_auto, task.mapping):
        raise ConfigError(f"model {shown!r} is {saved}, and its architecture ({config.model_type}) has no class "
                          f"of the kind task {task.name} trains: {task.noun} ({task.auto_class}).")
    if task.new_head:
        return
    other = task_of_architectures(named)
    if other is not None:
        raise ConfigError(f"model {shown!r} is {saved}, {other.noun} (task {other.name} trains it): {wanted}, which "
                          f"would be the wrong objective for it.")
    encoder = config.model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if task.name == CAUSAL_LM and encoder and not getattr(config, "is_decoder", False):
        raise ConfigError(f"model {shown!r} is {saved}, an encoder whose attention sees every token, the ones it is "
                          f"to predict included: {wanted}, which would be the wrong objective for it.")


def class_settings(labels: list[str]) -> dict:
    """A classifier's config fields for classes named `labels` (id order): num_labels, id2label, label2id.

    >>> class_settings(["neg", "pos"])
    {'num_labels': 2, 'id2label': {0: 'neg', 1: 'pos'}, 'label2id': {'neg': 0, 'pos': 1}}
    """
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)}}


# --- presets ----------------------------------------------------------------------------------------------------

TASK_PRESETS = ("tiny-t5", "tiny-bert", "tiny-vit")
IMAGE_SIZE, DIGITS = 8, 10


def build_task_preset(name: str, task: Task, tokenizer, max_positions: int, seed: int,
                      labels: list[str] | None = None):
    """A freshly initialised small model for `task`, identical for identical seeds, a classifier with one class per
    name in `labels` (its default: two for text, the ten digits for images); ConfigError when the preset does not
    do that task."""
    fits = {"tiny-t5": (SEQ2SEQ,), "tiny-bert": (MASKED_LM, SEQUENCE_CLASSIFICATION), "tiny-vit":
            (IMAGE_CLASSIFICATION,)}[name]
    if task.name not in fits:
        raise ConfigError(f"preset {name!r} does not train task {task.name}; it trains {' or '.join(fits)} "
                          f"(task {task.name} starts from preset {task.preset!r}).")
    import torch
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForSequenceClassification,
        T5Config,
        T5ForConditionalGeneration,
        ViTConfig,
        ViTForImageClassification,
    )

    if labels is None and task.new_head:
        labels = [str(i) for i in range(DIGITS if task.name == IMAGE_CLASSIFICATION else 2)]
    classes = {} if labels is None else class_settings(labels)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "tiny-t5":
            config = T5Config(vocab_size=len(tokenizer), d_model=128, d_kv=32, d_ff=512, num_layers=2,
                              num_decoder_layers=2, num_heads=4, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
            return T5ForConditionalGeneration(config)
        if name == "tiny-bert":
            config = BertConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                                intermediate_size=512, max_position_embeddings=max_positions,
                                pad_token_id=tokenizer.pad_token_id, **classes)
            return (BertForMaskedLM if task.name == MASKED_LM else BertForSequenceClassification)(config)
        config = ViTConfig(image_size=IMAGE_SIZE, patch_size=4, num_channels=1, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=256, **classes)
        return ViTForImageClassification(config)


def task_collator(task: Task, tokenizer):
    """How a batch is made: masking for masked LM (15% of the tokens, BERT's recipe), rows as they are for the
    others (every row already has the task's fixed shape).

    Args:
        task: the task (`get_task(name)`).
        tokenizer (PreTrainedTokenizerBase | None): the model's tokenizer (masked LM draws its mask token from it).

    Returns:
        Callable: a data collator for Trainer's `data_collator`.

    Examples:
        >>> task_collator(get_task("sequence-classification"), None).__name__
        'default_data_collator'
    """
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    if task.name == MASKED_LM:
        return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    return default_data_collator


def accuracy(prediction) -> dict:
    """The share of evaluation rows whose highest logit is their label (Trainer's compute_metrics)."""
    import numpy as np

    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    return {"accuracy": float((np.asarray(logits).argmax(-1) == np.asarray(prediction.label_ids)).mean())}


def task_metrics(task: Task):
    """Trainer's compute_metrics for `task`: accuracy for classifiers, None (the loss alone) for the others.

    Args:
        task: the task (`get_task(name)`).

    Returns:
        Callable | None: a function for Trainer's `compute_metrics` (its result, `accuracy`, reaches the records
            as eval_accuracy), or None.

    Examples:
        >>> task_metrics(get_task("image-classification")).__name__, task_metrics(get_task("causal-lm"))
        ('accuracy', None)
    """
    return accuracy if task.metric == "accuracy" else None
