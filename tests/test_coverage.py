"""The support matrix is generated from the registry, and every refusal names what blocks it."""

import json

from typer.testing import CliRunner

from attnsurg.arch.coverage import FAMILY_CONFIGS, support_matrix
from attnsurg.arch.families import family_for_surgery
from attnsurg.cli import app


def test_supported_families_are_exact_and_refusals_name_the_feature():
    matrix = support_matrix()
    assert set(matrix) == set(FAMILY_CONFIGS)
    for family in ("Llama 2 / SmolLM (llama)", "Llama 3.x (llama3 RoPE scaling)", "Mistral", "Qwen2 / Qwen2.5 (q/k/v biases)",
                   "Qwen3 (q/k norms)", "Phi-3 (fused qkv)"):
        row = matrix[family]
        assert all(row[m] == "exact" for m in row if m not in ("mla", "linear"))
        assert row["linear"] == "exact with a window as long as the context"
        family_for_surgery(FAMILY_CONFIGS[family]().model_type)  # a surgery adapter exists for it
        if "Qwen3" in family:
            assert row["mla"] == "fitted: q/k norms linearised, then refined"
        else:
            assert row["mla"].startswith("exact with --format exact")
    for family in ("Gemma 2 (sliding layers, soft-capping)", "Gemma 3 (q/k norms, sliding layers)"):
        row = matrix[family]
        assert all(row[m] == "exact" for m in ("svd", "asvd", "svdllm", "tucker", "cp", "loki")), row
        assert row["mla"] == "refused: sliding-window attention cannot be expressed as MLA", row
        assert row["linear"].startswith("refused: "), row


def test_info_methods_prints_the_matrix_without_a_model():
    table = CliRunner().invoke(app, ["info", "--methods"])
    assert table.exit_code == 0 and "Qwen3" in table.stdout and "refused" in table.stdout
    assert json.loads(CliRunner().invoke(app, ["info", "--methods", "--json"]).stdout) == support_matrix()
    missing = CliRunner().invoke(app, ["info"])
    assert missing.exit_code == 2 and "missing MODEL" in missing.output
