"""Healing: the distillation loss falls, resumption reproduces an uninterrupted run, what must stay fixed
stays fixed, and the command writes a checkpoint (or one clear line for bad input)."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.heal import Distiller, batch_indices, heal_model, heal_state_dir, lr_factor, select_trainable
from attnsurg.methods.mla.conversion import convert
from attnsurg.methods.mla.plan import plan_mla
from attnsurg.methods.mla.refine import norm_channel_of
from attnsurg.recipe import HealSettings
from attnsurg.requests import TextData

from conftest import build_tiny

LLAMA = family_for_surgery("llama")


def mla_student(teacher, budget: float = 0.25):
    plan = plan_mla(inspect_config(teacher.config), kv_budget=budget, format="exact")  # its constant channel is what hold_exactness_constants keeps
    windows = torch.randint(0, teacher.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    return convert(teacher, LLAMA, windows, plan).model


def settings(corpus_file, **overrides) -> HealSettings:
    base = dict(data=TextData(text=corpus_file, part="calib"), tokens=32 * 2 * 16, seq_len=32, batch_size=2,
                lr=5e-4, warmup=0.0, schedule="constant", save_every=2)
    return HealSettings(**{**base, **overrides})


def loss_on(student, teacher, ids, heal: HealSettings) -> float:
    distiller = Distiller(student, student, teacher, heal)
    with torch.no_grad():
        loss = distiller.loss(ids).item()
    distiller.close()
    return loss


def test_a_few_steps_reduce_the_distillation_loss(teacher_and_tokenizer, corpus_file, tmp_path):
    teacher, tokenizer = teacher_and_tokenizer
    student = mla_student(teacher)
    heal = settings(corpus_file)
    ids = torch.tensor(tokenizer(corpus_file.read_text())["input_ids"][:256]).view(4, 64)
    before = loss_on(student, teacher, ids, heal)
    report = heal_model(student, teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "state")
    after = loss_on(student, teacher, ids, heal)
    assert report.steps == 16 and len(report.losses) == 16
    assert after < 0.8 * before, (before, after)


def test_a_finished_run_started_again_trains_nothing_more(teacher_and_tokenizer, corpus_file, tmp_path):
    """The last step is saved too, so a run whose checkpoint could not be written resumes at its end."""
    teacher, tokenizer = teacher_and_tokenizer
    heal = settings(corpus_file, tokens=32 * 2 * 3)
    first = mla_student(teacher)
    heal_model(first, teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "s")
    again = mla_student(teacher)
    report = heal_model(again, teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "s")
    assert report.resumed_from == report.steps == 3 and not report.losses
    for a, b in zip(first.parameters(), again.parameters()):
        assert torch.equal(a, b)


def test_learning_rate_schedule():
    assert lr_factor(0, 10, 2, "cosine") > 0  # the first step already learns
    assert lr_factor(1, 10, 2, "cosine") < lr_factor(2, 10, 2, "cosine") == 1.0
    assert lr_factor(9, 10, 2, "cosine") < lr_factor(5, 10, 2, "cosine") < 1.0
    assert lr_factor(9, 10, 0, "constant") == 1.0 and lr_factor(5, 10, 0, "linear") == 0.5


def test_training_touches_attention_only_and_holds_the_norm_channel(teacher_and_tokenizer, corpus_file, tmp_path):
    teacher, tokenizer = teacher_and_tokenizer
    student = mla_student(teacher)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    channels = [norm_channel_of(layer.self_attn) for layer in student.model.layers]
    assert all(c is not None for c in channels)
    heal_model(student, teacher, tokenizer, settings(corpus_file, tokens=32 * 2 * 3), seed=0, state_dir=tmp_path / "s")
    after = dict(student.named_parameters())
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(".self_attn." in name for name in changed)
    assert not any("kv_a_layernorm" in name for name in changed)
    for layer, channel in zip(student.model.layers, channels):
        kv_a = layer.self_attn.kv_a_proj_with_mqa
        assert norm_channel_of(layer.self_attn) == channel
        assert kv_a.weight[channel].abs().max() == 0


def test_train_all_widens_to_every_parameter(teacher_and_tokenizer):
    teacher, _ = teacher_and_tokenizer
    student = mla_student(teacher)
    attention_only = sum(p.numel() for p in select_trainable(student, "attention"))
    everything = sum(p.numel() for p in select_trainable(student, "all"))
    frozen_norms = sum(layer.self_attn.kv_a_layernorm.weight.numel() for layer in student.model.layers)
    assert attention_only < everything == sum(p.numel() for p in student.parameters()) - frozen_norms


def linear_student(teacher):
    from attnsurg.methods.base import SurgeryInputs, method_for
    from attnsurg.methods.linear.method import LinearReport, LinearSettings
    from attnsurg.requests import COMMAND_CALIBRATION

    linear = LinearSettings(window=8, transfer_steps=2)
    method = method_for(linear)
    anatomy = inspect_config(teacher.config)
    windows = torch.randint(0, teacher.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    student = AutoModelForCausalLM.from_config(teacher.config)
    student.load_state_dict(teacher.state_dict())
    inputs = SurgeryInputs(LLAMA, windows, COMMAND_CALIBRATION)
    return method.operate_model(student, inputs, linear, LinearReport(method.plan(anatomy, linear), anatomy))


def test_train_features_trains_a_linear_conversions_maps_and_nothing_else(teacher_and_tokenizer, corpus_file,
                                                                          tmp_path):
    teacher, tokenizer = teacher_and_tokenizer
    student = linear_student(teacher)
    added = {"feature_q", "feature_q_bias", "feature_k", "feature_k_bias", "linear_scale", "log_decay"}
    selected = {id(p) for p in select_trainable(student, "features")}
    trained = {name for name, p in student.named_parameters() if id(p) in selected}
    assert {name.rsplit(".", 1)[1] for name in trained} == added
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    heal_model(student, teacher, tokenizer, settings(corpus_file, tokens=32 * 2 * 2, train="features"), seed=0,
               state_dir=tmp_path / "s")
    changed = {name for name, p in student.named_parameters() if not torch.equal(before[name], p)}
    assert changed and changed <= trained
    with pytest.raises(UserError, match="--train features"):
        select_trainable(mla_student(teacher), "features")


@pytest.mark.parametrize("train", ["attention", "lora"])
def test_resumed_run_reaches_the_same_weights(teacher_and_tokenizer, corpus_file, tmp_path, train):
    teacher, tokenizer = teacher_and_tokenizer
    heal = settings(corpus_file, tokens=32 * 2 * 6, schedule="cosine", warmup=0.2, train=train)

    uninterrupted = mla_student(teacher)
    heal_model(uninterrupted, teacher, tokenizer, heal, seed=3, state_dir=tmp_path / "a")

    class Interrupted(Exception):
        pass

    def stop_at_five(step: int) -> None:
        if step == 5:
            raise Interrupted

    resumed = mla_student(teacher)
    with pytest.raises(Interrupted):
        heal_model(resumed, teacher, tokenizer, heal, seed=3, state_dir=tmp_path / "b", on_step=stop_at_five)
    assert (tmp_path / "b" / "step-00000004").is_dir()  # saved every 2 steps; step 5 was lost
    resumed = mla_student(teacher)  # a fresh process would start from the unhealed checkpoint
    report = heal_model(resumed, teacher, tokenizer, heal, seed=3, state_dir=tmp_path / "b")
    assert report.resumed_from == 4
    for (name, a), b in zip(uninterrupted.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_resuming_with_other_settings_is_refused(teacher_and_tokenizer, corpus_file, tmp_path):
    from attnsurg.errors import UserError

    teacher, tokenizer = teacher_and_tokenizer
    heal = settings(corpus_file, tokens=32 * 2 * 4)
    with pytest.raises(RuntimeError):
        heal_model(mla_student(teacher), teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "s",
                   on_step=lambda step: (_ for _ in ()).throw(RuntimeError()) if step == 3 else None)
    with pytest.raises(UserError, match="other settings"):
        heal_model(mla_student(teacher), teacher, tokenizer, heal.model_copy(update={"lr": 1e-3}), seed=0,
                   state_dir=tmp_path / "s")
    with pytest.raises(UserError, match="another student"):  # the same settings from other starting weights
        heal_model(mla_student(teacher, budget=0.5), teacher, tokenizer, heal, seed=0, state_dir=tmp_path / "s")


def test_batches_are_a_function_of_seed_and_position():
    first = batch_indices(10, 0, 10, seed=1)
    assert sorted(first) == list(range(10))  # one epoch visits every window once
    assert batch_indices(10, 7, 5, seed=1) == batch_indices(10, 7, 5, seed=1)
    assert batch_indices(10, 0, 10, seed=2) != first


def test_loss_is_zero_for_the_teacher_itself(teacher_and_tokenizer):
    teacher, _ = teacher_and_tokenizer
    ids = torch.randint(0, teacher.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert loss_on(teacher, teacher, ids, HealSettings(lm_weight=0.0)) < 1e-6


def test_distiller_loss_and_gradients_equal_the_plain_loss_on_whole_logits(teacher_and_tokenizer):
    """The hooked final hidden state, one-position logits and chunked head give what the textbook loss on
    the models' own logits gives (KL + next-token loss + residual-stream match)."""
    teacher, _ = teacher_and_tokenizer
    student = mla_student(teacher)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    heal = HealSettings(kl_weight=1.0, lm_weight=0.5, hidden_weight=0.25, temperature=2.0)
    select_trainable(student, "all")

    distiller = Distiller(student, student, teacher, heal)
    chunked = distiller.loss(ids)
    distiller.close()
    got = torch.autograd.grad(chunked, [p for p in student.parameters() if p.requires_grad])

    learned = student(ids, output_hidden_states=True)
    with torch.no_grad():
        taught = teacher(ids, output_hidden_states=True)
    s = F.log_softmax(learned.logits.flatten(0, 1) / 2.0, dim=-1)
    t = F.log_softmax(taught.logits.flatten(0, 1) / 2.0, dim=-1)
    plain = 4.0 * F.kl_div(s, t, log_target=True, reduction="batchmean")
    plain = plain + 0.5 * F.cross_entropy(learned.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    layers = [((a - b).pow(2).sum(-1) / b.pow(2).sum(-1)).mean() for a, b in zip(learned.hidden_states[1:], taught.hidden_states[1:])]
    plain = plain + 0.25 * torch.stack(layers).mean()
    want = torch.autograd.grad(plain, [p for p in student.parameters() if p.requires_grad])

    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("train", [[], ["--train", "lora", "--lora-rank", "4"]], ids=["attention", "lora"])
def test_cli_heals_a_checkpoint(tiny_checkpoints, corpus_file, tmp_path, train):
    runner = CliRunner()
    student_dir = tmp_path / "student"
    convert_args = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--kv-budget", "0.25", "--format", "exact",
                    "--refine-steps", "0", "--calib-text", str(corpus_file), "--calib-tokens", "512",
                    "--eval-tokens", "0", "-o", str(student_dir)]
    assert runner.invoke(app, convert_args).exit_code == 0
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_checkpoints["llama-gqa"], teacher)
    (teacher / "README.md").write_text("---\nlicense: apache-2.0\n---\n# teacher\n")
    args = ["heal", str(student_dir), "--teacher", str(teacher), "--text", str(corpus_file),
            "--tokens", "256", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3",
            "--eval-tokens", "128", "--eval-domains", "none", "-o", str(tmp_path / "healed"), *train]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "healed 4 steps" in result.output and "ppl teacher" in result.output
    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed")
    assert type(healed).__name__ == "DeepseekV3ForCausalLM"
    recipe = (tmp_path / "healed" / "attnsurg_recipe.yaml").read_text()
    assert "heal:" in recipe and "teacher:" in recipe
    assert not (tmp_path / "healed.heal-state").exists()
    card = ModelCard.load(tmp_path / "healed" / "README.md")
    assert card.data.license == "apache-2.0"
    assert ("LoRA adapters of rank 4" in card.text) == bool(train)


