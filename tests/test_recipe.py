"""Recipes: YAML <-> objects, errors with field and line, the CLI and its recipe are one thing, and a
checkpoint's own recipe reproduces it bit for bit."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from attnsurg.cli import app
from attnsurg.errors import UserError
from attnsurg.io.recipe_file import dump_recipe, load_recipe, parse_recipe, shipped_recipes
from attnsurg.api import surgery_recipe
from attnsurg.methods.mla.report import refinement_of
from attnsurg.recipe import ConvertStep
from attnsurg.methods.mla.settings import MLA_CALIBRATION_TOKENS, MLASettings
from attnsurg.requests import Calibration

SHIPPED = shipped_recipes()
REQUIRED_SHIPPED = {"mla-50", "mla-25", "svdllm-kv-latent-50", "tucker-50", "loki-r32-k25"}


def test_the_required_recipes_ship():
    assert REQUIRED_SHIPPED <= {path.stem for path in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_validates_and_round_trips(path):
    recipe = load_recipe(path)
    text = dump_recipe(recipe)
    again = parse_recipe(text)
    assert again == recipe
    assert dump_recipe(again) == text  # YAML -> model -> YAML is a fixed point
    assert recipe.description


def test_short_and_long_model_forms_are_the_same_recipe():
    short = parse_recipe("model: m\noutput: o\nsteps:\n  - compress: {method: cp, rank: 8}\n")
    long = parse_recipe("model: {ref: m}\noutput: o\nsteps:\n  - compress: {method: cp, rank: 8}\n")
    assert short == long and yaml.safe_load(dump_recipe(short))["model"] == "m"


def test_calibration_and_training_text_is_the_calibration_part_when_unwritten():
    recipe = parse_recipe("model: m\noutput: o\nsteps:\n  - convert: {}\n  - heal: {data: {dataset: wiki-sample}}\n"
                          "calibration: {data: {dataset: wiki-sample}}\n")
    assert recipe.calibration.data.part == "calib" and recipe.steps[1].heal.data.part == "calib"
    assert "part: eval" not in dump_recipe(recipe)


def test_recipes_that_recorded_calibration_as_eval_still_read_the_calibration_part():
    """Earlier checkpoints' recipes say part: eval under calibration, which has always read the calibration part."""
    recipe = parse_recipe("model: m\noutput: o\nsteps:\n  - convert: {}\n"
                          "calibration: {data: {dataset: wiki-sample, text: null, part: eval}}\n")
    assert recipe.calibration.data.part == "calib"


