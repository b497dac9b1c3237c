"""The streamed low-rank compression writes what the in-memory one builds, reading one layer at a time."""

import json
import pytest
import torch
from transformers import AutoModelForCausalLM

from attnsurg.arch import inspect_config
from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.io.lazy import CheckpointReader
from attnsurg.io.load import load_model, resolve_source
from attnsurg.methods.base import operate_loaded
from attnsurg.methods.lowrank import plan_lowrank
from attnsurg.methods.compress_layers import compress_streamed

from conftest import assert_streamed_like_loaded


@pytest.mark.parametrize("variant, targets, kv_latent, method", [("llama-gqa", "k,v", True, "svdllm"),
                                                                ("qwen2", "q,k,v,o", False, "asvd"),
                                                                ("qwen3", "k,v", True, "svdllm")])
def test_streamed_compression_equals_the_in_memory_one(variant, targets, kv_latent, method, tiny_checkpoints, tmp_path):
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[variant])
    source.save_pretrained(tmp_path / "source", max_shard_size="60KB")  # sharded: layers span files
    family = family_for_surgery(source.config.model_type)
    windows = torch.randint(0, source.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    plan = plan_lowrank(inspect_config(source.config), method, targets, ratio=0.5, kv_latent=kv_latent)
    attentions = attention_layers(source, family)
    stats = input_statistics(source, attentions + [a.o_proj for a in attentions], windows)
    in_memory = operate_loaded(source, family, list(zip(stats[:2], stats[2:])), plan, windows.shape[1])
    out = tmp_path / "streamed"
    out.mkdir()
    config, errors = compress_streamed(CheckpointReader(tmp_path / "source"), source.config, family, windows, plan, out,
                                       max_shard_size="60KB")
    config.save_pretrained(out)
    streamed = load_model(resolve_source(str(out)))
    assert type(streamed) is type(in_memory.model) and errors == pytest.approx(in_memory.errors, rel=1e-6, abs=1e-12)
    ids = torch.randint(0, source.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, in_memory.model(ids).logits, rtol=1e-4, atol=1e-4)


def test_streamed_output_is_written_in_the_dtype_asked(tiny_checkpoints, tmp_path):
    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama-gqa"])
    source.save_pretrained(tmp_path / "source")
    plan = plan_lowrank(inspect_config(source.config), "svdllm", "k,v", ratio=0.5, kv_latent=True)
    windows = torch.randint(0, source.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    (tmp_path / "out").mkdir()
    config, _ = compress_streamed(CheckpointReader(tmp_path / "source"), source.config, family_for_surgery("llama"),
                                  windows, plan, tmp_path / "out", dtype=torch.bfloat16)
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
        assert "model.layers.0.self_attn.kv_down.weight" in f.keys()
    assert config.dtype == "bfloat16"


def test_compress_stream_writes_the_checkpoint_compress_writes(tiny_checkpoints, corpus_file, tmp_path):
    from typer.testing import CliRunner

    from attnsurg.cli import app

    runner = CliRunner()
    common = ["compress", str(tiny_checkpoints["qwen2"]), "--method", "svdllm", "--targets", "k,v", "--kv-latent",
              "--ratio", "0.5", "--calib-text", str(corpus_file), "--calib-tokens", "512", "--calib-seq-len", "64",
              "--eval-tokens", "128", "--eval-domains", "none"]
    reports = {}
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", ["--stream"])):
        result = runner.invoke(app, common + extra + ["--json", "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        reports[name] = json.loads(result.stdout)
        assert reports[name]["streamed"] == (name == "streamed")
    for score in ("ppl_before", "ppl_after"):  # the streamed run scores the source and what it wrote, a module at a time
        assert reports["streamed"][score] == pytest.approx(reports["loaded"][score], rel=1e-4)
    loaded, streamed = (load_model(resolve_source(str(tmp_path / name))) for name in ("loaded", "streamed"))
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-4, atol=1e-4)
    assert_streamed_like_loaded(tmp_path / "loaded", tmp_path / "streamed")


@pytest.mark.parametrize("budget", [["--method", "tucker", "--ratio", "0.5"], ["--method", "cp", "--ratio", "0.5"],
                                    ["--method", "tucker", "--stacked", "--ratio", "0.5"],
                                    ["--method", "loki", "--rank", "8", "--top-k", "0.25"],
                                    ["--method", "loki", "--variance", "0.9", "--top-k", "0.25"],
                                    ["--method", "svdllm", "--targets", "q,k,v,o", "--ratio", "0.5", "--allocate"],
                                    ["--method", "tucker", "--ratio", "0.5", "--allocate"],
                                    ["--method", "topk", "--top-k", "0.25"]])
def test_every_other_method_streams_to_the_checkpoint_compress_writes(budget, tiny_checkpoints, corpus_file, tmp_path):
    """Tucker at a --ratio chooses each projection's mode ranks on its data, and Loki at a --variance each layer's
    rank: the streamed output's shapes and config are known only layer by layer, and still equal the loaded run's.
    ``--allocate`` spreads the ranks over every layer's spectrum, which a first streamed pass surveys."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from attnsurg.cli import app

    common = ["compress", str(tiny_checkpoints["llama-gqa"]), *budget, "--calib-text", str(corpus_file),
              "--calib-tokens", "512", "--calib-seq-len", "64", "--eval-tokens", "0"]
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", ["--stream"])):
        result = CliRunner().invoke(app, common + extra + ["-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    loaded, streamed = (load_model(resolve_source(str(tmp_path / name))) for name in ("loaded", "streamed"))
    assert streamed.config.attnsurg == loaded.config.attnsurg
    with safe_open(tmp_path / "streamed" / "model.safetensors", "pt") as f:
        tied = {"lm_head.weight"} if loaded.config.tie_word_embeddings else set()
        assert set(f.keys()) == set(loaded.state_dict()) - tied
        for name in f.keys():
            assert tuple(f.get_slice(name).get_shape()) == tuple(loaded.state_dict()[name].shape), name
            if name.endswith("loki_basis"):
                torch.testing.assert_close(f.get_tensor(name), loaded.state_dict()[name], rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-4, atol=1e-4)
    assert_streamed_like_loaded(tmp_path / "loaded", tmp_path / "streamed")


def test_a_checkpoint_of_pickle_weights_streams_through_a_safetensors_copy(tiny_checkpoints, corpus_file, tmp_path):
    """Streaming reads safetensors a tensor at a time: pickle weights (allowed with --allow-pickle only) are
    loaded once and written as safetensors beside the output, then streamed; the result equals the loaded run's."""
    import shutil

    from typer.testing import CliRunner

    from attnsurg.cli import app

    source = tiny_checkpoints["llama-gqa"]
    target = tmp_path / "pickled"
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target)
    torch.save(AutoModelForCausalLM.from_pretrained(source).state_dict(), target / "pytorch_model.bin")
    common = ["compress", str(target), "--method", "svd", "--ratio", "0.5", "--calib-text",
              str(corpus_file), "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "0"]
    refused = CliRunner().invoke(app, common + ["-o", str(tmp_path / "never")])
    assert refused.exit_code == 2 and "--allow-pickle" in refused.stderr and not (tmp_path / "never").exists()
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", [])):
        result = CliRunner().invoke(app, common + extra + ["--allow-pickle", "--json", "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["streamed"] == (name == "streamed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loaded", "pickled", "streamed"]
    loaded, streamed = (load_model(resolve_source(str(tmp_path / name))) for name in ("loaded", "streamed"))
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_gguf_source_is_dequantized_beside_the_output_and_streams(tiny_checkpoints, corpus_file, tmp_path):
    """A .gguf file streams too: dequantized once into a safetensors directory beside the output (removed after
    the run), then read a layer at a time; the checkpoint equals the one from the source loaded whole."""
    from typer.testing import CliRunner

    from attnsurg.cli import app
    from attnsurg.io.gguf_export import export_gguf

    gguf = export_gguf(str(tiny_checkpoints["llama-gqa"]), tmp_path / "tiny.gguf", "f32", "gpt-2").path
    common = ["compress", str(gguf), "--method", "svdllm", "--ratio", "0.5", "--calib-text", str(corpus_file),
              "--calib-tokens", "256", "--calib-seq-len", "64", "--eval-tokens", "128", "--eval-domains", "none"]
    reports = {}
    for name, extra in (("loaded", ["--no-stream"]), ("streamed", [])):
        result = CliRunner().invoke(app, common + extra + ["--json", "-o", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        reports[name] = json.loads(result.stdout)
        assert reports[name]["streamed"] == (name == "streamed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loaded", "streamed", "tiny.gguf"]
    assert reports["streamed"]["ppl_after"] == pytest.approx(reports["loaded"]["ppl_after"], rel=1e-4)
    loaded, streamed = (load_model(resolve_source(str(tmp_path / name))) for name in ("loaded", "streamed"))
    ids = torch.randint(0, loaded.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, loaded(ids).logits, rtol=1e-4, atol=1e-4)
