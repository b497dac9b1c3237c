import torch

from attnsurg.calibrate import calibration_windows
from attnsurg.pipeline import domain_texts, scored_text
from attnsurg.recipe import TextData

from test_cli import fake_assets


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