BAD = {
    "unknown key": ("model: m\noutput: o\nsteps:\n  - compress:\n      method: tucker\n      ratoi: 0.5\n",
                    "<recipe>:6: steps[0].compress.ratoi: unknown key"),
    "wrong type": ("model: m\noutput: o\nsteps:\n  - compress:\n      method: tucker\n      ratio: lots\n",
                   "<recipe>:6: steps[0].compress.ratio: Input should be a valid number"),
    "unknown method": ("model: m\noutput: o\nsteps:\n  - compress:\n      method: magic\n",
                       "<recipe>:5: steps[0].compress.method: unknown method 'magic'"),
    "missing method": ("model: m\noutput: o\nsteps:\n  - compress: {ratio: 0.5}\n",
                       "<recipe>:4: steps[0].compress: compress needs method"),
    "bad top-k": ("model: m\noutput: o\nsteps:\n  - compress:\n      method: loki\n      top_k: abc\n",
                  "<recipe>:6: steps[0].compress.top_k: expects a count (64) or a fraction of the context (0.25 or 1/4), got 'abc'"),
    "duplicate key": ("model: m\nmodel: n\noutput: o\n", "<recipe>:2: key 'model' appears twice"),
    "teacher after surgery": ("model: m\noutput: o\nsteps:\n  - convert: {}\n  - heal: {teacher: t}\n",
                              "the source model is the teacher"),
    "heal on eval text": ("model: m\noutput: o\nsteps:\n  - convert: {}\n  - heal: {data: {dataset: wiki-sample, part: eval}}\n",
                          "<recipe>:5: steps[1].heal.data: healing reads a dataset's calibration part"),
    "missing model": ("output: o\nsteps:\n  - convert: {kv_budget: 0.5}\n", "<recipe>:1: model: required key is missing"),
    "unknown step": ("model: m\noutput: o\nsteps:\n  - surgery: {}\n", "<recipe>:4: steps[0]: a step is a mapping"),
    "nested unknown key": ("model: m\noutput: o\nsteps:\n  - heal:\n      teacher: t\n      tokenz: 5\n",
                           "<recipe>:6: steps[0].heal.tokenz: unknown key"),
    "two surgeries": ("model: m\noutput: o\nsteps:\n  - convert: {}\n  - compress: {method: cp}\n", "at most one convert or compress"),
    "heal first": ("model: m\noutput: o\nsteps:\n  - heal: {}\n  - convert: {}\n", "comes first"),
    "refinement beyond calibration": ("model: m\noutput: o\nsteps:\n  - convert: {refine_tokens: 8192}\n",
                                      "refinement reads 8192 tokens (refine_tokens, --refine-tokens) but calibration has 4096"),
    "explicit refinement tokens beyond calibration": (
        "model: m\noutput: o\nsteps:\n  - convert: {refine_tokens: 2048}\ncalibration: {tokens: 1024}\n",
        "refinement reads 2048 tokens (refine_tokens, --refine-tokens) but calibration has 1024"),
    "budget above one": ("model: m\noutput: o\nsteps:\n  - convert:\n      kv_budget: 1.7\n",
                         "<recipe>:5: steps[0].convert.kv_budget: Input should be less than or equal to 1"),
    "ratio zero": ("model: m\noutput: o\nsteps:\n  - compress: {method: svd, ratio: 0}\n",
                   "<recipe>:4: steps[0].compress.ratio: Input should be greater than 0"),
    "short prompts share": ("model: m\noutput: o\nsteps:\n  - convert: {short_prompts: 1.0}\n",
                            "steps[0].convert.short_prompts: Input should be less than 1"),
    "unknown dataset": ("model: m\noutput: o\nsteps:\n  - convert: {}\ncalibration:\n  data: {dataset: wikki-sample}\n",
                        "<recipe>:6: calibration.data.dataset: unknown dataset 'wikki-sample'; did you mean 'wiki-sample'?"),
    "missing text file": ("model: m\noutput: o\nsteps:\n  - convert: {}\ncalibration:\n  data: {text: /no/such.txt}\n",
                          "calibration.data.text: text file '/no/such.txt' does not exist"),
    "not yaml": ("model: m\noutput: [\n", "not valid YAML"),
    "object tag": ("model: !!python/object/apply:os.system ['echo hi']\noutput: o\nsteps:\n  - convert: {}\n",
                   "<recipe>:1: not valid YAML (could not determine a constructor"),
    "not a mapping": ("- a\n- b\n", "a recipe is a YAML mapping"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipes_name_the_field_and_line(case):
    text, expected = BAD[case]
    with pytest.raises(UserError) as info:
        parse_recipe(text)
    assert expected in str(info.value)


def test_validate_command_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD["unknown key"][0])
    result = CliRunner().invoke(app, ["recipe", "validate", str(path)])
    assert result.exit_code == 2
    assert f"{path}:6: steps[0].compress.ratoi: unknown key" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_list_shows_the_shipped_recipes():
    result = CliRunner().invoke(app, ["recipe", "list", "--json"])
    assert result.exit_code == 0
    assert REQUIRED_SHIPPED <= {row["name"] for row in yaml.safe_load(result.output)}


def test_mla_refines_on_the_first_half_of_its_calibration_unless_told():
    recipe = surgery_recipe("m", "o", ConvertStep(convert=MLASettings()), None, None, 0, [], 0)
    settings = recipe.surgery
    assert recipe.calibration.tokens == MLA_CALIBRATION_TOKENS == 6144
    assert refinement_of(settings, recipe.calibration).tokens == 3072  # 6 windows of 512: one of each built-in domain
    assert refinement_of(settings, Calibration(tokens=4096)).tokens == 2048
    assert refinement_of(settings.model_copy(update={"refine_tokens": 1024}), recipe.calibration).tokens == 1024


def test_convert_command_calibrates_on_the_mla_default(tiny_checkpoints, tmp_path):
    argv = ["convert", str(tiny_checkpoints["llama-gqa"]), "--to", "mla", "-o", str(tmp_path / "o")]
    result = CliRunner().invoke(app, argv + ["--dry-run", "--print-recipe"])
    assert result.exit_code == 0, result.output
    assert parse_recipe(result.output).calibration.tokens == MLA_CALIBRATION_TOKENS


@pytest.mark.parametrize(
    "args",
    [
        ["compress", "{model}", "--method", "tucker", "--ratio", "0.5", "--calib-tokens", "512"],
        ["compress", "{model}", "--method", "svdllm", "--targets", "k,v", "--kv-latent", "--ratio", "0.5", "--allocate"],
        ["compress", "{model}", "--method", "loki", "--rank", "8", "--top-k", "1/4", "--seed", "3"],
        ["convert", "{model}", "--to", "mla", "--kv-budget", "0.5", "--refine-steps", "3", "--refine-schedule", "cosine",
         "--calib-seq-len", "256"],
    ],
    ids=["tucker", "svdllm", "loki", "mla"],
)
def test_print_recipe_runs_the_same_as_the_command(args, tiny_checkpoints, tmp_path):
    """`--dry-run --print-recipe` prints a recipe; running that recipe plans exactly what the flags plan."""
    model = str(tiny_checkpoints["llama-gqa"])
    argv = [a.replace("{model}", model) for a in args] + ["-o", str(tmp_path / "out")]
    runner = CliRunner()
    printed = runner.invoke(app, argv + ["--dry-run", "--print-recipe"])
    assert printed.exit_code == 0, printed.output
    recipe = parse_recipe(printed.output)
    assert recipe.model.ref == model and recipe.output == tmp_path / "out"
    if "--refine-schedule" in args:
        assert recipe.surgery.refine_schedule == "cosine" and recipe.calibration.seq_len == 256
    path = tmp_path / "r.yaml"
    path.write_text(printed.output)
    by_flags = runner.invoke(app, argv + ["--dry-run", "--json"])
    by_recipe = runner.invoke(app, ["run", str(path), "--dry-run", "--json"])
    assert by_flags.exit_code == by_recipe.exit_code == 0
    assert by_flags.output == by_recipe.output


def run_twice(recipe_text: str, tmp_path: Path) -> tuple[Path, Path, str]:
    """Run a recipe, then the recipe its checkpoint carries; the two outputs and the first run's printout."""
    runner = CliRunner()
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe_text)
    first = runner.invoke(app, ["run", str(path)])
    assert first.exit_code == 0, first.output
    stored = tmp_path / "first" / "attnsurg_recipe.yaml"
    second = runner.invoke(app, ["run", str(stored), "-o", str(tmp_path / "second")])
    assert second.exit_code == 0, second.output
    return tmp_path / "first", tmp_path / "second", first.output


