import pytest

from attnsurg.data import half_of, line_documents, load_text, read_text_file, wiki_documents
from attnsurg.errors import UserError

WIKI = "".join(f'<doc id="{i}" url="u" title="T{i}">\nTitle {i}\n\nBody of article {i}.\n</doc>\n' for i in range(6))


def test_wiki_tags_are_stripped():
    docs = wiki_documents(WIKI)
    assert len(docs) == 6 and docs[0] == "Title 0\n\nBody of article 0." and "<doc" not in "".join(docs)


def test_eval_and_calibration_parts_are_disjoint_halves():
    docs = line_documents("a\nb\n\nc\nd\ne\n")
    assert half_of(docs, "eval") == ["a", "b"] and half_of(docs, "calib") == ["c", "d", "e"]


def test_builtin_wiki_sample_is_split_by_document(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "wiki.utf8").write_text(WIKI, encoding="utf-8")
    evaluation = load_text("wiki-sample", None, "eval").text
    calibration = load_text("wiki-sample", None, "calib").text
    assert "article 0" in evaluation and "article 2" in evaluation and "article 3" not in evaluation
    assert "article 3" in calibration and "article 0" not in calibration


def test_text_file_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_text_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="is empty"):
        read_text_file(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        read_text_file(tmp_path / "latin1.txt")


def test_unknown_dataset_and_both_sources():
    with pytest.raises(UserError, match="unknown dataset"):
        load_text("penn-treebank", None, "eval")
    with pytest.raises(UserError, match="not both"):
        load_text("wiki-sample", "x.txt", "eval")


FAKE_DOMAIN_FILES = {
    "code.utf8": "".join(f"def f{i}():\n\n    return {i}\n\n\n" for i in range(10)),
    "technical.utf8": "".join(f"Section {i}. " + "x" * 1500 + "\n\n" for i in range(20)),
    "multilingual.utf8": "".join(f"Fable {i} in language {i % 3}.\n" for i in range(12)),
    "tiny.utf8": "".join(f"Story {i}: Lily went home.\nShe slept.\n<|endoftext|>\n\n" for i in range(9)),
}


@pytest.mark.parametrize("name", ["code-sample", "technical-sample", "multilingual-sample", "stories-sample"])
def test_domains_split_into_disjoint_halves_of_whole_documents(tmp_path, monkeypatch, name):
    from attnsurg.data import DOMAINS, domain_documents

    monkeypatch.setenv("ATTNSURG_CACHE", str(tmp_path))
    (tmp_path / "text").mkdir()
    for filename, content in FAKE_DOMAIN_FILES.items():
        (tmp_path / "text" / filename).write_text(content, encoding="utf-8")
    documents = domain_documents(DOMAINS[name])
    evaluation, calibration = half_of(documents, "eval"), half_of(documents, "calib")
    assert len(documents) >= 4 and not set(evaluation) & set(calibration)
    assert sorted(evaluation + calibration) == sorted(documents)
    assert load_text(name, None, "eval").text == "\n\n".join(evaluation)
    assert "<|endoftext|>" not in "".join(documents)
    if name == "code-sample":  # single blank lines stay inside a file
        assert "def f0():\n\n    return 0" in documents
    if DOMAINS[name].shuffled:  # a fixed order, not the file's
        assert domain_documents(DOMAINS[name]) == documents


def test_dataset_lists_expand_all_and_suggest_close_names():
    from attnsurg.data import DOMAINS, parse_datasets

    assert parse_datasets("wiki-sample,code-sample") == ["wiki-sample", "code-sample"]
    assert parse_datasets("all") == list(DOMAINS) and len(DOMAINS) == 6
    with pytest.raises(UserError, match="did you mean 'code-sample'"):
        parse_datasets("wiki-sample,code")
