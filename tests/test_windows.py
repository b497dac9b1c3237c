import pytest

from attnsurg.eval.windows import count_words, plan_windows, scored_positions, scored_text


@pytest.mark.parametrize("num_tokens,max_length,stride", [(100, 10, 10), (105, 10, 10), (100, 10, 3), (57, 16, 5), (16, 16, 16)])
def test_every_token_after_the_first_is_scored_at_most_once(num_tokens, max_length, stride):
    windows = plan_windows(num_tokens, max_length, stride)
    positions = scored_positions(windows)
    assert len(positions) == len(set(positions))
    assert all(w.length <= max_length and w.begin < w.score_from for w in windows)
    if stride < max_length:  # sliding windows score every token but the very first
        assert positions == list(range(1, num_tokens))


def test_disjoint_windows_leave_each_window_start_as_context():
    windows = plan_windows(4096, 1024, 1024)
    assert [(w.begin, w.end, w.score_from) for w in windows] == [(i, i + 1024, i + 1) for i in range(0, 4096, 1024)]
    assert sum(w.scored for w in windows) == 4 * 1023


def test_trailing_partial_window_is_kept():
    windows = plan_windows(25, 10, 10)
    assert windows[-1].begin == 20 and windows[-1].end == 25 and windows[-1].scored == 4


def test_strided_window_scores_only_new_tokens():
    windows = plan_windows(20, 8, 4)
    assert windows[1].begin == 4 and windows[1].score_from == 8 and windows[1].end == 12


def test_scored_text_joins_contiguous_runs_and_separates_gaps():
    text = "aa bb cc dd"
    ends = [2, 5, 8, 11]  # tokens "aa", " bb", " cc", " dd"
    strided = plan_windows(4, 2, 1)
    assert scored_text(text, ends, strided) == " bb cc dd"
    disjoint = plan_windows(4, 2, 2)  # scores " bb" and " dd": a gap between them
    assert scored_text(text, ends, disjoint) == " bb  dd"
    assert count_words(scored_text(text, ends, disjoint)) == 2


def test_count_words_follows_lm_eval():
    assert count_words("  one two\nthree\t four ") == 4
    assert count_words("   ") == 0
