"""LoRA adapters: they start at the operated model, merge back into the same shapes and logits, train what
``train: attention`` trains less the projections' full weights, and leave a conversion's fixed values fixed."""

import torch
from peft.tuners.lora import LoraLayer

from attnsurg.adapters import ADAPTER, add_lora, merge_lora
from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.heal import heal_model, held_projection_rows, select_trainable
from attnsurg.methods.base import SurgeryInputs, method_for
from attnsurg.methods.linear.method import LinearReport, LinearSettings
from attnsurg.methods.mla.refine import norm_channel_of
from attnsurg.requests import COMMAND_CALIBRATION

from conftest import build_tiny
from helpers import VOCAB, held_out
from test_heal import loss_on, mla_student, settings


def adapted(model, rank: int = 4) -> list[torch.nn.Parameter]:
    select_trainable(model, "lora")
    torch.manual_seed(0)
    return add_lora(model, rank, 2.0 * rank, held_projection_rows(model))


def linear_student():
    model = build_tiny("llama", VOCAB, num_key_value_heads=2)
    linear_settings = LinearSettings(window=6, transfer_steps=2)
    method = method_for(linear_settings)
    config = inspect_config(model.config)
    report = LinearReport(method.plan(config, linear_settings), config)
    windows = torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(1))
    inputs = SurgeryInputs(family_for_surgery("llama"), windows, COMMAND_CALIBRATION)
    return method.operate_model(model, inputs, linear_settings, report)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(held_out()[:2, :24]).logits


def test_adapters_start_at_the_model_and_merge_back_to_its_shapes_and_logits(tiny_checkpoints):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"]).eval()
    student = mla_student(teacher)
    shapes = {name: p.shape for name, p in student.state_dict().items()}
    before = logits(student)
    adapted(student)
    assert torch.equal(logits(student), before)  # B starts at zero
    with torch.no_grad():
        for module in student.modules():
            if isinstance(module, LoraLayer):
                module.lora_B[ADAPTER].weight.normal_(std=0.05)
    trained = logits(student)
    assert (trained - before).abs().max() > 1e-3
    assert merge_lora(student) > 0
    assert not any(isinstance(m, LoraLayer) for m in student.modules())
    assert {name: p.shape for name, p in student.state_dict().items()} == shapes
    assert torch.allclose(logits(student), trained, atol=1e-5)


def test_lora_trains_adapters_and_the_attentions_own_parameters():
    student = linear_student()
    trainable = {id(p) for p in adapted(student)}
    names = {name for name, p in student.named_parameters() if id(p) in trainable}
    assert names and all(".self_attn." in name for name in names)
    assert not any(name.endswith("base_layer.weight") or name.endswith("base_layer.bias") for name in names)
    attention = student.model.layers[0].self_attn
    for own in (attention.feature_q, attention.feature_k, attention.linear_scale):  # LoLCATs trains these in full
        assert id(own) in trainable
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.0.self_attn.{projection}.lora_A.{ADAPTER}.weight" in names


def test_lora_healing_lowers_the_loss_and_holds_the_norm_channel(teacher_and_tokenizer, corpus_file, tmp_path):
    teacher, tokenizer = teacher_and_tokenizer
    student = mla_student(teacher)
    shapes = {name: p.shape for name, p in student.state_dict().items()}
    channels = [norm_channel_of(layer.self_attn) for layer in student.model.layers]
    held = {name: p.detach().clone() for name, p in student.named_parameters()
            if "kv_a_layernorm" in name or "q_a_" in name}
    heal = settings(corpus_file, train="lora", lora_rank=4, lr=2e-3)
    ids = torch.tensor(tokenizer(corpus_file.read_text())["input_ids"][:256]).view(4, 64)
    before = loss_on(student, teacher, ids, heal)
    report = heal_model(student, teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "state")
    after = loss_on(student, teacher, ids, heal)
    assert after < 0.8 * before, (before, after)
    assert report.trainable_parameters < sum(p.numel() for n, p in student.named_parameters() if ".self_attn." in n)
    assert {name: p.shape for name, p in student.state_dict().items()} == shapes
    for name, value in held.items():
        assert torch.equal(dict(student.named_parameters())[name], value), name
    for layer, channel in zip(student.model.layers, channels):
        assert norm_channel_of(layer.self_attn) == channel
