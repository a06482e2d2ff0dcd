"""The inner optimizer (hf_diloco.inner): `inner_optimizer: muon` splits the model as Muon's users do, steps each
part as a hand computation says, follows the learning-rate schedule and resumes exactly. Real processes elsewhere:
the recipes with Muon for DiLoCo and its DDP baseline (tests/test_recipes.py), replicas identical after every
sync (tests/test_compression.py: streamed int4 with error feedback, DDP inside replicas of two processes;
tests/test_torchft.py: torchft against the torch backend)."""

import math

import pytest
import torch
import torch.optim._muon as torch_muon
from helpers import pattern_dataset, tiny_llama
from torch import nn
from transformers import Trainer, TrainingArguments, default_data_collator

from hf_diloco import DiLoCoConfig, DiLoCoTrainer
from hf_diloco.config import ConfigError
from hf_diloco.inner import MuonWithAdamW, muon_parameter_names, muon_with_adamw, orthogonalized_in_float32_on_cpu

COMMON = dict(per_device_train_batch_size=4, learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="cosine",
              weight_decay=0.1, max_grad_norm=1.0, save_strategy="no", report_to="none", disable_tqdm=True,
              use_cpu=True, seed=0)


def untied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=16, tie_word_embeddings=False))


def test_muon_takes_the_body_s_weight_matrices_and_adamw_the_embeddings_heads_and_vectors():
    """Llama (tied and untied head), GPT-2 (Conv1D matrices, learned positions) and a classifier head: Muon's
    share is every nn.Linear / Conv1D weight outside the head, counted here from the module types alone."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForSequenceClassification
    from transformers.pytorch_utils import Conv1D

    def body_matrices(model, heads):
        return sorted(f"{name}.weight" for name, module in model.named_modules()
                      if isinstance(module, (nn.Linear, Conv1D)) and name.split(".")[0] not in heads)

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    classifier = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=2,
                                                            num_labels=3, pad_token_id=0))
    for model, heads in ((tiny_llama(), {"lm_head"}), (untied_llama(), {"lm_head"}), (gpt2, {"lm_head"}),
                         (classifier, {"score"})):
        names = muon_parameter_names(model)
        assert sorted(names) == body_matrices(model, heads), type(model).__name__
        params = dict(model.named_parameters())
        assert all(params[n].dim() == 2 for n in names)
        rest = [n for n in params if n not in names]
        assert any("embed" in n or "wte" in n for n in rest) and any(p.dim() == 1 for n, p in params.items()
                                                                      if n in rest)
    assert "transformer.wpe.weight" not in muon_parameter_names(gpt2), "position embeddings are embeddings"


def newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration (coefficients 3.4445, -4.775, 2.0315), written out in float64."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def test_one_step_moves_each_part_as_muon_and_adamw_say_by_hand():
    """From a fixed gradient, the first step: a Muon matrix moves by η·0.2·√max(rows, cols)·NS5(g·(1 + 0.95))
    after decoupled weight decay (Nesterov's first look-ahead; on the CPU the iteration runs in float32, so to 1e-4
    in norm of the float64 iteration's step, where torch's bfloat16 one is 1.4-1.6% off), an AdamW value by
    η·g/(|g| + ε) (bias-corrected moments of one step), with weight decay on the AdamW matrices and none on vectors
    (to 1e-6)."""
    model = untied_llama()
    lr, decay = 1e-2, 0.1
    decay_names = Trainer.get_decay_parameter_names(None, model)
    optimizer = muon_with_adamw(model, decay_names, lr=lr, weight_decay=decay, betas=(0.9, 0.999), eps=1e-8)
    torch.manual_seed(1)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    optimizer.step()
    muon = set(muon_parameter_names(model))
    for name, param in model.named_parameters():
        g, theta = grads[name], before[name]
        if name in muon:
            step = param.detach() - theta * (1 - lr * decay)
            expected = -lr * 0.2 * math.sqrt(max(g.shape)) * newton_schulz(g * (1 + 0.95))
            assert (step - expected).norm() <= 1e-4 * expected.norm(), name
        else:
            wd = decay if name in decay_names else 0.0
            expected = theta * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)
            assert torch.allclose(param.detach(), expected, atol=1e-6), name


def test_cpu_matrices_are_orthogonalized_in_float32_and_others_as_torch_does_only_inside_a_step():
    """Inside `orthogonalized_in_float32_on_cpu`, torch's Muon orthogonalizes a CPU matrix (tall or wide) in float32,
    within 1e-5 of the float64 iteration, and a matrix elsewhere (the meta device here) with its own bfloat16
    iteration; outside, torch's function is back."""
    original = torch_muon._zeropower_via_newtonschulz
    coefficients = (3.4445, -4.775, 2.0315)
    torch.manual_seed(0)
    with orthogonalized_in_float32_on_cpu():
        for shape in [(24, 40), (40, 24)]:
            g = torch.randn(shape)
            x = torch_muon._zeropower_via_newtonschulz(g, coefficients, 5, 1e-7)
            assert x.dtype == torch.float32 and x.shape == g.shape
            reference = newton_schulz(g)
            assert (x - reference).norm() <= 1e-5 * reference.norm(), shape
            assert (original(g, coefficients, 5, 1e-7).float() - reference).norm() > 1e-3 * reference.norm()
        elsewhere = torch_muon._zeropower_via_newtonschulz(torch.empty(24, 40, device="meta"), coefficients, 5, 1e-7)
        assert elsewhere.dtype == torch.bfloat16
    assert torch_muon._zeropower_via_newtonschulz is original