def test_cli_refuses_mismatched_vocabularies(tiny_checkpoints, tmp_path, tokenizer):
    other = build_tiny("llama", 500, num_key_value_heads=2)
    other.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    result = CliRunner().invoke(app, ["heal", str(tiny_checkpoints["llama-gqa"]), "--teacher", str(tmp_path / "other"),
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "vocabularies differ" in result.output
    assert not (tmp_path / "out").exists()


def test_two_processes_share_the_steps_and_one_writes(tiny_checkpoints, corpus_file, tmp_path):
    """Under torchrun (what `accelerate launch` starts), two CPU processes form one group: half the steps
    for the same tokens, and only the main process writes and reports."""
    import subprocess
    import sys

    student = tmp_path / "student"
    convert_args = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "--kv-budget", "0.25", "--format", "exact",
                    "--refine-steps", "0", "--calib-text", str(corpus_file), "--calib-tokens", "512",
                    "--eval-tokens", "0", "-o", str(student)]
    assert CliRunner().invoke(app, convert_args).exit_code == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "attnsurg", "heal",
               str(student), "--teacher", str(tiny_checkpoints["llama-gqa"]), "--text", str(corpus_file),
               "--tokens", "1024", "--seq-len", "32", "--batch-size", "2", "--eval-tokens", "0", "-o", str(tmp_path / "healed")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("healed 8 steps (1,024 tokens)") == 1, result.stdout
    assert (tmp_path / "healed" / "config.json").is_file()


def test_gradient_checkpointing_trains_the_same_weights(teacher_and_tokenizer, corpus_file, tmp_path):
    """Activations recomputed in the backward pass instead of kept: the same steps, the same result."""
    teacher, tokenizer = teacher_and_tokenizer
    results = []
    for checkpointing in (False, True):
        student = mla_student(teacher)
        heal = settings(corpus_file, tokens=32 * 2 * 3, gradient_checkpointing=checkpointing)
        report = heal_model(student, teacher, tokenizer, heal, seed=0, state_dir=tmp_path / f"s{checkpointing}")
        assert not getattr(student, "is_activation_checkpointing", False)
        results.append((report.losses, [p.detach().clone() for p in student.parameters()]))
    (losses, weights), (losses_checkpointed, weights_checkpointed) = results
    assert [round(loss, 5) for _, loss in losses] == [round(loss, 5) for _, loss in losses_checkpointed]
    for a, b in zip(weights, weights_checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def mla_job(model, output, kv_budget: float, heal: bool = False):
    """The job ``convert --to mla --kv-budget B`` runs (with a heal step after it when ``heal``)."""
    from attnsurg.api import surgery_recipe
    from attnsurg.pipelines.job import Job
    from attnsurg.recipe import ConvertStep, HealSettings
    from attnsurg.methods.mla.settings import MLASettings

    step = ConvertStep(convert=MLASettings(kv_budget=kv_budget))
    return Job(surgery_recipe(str(model), output, step, None, HealSettings() if heal else None, 2048, [], 0))


def test_under_several_processes_the_main_one_operates_and_the_others_load(tiny_checkpoints, tmp_path, monkeypatch):
    """operated_once: the main process runs the surgery, written into the heal state directory; another
    process never runs it and loads exactly that model."""
    from types import SimpleNamespace

    from attnsurg.pipelines import processes as pipeline

    job = mla_job(tiny_checkpoints["llama-gqa"], tmp_path / "out", 0.5, heal=True)
    operated = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    runs = []

    def write(directory):
        runs.append(1)
        operated.save_pretrained(directory)

    def as_process(main: bool):
        state = SimpleNamespace(num_processes=2, is_main_process=main, wait_for_everyone=lambda: None)
        monkeypatch.setattr(pipeline, "process_state", lambda device=None: state)

    as_process(main=True)
    main = pipeline.operated_once(write, job)
    assert runs == [1]
    as_process(main=False)
    loaded = pipeline.operated_once(write, job)
    assert runs == [1]  # not run again
    for model in (main, loaded):
        for (name, a), (_, b) in zip(operated.state_dict().items(), model.state_dict().items(), strict=True):
            assert torch.equal(a, b), name


def test_two_processes_convert_once_and_heal_together(tiny_checkpoints, corpus_file, tmp_path):
    """A convert + heal recipe under torchrun: one conversion, both processes heal, one writes."""
    import subprocess
    import sys

    import yaml

    recipe = {
        "model": str(tiny_checkpoints["llama-gqa"]), "output": str(tmp_path / "healed"),
        "steps": [{"convert": {"to": "mla", "kv_budget": 0.5, "refine_steps": 2}},
                  {"heal": {"data": {"text": str(corpus_file)}, "tokens": 512, "seq_len": 32, "batch_size": 2}}],
        "calibration": {"data": {"text": str(corpus_file)}, "tokens": 512, "seq_len": 64},
        "eval": {"tokens": 0},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "attnsurg", "run",
               str(tmp_path / "recipe.yaml"), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["heal"]["steps"] == 4 and len(report["layer_errors"]) == 2
    assert (tmp_path / "healed" / "config.json").is_file() and not (tmp_path / "healed.heal-state").exists()


def test_a_heal_run_started_again_reuses_the_operated_model(tiny_checkpoints, tmp_path):
    """The operated model is saved beside the output when healing follows; started again, the run loads it
    (healing resumes only from the same starting weights), unless the surgery step changed."""
    from attnsurg.pipelines import processes as pipeline

    job = mla_job(tiny_checkpoints["llama-gqa"], tmp_path / "out", 0.5, heal=True)
    operated = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    runs = []

    def write(directory):
        runs.append(1)
        operated.save_pretrained(directory)

    first = pipeline.operated_once(write, job)
    again = pipeline.operated_once(write, job)
    assert runs == [1] and torch.equal(again.lm_head.weight, first.lm_head.weight)
    pipeline.operated_once(write, mla_job(tiny_checkpoints["llama-gqa"], tmp_path / "out", 0.25, heal=True))
    assert runs == [1, 1]


def test_a_streamed_surgery_heals_as_the_loaded_one(tiny_checkpoints, corpus_file, tmp_path):
    """With a heal step the surgery still reads the source a layer at a time (into the heal state, float32),
    and the healed checkpoint equals the one healed after a surgery on the loaded source."""
    from attnsurg.api import convert

    reports = {}
    for stream in (True, False):
        heal = {"data": {"text": str(corpus_file)}, "tokens": 256, "seq_len": 32, "batch_size": 2}
        calibration = {"data": {"text": str(corpus_file)}, "tokens": 512, "seq_len": 64}
        reports[stream] = convert(str(tiny_checkpoints["llama-gqa"]), tmp_path / f"out-{stream}", kv_budget=0.5,
                                  refine_steps=2, stream=stream, heal=heal, calibration=calibration, eval_tokens=256,
                                  eval_domains=[])
        assert reports[stream].streamed is stream and reports[stream].heal.steps == 4
        assert not heal_state_dir(tmp_path / f"out-{stream}").exists()
    streamed, loaded = (AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{s}", trust_remote_code=True)
                        for s in (True, False))
    ids = torch.arange(1, 17).unsqueeze(0)
    assert torch.allclose(streamed(ids).logits, loaded(ids).logits, atol=1e-3)
    assert reports[True].ppl_after == pytest.approx(reports[False].ppl_after, rel=1e-3)


def test_several_datasets_take_the_training_windows_in_turn(tokenizer, tmp_path, monkeypatch):
    from attnsurg.heal import held_out_windows, training_windows
    from helpers import fake_assets

    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    fake_assets(tmp_path)
    alone = {n: training_windows(tokenizer, TextData(dataset=n, part="calib"), 16) for n in ("wiki-sample", "code-sample")}
    mixed = training_windows(tokenizer, TextData(dataset="wiki-sample,code-sample", part="calib"), 16)
    short = min(map(len, alone.values()))
    assert len(mixed) == sum(map(len, alone.values()))
    assert torch.equal(mixed[: 2 * short: 2], alone["wiki-sample"][:short])
    assert torch.equal(mixed[1: 2 * short: 2], alone["code-sample"][:short])
    settings = HealSettings(data=TextData(dataset="all", part="calib"), eval_tokens=64)
    assert held_out_windows(tokenizer, settings)[0].ids.numel() > 0  # scored on the first dataset's eval part