@pytest.mark.parametrize(
    "steps",
    [
        "  - compress: {method: svdllm, ratio: 0.5}\n",
        "  - convert: {to: mla, kv_budget: 0.5, refine_steps: 3}\n  - heal: {tokens: 256, seq_len: 32, batch_size: 2}\n",
    ],
    ids=["svdllm", "mla+heal"],
)
def test_a_checkpoint_recipe_reproduces_it_bit_for_bit(steps, tiny_checkpoints, corpus_file, tmp_path):
    recipe = (
        f"model: {tiny_checkpoints['llama-gqa']}\noutput: {tmp_path / 'first'}\nsteps:\n{steps}"
        f"calibration:\n  data: {{text: {corpus_file}}}\n  tokens: 512\n  seq_len: 64\neval:\n  tokens: 128\n  domains: []\nseed: 5\n"
    ).replace("- heal: {", f"- heal: {{data: {{text: {corpus_file}}}, ")
    first, second, printed = run_twice(recipe, tmp_path)
    for name in ("model.safetensors", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    stored = load_recipe(first / "attnsurg_recipe.yaml")
    assert stored.seed == 5 and stored.output == first
    if "heal" in steps:  # the printout and the card also give the ppl between the surgery and healing
        assert "after the surgery" in printed and "after healing" in printed
        assert "ppl after the surgery, before healing" in (first / "README.md").read_text()


def test_a_recipe_cannot_grant_itself_remote_code(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {ref: some/model, trust_remote_code: true}\noutput: o\nsteps:\n  - compress: {method: cp, rank: 4}\n")
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and "pass --trust-remote-code" in result.output


def test_validate_checks_every_file_and_fails_when_any_does(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\noutput: o\nsteps:\n  - convert:\n      kv_budget: 1.7\n")
    result = CliRunner().invoke(app, ["recipe", "validate", str(bad), "mla-50", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2
    assert f"{bad}:5: steps[0].convert.kv_budget: Input should be less than or equal to 1" in result.stderr
    assert "missing.yaml' is not a file" in result.stderr and "mla-50.yaml: ok" in result.stdout


def test_a_binary_recipe_file_is_one_line(tmp_path):
    path = tmp_path / "noise.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    result = CliRunner().invoke(app, ["recipe", "validate", str(path)])
    assert result.exit_code == 2 and "not UTF-8 text" in result.output and "Traceback" not in result.output


def test_validate_checks_what_a_dry_run_checks_when_the_model_is_here(tiny_checkpoints, tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(f"model: {tiny_checkpoints['llama-gqa']}\noutput: out\nsteps:\n  - convert: {{kv_budget: 0.5}}\n"
                    "calibration: {tokens: 32, seq_len: 64}\n")
    result = CliRunner().invoke(app, ["recipe", "validate", str(path)])
    assert result.exit_code == 2 and f"{path}: calibration seq_len (--calib-seq-len) 64" in result.output, result.output
    elsewhere = tmp_path / "hub.yaml"
    elsewhere.write_text("model: some-org/some-model\noutput: out\nsteps:\n  - convert: {kv_budget: 0.5}\n")
    assert CliRunner().invoke(app, ["recipe", "validate", str(elsewhere)]).exit_code == 0  # no fetch to validate


def test_a_recipe_writing_above_its_folder_is_refused_unless_o_says_where(tiny_checkpoints, tmp_path):
    runner = CliRunner()
    climbing = tmp_path / "climbing.yaml"
    climbing.write_text(f"model: {tiny_checkpoints['llama-gqa']}\noutput: runs/../../escape\nsteps:\n  - convert: {{}}\n")
    inside = tmp_path / "inside.yaml"
    inside.write_text(f"model: {tiny_checkpoints['llama-gqa']}\noutput: runs/../out\nsteps:\n  - convert: {{}}\n")
    refused = runner.invoke(app, ["recipe", "validate", str(climbing)])
    assert refused.exit_code == 2 and "climbs out of the working folder" in refused.output
    assert runner.invoke(app, ["recipe", "validate", str(inside)]).exit_code == 0
    rerouted = runner.invoke(app, ["run", str(climbing), "-o", str(tmp_path / "here"), "--dry-run"])
    assert rerouted.exit_code == 0, rerouted.output


def test_every_shipped_recipe_is_described_in_the_recipes_guide():
    guide = (Path(__file__).parent.parent / "docs" / "recipes.md").read_text()
    missing = [path.stem for path in shipped_recipes() if f"| `{path.stem}` |" not in guide]
    assert not missing, f"docs/recipes.md's table lacks {missing}"
