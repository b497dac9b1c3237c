"""The wheel `python -m build` makes holds every package, the shipped recipes, the license and the command."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = out.glob("attnsurg-*.whl")
    return zipfile.ZipFile(path)


def test_every_module_of_the_source_tree_is_in_the_wheel(wheel):
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "attnsurg").rglob("*.py")}
    assert modules <= set(wheel.namelist())


def test_the_shipped_recipes_install_as_package_data(wheel):
    recipes = {f"attnsurg/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    assert recipes and recipes <= set(wheel.namelist())


def test_the_metadata_names_the_license_and_the_entry_point(wheel):
    names = wheel.namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "attnsurg = attnsurg.cli:main" in wheel.read(entry_points).decode()
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    text = wheel.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text and "Requires-Dist: torch>=2.4" in text
