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
    assert set(rows) == {"smollm2-135m", "wiki-sample", "c4-sample", "code-sample", "technical-sample",
                         "multilingual-sample", "stories-sample", "geonames-countries"}
    assert rows["wiki-sample"]["cached"] == "not fetched"
    (tmp_path / "text").mkdir()
    Path(tmp_path / "text" / "wiki.utf8").write_text("x")
    assert assets.asset_table_rows()[1]["cached"].endswith("wiki.utf8")


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
