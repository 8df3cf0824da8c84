import pytest

from roofline.engine.stops import StopStringMatcher


def run(stop_strings, chunks):
    matcher = StopStringMatcher(stop_strings)
    emitted = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        emitted.append(text)
        if stopped:
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def test_stop_string_split_across_chunks():
    emitted, stopped = run(["STOP"], ["Hello S", "TO", "P and more"])
    assert stopped
    assert emitted == ["Hello ", "", ""]


def test_output_is_truncated_before_the_stop_string():
    emitted, stopped = run(["\n\n"], ["first line\n", "\nsecond"])
    assert stopped and "".join(emitted) == "first line"


def test_held_text_is_released_when_it_cannot_match():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans") == ("x ", False)
    assert matcher.feed("wer is 3") == ("</answer is 3", False)
    assert matcher.flush() == ""


def test_flush_returns_held_prefix_at_the_end():
    emitted, stopped = run(["<|stop|>"], ["abc<|st"])
    assert not stopped and emitted == ["abc", "<|st"]


def test_earliest_stop_string_wins():
    emitted, stopped = run(["world", "lo w"], ["hello wor", "ld"])
    assert stopped and "".join(emitted) == "hel"


def test_overlapping_candidates_keep_the_longest_possible_start():
    # "aab" must be found although "a" ... "aa" ... partial matches overlap.
    emitted, stopped = run(["aab"], ["xa", "a", "a", "b", "tail"])
    assert stopped and "".join(emitted) == "xa"


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7])
def test_any_chunking_gives_the_same_output(chunk_size):
    text = "The answer is 42. Observation: done. More text."
    chunks = [text[i:i + chunk_size] for i in range(0, len(text), chunk_size)]
    emitted, stopped = run(["Observation:", "never"], chunks)
    assert stopped and "".join(emitted) == "The answer is 42. "


def test_no_stop_strings_passes_everything_through():
    matcher = StopStringMatcher([""])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_after_a_stop_nothing_more_is_emitted():
    matcher = StopStringMatcher(["END"])
    assert matcher.feed("a END b") == ("a ", True)
    assert matcher.feed("more") == ("", True)
