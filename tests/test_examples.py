"""Every example in examples/ runs end to end (on a tiny checkpoint and a small text, to stay fast)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


def run_example(args: list[str], env: dict[str, str], cwd: Path) -> str:
    bin_dir = str(Path(sys.executable).parent)
    full_env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **env}
    result = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture
def small(tiny_checkpoints, corpus_file) -> dict[str, str]:
    return {"MODEL": str(tiny_checkpoints["llama-gqa"]),
            "CALIB": f"--calib-text {corpus_file} --calib-tokens 512 --refine-steps 2 --eval-tokens 256 --eval-domains none"}


def test_convert_and_evaluate(small, corpus_file, tmp_path):
    env = {**small, "OUT": str(tmp_path / "mla"), "EVAL": f"--text {corpus_file} --max-length 64 --max-tokens 256",
           "TASKS": "--tasks passkey --passkey-lengths 192"}
    output = run_example(["bash", str(EXAMPLES / "convert_and_evaluate.sh")], env, tmp_path)
    assert "deepseek_v3" in output and "Perplexity" in output and "Passkey retrieval" in output


def test_recipe_roundtrip(tiny_checkpoints, corpus_file, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"model: {tiny_checkpoints['llama-gqa']}\noutput: unused\nsteps:\n  - compress: {{method: svdllm, ratio: 0.5}}\n"
        f"calibration:\n  data: {{text: {corpus_file}}}\n  tokens: 512\n  seq_len: 64\neval:\n  tokens: 128\n  domains: []\n"
    )
    output = run_example(["bash", str(EXAMPLES / "recipe_roundtrip.sh")], {"RECIPE": str(recipe), "OUT": str(tmp_path / "o")}, tmp_path)
    assert "bit for bit" in output


def test_heal_mla(small, corpus_file, tmp_path):
    env = {**small, "OUT": str(tmp_path / "mla"), "TOKENS": "256",
           "HEAL": f"--text {corpus_file} --seq-len 32 --batch-size 2 --eval-tokens 0"}
    output = run_example(["bash", str(EXAMPLES / "heal_mla.sh")], env, tmp_path)
    assert "healed 4 steps" in output and (tmp_path / "mla-healed" / "config.json").is_file()


def test_python_api(tiny_checkpoints, corpus_file, tmp_path):
    args = [sys.executable, str(EXAMPLES / "python_api.py"), "--model", str(tiny_checkpoints["llama-gqa"]),
            "--calib-text", str(corpus_file), "--output", str(tmp_path / "mla")]
    output = run_example(args, {}, tmp_path)
    assert "values per token over 2 layers" in output
