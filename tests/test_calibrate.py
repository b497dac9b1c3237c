import shutil

import pytest
import torch

from attnsurg.calibrate import (
    SHORT_PROMPT_TOKENS, InputStatistics, calibration_windows, input_statistics, prompt_layout, prompts_of, short_prompt_starts,
)
from attnsurg.errors import UserError
from attnsurg.pipelines.scoring import domain_texts, scored_text
from attnsurg.requests import TextData

from helpers import fake_assets


def test_several_datasets_take_the_windows_in_turn_from_their_calibration_parts(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    fake_assets(tmp_path)
    names = ["wiki-sample", "c4-sample", "code-sample"]
    mixed = calibration_windows(tokenizer, TextData(dataset=",".join(names), part="calib"), 7 * 16, 16)
    alone = {n: calibration_windows(tokenizer, TextData(dataset=n, part="calib"), 3 * 16, 16) for n in names}
    assert mixed.shape == (7, 16)
    expected = [alone["wiki-sample"][0], alone["c4-sample"][0], alone["code-sample"][0], alone["wiki-sample"][1],
                alone["c4-sample"][1], alone["code-sample"][1], alone["wiki-sample"][2]]
    assert torch.equal(mixed, torch.stack(expected))


def test_a_mixed_calibration_is_scored_on_its_first_dataset_and_the_others_are_domains():
    mixed = TextData(dataset="all", part="calib")
    assert scored_text(mixed).dataset == "wiki-sample"
    assert [t.dataset for t in domain_texts(mixed, ["wiki-sample", "c4-sample", "code-sample"], 1024)] == ["c4-sample", "code-sample"]
    single = TextData(dataset="c4-sample", part="calib")
    assert scored_text(single) == single


def test_short_prompts_cut_the_end_of_every_window_and_restart_positions():
    windows = torch.arange(4 * 64).view(4, 64)
    starts = short_prompt_starts(windows, 0.5, seed=3)
    assert starts[:, 0].all() and not starts[:, 1:32].any() and starts[:, 32].all()
    low, high = SHORT_PROMPT_TOKENS
    for i, row in enumerate(starts):
        prompts = prompts_of(windows[i], row)
        assert torch.equal(torch.cat(prompts), windows[i]) and len(prompts[0]) == 32
        assert all(low <= len(p) <= high for p in prompts[1:-1])
    positions, visible = prompt_layout(starts)
    for i, row in enumerate(starts):
        first = 0
        for t in range(64):
            first = t if row[t] else first
            assert positions[i, t] == t - first
            assert torch.equal(visible[i, t], (torch.arange(64) >= first) & (torch.arange(64) <= t))
    assert torch.equal(short_prompt_starts(windows, 0.0), starts & (torch.arange(64) == 0))


def test_statistics_over_prompts_see_each_prompt_as_a_model_input_of_its_own():
    """Every prompt is run alone, so its first token is a first token (an attention sink) in the statistics."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    windows = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    starts = short_prompt_starts(windows, 0.5, seed=1)
    attention = model.model.layers[0].self_attn
    packed = input_statistics(model, [attention], windows, starts)[0]
    prompts = [p for i in range(2) for p in prompts_of(windows[i], starts[i])]
    alone = [input_statistics(model, [attention], p[None])[0] for p in prompts]
    assert packed.windows == len(prompts) and packed.tokens == 80
    expected = sum(s.moment for s in alone) / 80
    torch.testing.assert_close(packed.sigma, expected)
    torch.testing.assert_close(packed.sigma_first, sum(s.first_moment for s in alone) / len(prompts))


@pytest.mark.parametrize("command", [["compress", "--method", "svd", "--ratio", "0.5"], ["convert", "--stream"]])
def test_nan_weights_are_one_line_before_any_decomposition(command, tiny_checkpoints, corpus_file, tmp_path):
    """A checkpoint whose weights hold NaN is named as broken, not decomposed into NaN factors."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from attnsurg.cli import app

    source = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["llama-gqa"], source)
    weights = load_file(source / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    weights["model.layers.0.mlp.down_proj.weight"][3, 5] = float("inf")
    weights["lm_head.weight"][1, 1] = float("nan")  # read by no calibration pass
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    result = CliRunner().invoke(app, [command[0], str(source), *command[1:], "--calib-text", str(corpus_file),
                                      "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "0",
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
    named = result.output.split("NaN or infinite values in ")[1].split(":")[0]
    assert named in ("model.layers.0.mlp.down_proj.weight", "lm_head.weight")  # the first read (streamed: the head)


def test_activations_that_overflow_are_named_by_the_module_they_enter():
    from attnsurg.calibrate import check_finite

    stats = [InputStatistics(), InputStatistics()]
    stats[0].add(torch.ones(1, 3, 4))
    stats[1].add(torch.full((1, 3, 4), float("inf")))
    with pytest.raises(UserError, match="model.layers.1.self_attn"):
        check_finite(stats, ["model.layers.0.self_attn", "model.layers.1.self_attn"])