def test_a_muon_step_is_within_the_adamw_bound_the_size_rule_uses():
    """The contribution checks' `size` rule bounds a step's norm by η·√n (AdamW moves a value by about η at
    most); a Muon step (no weight decay) has the norm of 0.2·η per value, give or take Newton-Schulz's spread of
    singular values: between 0.1 and 0.3 of the bound on every matrix, over 5 steps of random gradients."""
    model = untied_llama()
    lr = 1e-2
    optimizer = muon_with_adamw(model, [], lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    params = dict(model.named_parameters())
    torch.manual_seed(2)
    for _ in range(5):
        before = {n: params[n].detach().clone() for n in muon_parameter_names(model)}
        for p in params.values():
            p.grad = torch.randn_like(p)
        optimizer.step()
        for name, theta in before.items():
            ratio = float((params[name].detach() - theta).norm()) / (lr * math.sqrt(theta.numel()))
            assert 0.1 < ratio < 0.3, (name, ratio)


def test_the_learning_rate_schedule_steers_both_parts():
    """A scheduler built on the optimizer sets `lr` on Muon's groups and AdamW's alike, and their optimizers
    step with it: after warm-up's first step (lr × 1/3) both parts moved a third as far as at full lr."""
    lengths = {}
    for factor in (1.0, 1 / 3):
        model = untied_llama()
        optimizer = muon_with_adamw(model, [], lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step, f=factor: f)
        assert [g["lr"] for g in optimizer.muon.param_groups + optimizer.adamw.param_groups] == \
            pytest.approx([1e-2 * factor] * len(optimizer.param_groups))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.manual_seed(3)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
        lengths[factor] = {n: float((p.detach() - before[n]).norm()) for n, p in model.named_parameters()}
    muon = muon_parameter_names(untied_llama())
    for name, full in lengths[1.0].items():
        assert lengths[1 / 3][name] == pytest.approx(full / 3, rel=1e-4), (name, name in muon)


def test_diloco_with_muon_at_one_replica_and_outer_lr1_is_trainer_with_the_same_optimizer(tmp_path):
    """M = 1, one sync after 12 steps, outer SGD lr 1 without momentum: DiLoCoTrainer with inner_optimizer muon
    ends where plain Trainer ends when given MuonWithAdamW over the same split (weight decay, cosine schedule,
    clipping), to 1e-6 (a sync at every step would not do: θ − (θ − θ_i) is θ_i to a rounding, and Muon's bfloat16
    iteration turns roundings into 1e-4 differences in 12 steps, as large as leaving out weight decay); and the
    contribution checks take it as an optimizer whose steps the learning rate bounds."""
    def train(trainer_cls, args, optimizers=(None, None), model=None):
        model = model or tiny_llama(seed=0)
        trainer = trainer_cls(model=model, args=args, train_dataset=pattern_dataset(),
                              data_collator=default_data_collator, optimizers=optimizers)
        trainer.train()
        return trainer, model.state_dict()

    model = tiny_llama(seed=0)
    plain_optimizer = muon_with_adamw(model, Trainer.get_decay_parameter_names(None, model), lr=3e-3,
                                      weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
    _, plain = train(Trainer, TrainingArguments(output_dir=str(tmp_path / "plain"), max_steps=12, **COMMON),
                     (plain_optimizer, None), model)
    trainer, diloco = train(DiLoCoTrainer, DiLoCoConfig(
        output_dir=str(tmp_path / "diloco"), inner_steps=12, outer_lr=1.0, outer_momentum=0.0, outer_nesterov=False,
        inner_optimizer="muon", max_steps=12, **COMMON))
    assert isinstance(trainer.optimizer.optimizer, MuonWithAdamW)
    worst = max((plain[k] - diloco[k]).abs().max().item() for k in plain)
    assert worst <= 1e-6, f"largest parameter difference {worst:.2e}"
    assert trainer.diloco.engine.gate._adam()


def test_a_muon_run_resumes_from_its_round_checkpoint_exactly(tmp_path):
    """Muon's momentum and AdamW's moments are saved with the round checkpoint and loaded on resume: 10 steps
    (H = 5) end where a run resumed from checkpoint-5 ends, to 1e-6; a checkpoint of the other inner optimizer is
    refused in one sentence, either way round."""
    def run(out, resume=None, inner_optimizer="muon"):
        args = DiLoCoConfig(output_dir=str(out), inner_steps=5, inner_optimizer=inner_optimizer, max_steps=10,
                            save_every_rounds=1, **{**COMMON, "save_strategy": "steps", "save_steps": 5})
        model = tiny_llama(seed=0)
        DiLoCoTrainer(model=model, args=args, train_dataset=pattern_dataset(),
                      data_collator=default_data_collator).train(resume_from_checkpoint=resume)
        return model.state_dict()

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "full", resume=str(tmp_path / "full" / "checkpoint-5"))
    assert max((full[k] - resumed[k]).abs().max().item() for k in full) <= 1e-6
    model = untied_llama()
    adamw = torch.optim.AdamW(model.parameters())
    optimizer = muon_with_adamw(model, [], lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    with pytest.raises(ConfigError, match="saved by inner_optimizer adamw, and this run trains with inner_optimizer "
                                          "muon; resume with the inner_optimizer it was saved with"):
        optimizer.load_state_dict(adamw.state_dict())
    with pytest.raises(ConfigError, match="saved by inner_optimizer muon, and this run trains with inner_optimizer "
                                          "adamw"):
        run(tmp_path / "full", resume=str(tmp_path / "full" / "checkpoint-5"), inner_optimizer="adamw")


def test_muon_is_refused_where_a_replica_splits_its_matrices_and_for_an_unknown_name(tmp_path):
    said = {}
    for name, settings in (("fsdp", {"fsdp": True, "replica_group_size": 2}),
                           ("tp", {"tp_size": 2, "replica_group_size": 2}), ("name", {})):
        with pytest.raises(ConfigError) as error:
            DiLoCoConfig(output_dir=str(tmp_path), use_cpu=True,
                         inner_optimizer="sgd" if name == "name" else "muon", **settings)
        said[name] = str(error.value)
    assert said["fsdp"].startswith("inner_optimizer muon orthogonalizes each whole weight matrix, and with FSDP2")
    assert "with tensor parallel inside a replica" in said["tp"]
    assert said["name"] == "inner_optimizer must be one of adamw, muon, got 'sgd'."
