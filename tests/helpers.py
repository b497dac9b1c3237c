"""Helpers several test modules share: offline stand-ins for the built-in assets, calibration statistics and
held-out ids for tiny models, logit comparisons, the remote-code loading check, and the CLI's user-error check."""

from __future__ import annotations

import json

import torch

from attnsurg.arch.families import family_for_surgery
from attnsurg.calibrate import attention_layers, input_statistics
from attnsurg.io.load import load_model, resolve_source


def fake_assets(cache) -> None:
    """Tiny stand-ins for the built-in texts and the country table, so commands run offline."""
    text = cache / "text"
    text.mkdir(parents=True)
    paragraph = " ".join(["The keeper walked to the lighthouse by the sea and the lighthouse shone."] * 6)
    wiki = "".join(f'<doc id="{i}">\nTitle {i}\n\n{paragraph} At night he lit the lighthouse.\n</doc>\n' for i in range(8))
    (text / "wiki.utf8").write_text(wiki, encoding="utf-8")
    (text / "c4.utf8").write_text("\n".join(f"Web page {i} about gardens and tools." * 40 for i in range(6)), encoding="utf-8")
    (text / "code.utf8").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" * 30 + "\n\n\n" for i in range(6)))
    data = cache / "data"
    data.mkdir()
    countries = {iso: {"iso": iso, "name": name, "capital": cap, "continentcode": "EU", "population": 10**6}
                 for iso, name, cap in [("FR", "France", "Paris"), ("DE", "Germany", "Berlin"), ("IT", "Italy", "Rome"),
                                        ("ES", "Spain", "Madrid"), ("PT", "Portugal", "Lisbon")]}
    (data / "countries.json").write_text(json.dumps(countries), encoding="utf-8")


VOCAB = 384


def calibration(model, family: str, n: int = 4, length: int = 64, seed: int = 1):
    windows = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
    attns = attention_layers(model, family_for_surgery(family))
    stats = input_statistics(model, attns + [a.o_proj for a in attns], windows)
    return list(zip(stats[: len(attns)], stats[len(attns) :]))


def held_out(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logit_error(a, b, ids, reduce="max") -> float:
    diff = a(ids).logits - b(ids).logits
    return diff.abs().max().item() if reduce == "max" else diff.pow(2).mean().item()


REMOTE_LOAD = """
import sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert "attnsurg" not in sys.modules and type(model).__module__.startswith("transformers_modules")
ids = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    save_file({"logits": model(ids).logits.contiguous()}, sys.argv[3])
"""


def remote_code_matches_attnsurg(checkpoint, tmp_path) -> bool:
    """A separate interpreter without attnsurg loads ``checkpoint`` through its copied modeling file, and its
    logits on held-out ids equal those of attnsurg's own loader bit for bit."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    ours = load_model(resolve_source(str(checkpoint)))
    ids = held_out()
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", REMOTE_LOAD, str(checkpoint), str(tmp_path / "ids.pt"), str(tmp_path / "logits.safetensors")],
                   check=True, cwd=tmp_path, env={"HF_HOME": str(tmp_path / "hf"), "PATH": ""})
    with torch.no_grad():
        return torch.equal(load_file(tmp_path / "logits.safetensors")["logits"], ours(ids).logits)


def assert_user_error(result, *fragments: str) -> None:
    """Exit code 2, one error line naming the problem (after any progress messages), no traceback."""
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def streamed_and_loaded(args: list[str], output) -> tuple[dict, dict]:
    """A surgery command (its arguments with ``--json``) run with ``--stream`` and ``--no-stream`` into
    ``output / mode``: each mode's JSON record and written tensors; both runs must succeed and say how they ran."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from attnsurg.cli import app

    records, tensors = {}, {}
    for mode in ("--stream", "--no-stream"):
        result = CliRunner().invoke(app, [*args, mode, "-o", str(output / mode)])
        assert result.exit_code == 0, result.output
        records[mode] = json.loads(result.stdout)
        tensors[mode] = load_file(output / mode / "model.safetensors")
    assert records["--stream"]["streamed"] and not records["--no-stream"]["streamed"]
    return records, tensors
