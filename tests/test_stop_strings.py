"""Stop strings on streamed text, against a brute-force reference over whole strings."""

import random

import pytest

from sparkd.engine.stop_strings import StopStringMatcher


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    """(final text, stop string) by scanning prefixes: the first prefix that ends
    with a stop string decides; the longest such stop string wins."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            match = max(ending, key=len)
            return (text[:end] if include else text[:end - len(match)]), match
    return text, None


def run(deltas: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str | None]:
    """Feed deltas; flush at the end when nothing matched -> (emitted pieces, stop)."""
    matcher = StopStringMatcher(stop, include)
    emitted = []
    for delta in deltas:
        text, match = matcher.feed(delta)
        emitted.append(text)
        if match is not None:
            return emitted, match
    emitted.append(matcher.flush())
    return emitted, None


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_match_across_token_boundaries_is_never_emitted():
    emitted, match = run(["Hello", " wo", "r", "ld", "!", " more"], ["world"])
    assert match == "world"
    assert "".join(emitted) == "Hello "
    assert not any("w" in piece for piece in emitted)


def test_partial_match_is_held_back_then_released():
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("Hello wor") == ("Hello ", None)
    assert matcher.feed("k") == ("work", None)
    assert matcher.feed(" in the wo") == (" in the ", None)
    assert matcher.flush() == "wo"


def test_include_stop_string_in_output():
    emitted, match = run(["a <", "/s", "> tail"], ["</s>"], include=True)
    assert (match, "".join(emitted)) == ("</s>", "a </s>")
    # Nothing needs holding back when the stop string is kept anyway.
    assert StopStringMatcher(["</s>"], include_in_output=True).feed("a </") == ("a </", None)


def test_the_stop_string_completing_first_wins():
    emitted, match = run(["xabc"], ["abc", "b"])
    assert (match, "".join(emitted)) == ("b", "xa")
    emitted, match = run(["xab", "cd"], ["bcd", "abc"])
    assert (match, "".join(emitted)) == ("abc", "x")


def test_unchecked_text_is_emitted_but_still_counts_as_context():
    matcher = StopStringMatcher(["abc"])
    assert matcher.feed_unchecked("abc a") == "abc a"  # min_tokens not reached: no match
    assert matcher.feed("bc!") == ("", "abc")  # starts in the unchecked text, ends now


def test_no_stop_strings_passes_everything_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_any_split_gives_the_reference_result(include):
    rng = random.Random(0)
    for _ in range(600):
        alphabet = "ab c"
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        deltas = split(text, rng)
        emitted, match = run(deltas, stop, include)
        assert ("".join(emitted), match) == reference(text, stop, include), (text, stop, deltas)
        if not include:
            # Nothing emitted is ever taken back, and no stop string is ever shown.
            assert not any(s in "".join(emitted) for s in stop)
