"""OutputProcessor: the scheduler's per-sequence progress -> streamed RequestOutputs."""

import pytest

from sparkd.engine.output_processor import OutputProcessor
from sparkd.engine.outputs import TokenLogprob
from sparkd.engine.request import Request, RequestStatus
from sparkd.engine.sampling_params import SamplingParams

EOS = 256


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes (so a CJK char or emoji spans several tokens),
    id 256 is a special end-of-sequence token."""

    def decode(self, ids, skip_special_tokens=True):
        text = bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")
        return text if skip_special_tokens or EOS not in ids else text + "<eos>" * ids.count(EOS)


def encode(text: str) -> list[int]:
    return list(text.encode())


def add(processor, request_id="r", n=1, prompt="hi", **params):
    """Register a request the way the engine does -> its sequences."""
    sampling = SamplingParams(n=n, **params)
    sequences = [Request(request_id=request_id if n == 1 else f"{request_id}#{i}", prompt_token_ids=[1, 2],
                         sampling_params=sampling, seed=i, eos_token_ids=frozenset({EOS}),
                         group_id=request_id, sample_index=i) for i in range(n)]
    processor.add_request(request_id, prompt, [1, 2], sampling, sequences)
    return sequences


def append(seq, token, status=None, stop_reason=None, logprob=None):
    """What the scheduler does to a sequence in one step."""
    seq.output_token_ids.append(token)
    if logprob is not None:
        seq.output_logprobs.append(logprob)
    if status is not None:
        seq.status, seq.stop_reason = status, stop_reason
    return seq


def stream(processor, seq, tokens, last_status=RequestStatus.FINISHED_LENGTH, stop_reason=None):
    """Feed tokens one step at a time -> (outputs of every step, stops of every step)."""
    outputs, stops = [], []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        append(seq, token, last_status if last else None, stop_reason if last else None)
        out, stopped, _ = processor.process([seq])
        outputs.append(out)
        stops.append(stopped)
    return outputs, stops


def test_streams_utf8_deltas_and_finishes_by_length():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, max_tokens=20)
    text = "Hi 今天 😀!"
    outputs, stops = stream(processor, seq, encode(text))
    deltas = [out[0].outputs[0].text_delta for out in outputs]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert all(out[0].outputs[0].num_new_tokens == 1 for out in outputs)
    final = outputs[-1][0]
    assert final.finished and final.request_id == "r" and final.prompt == "hi" and final.prompt_token_ids == [1, 2]
    completion = final.outputs[0]
    assert (completion.text, completion.token_ids, completion.finish_reason) == (text, encode(text), "length")
    assert not any(outputs[i][0].finished for i in range(len(outputs) - 1))
    assert stops == [[]] * len(outputs)
    assert processor.process([append(seq, 65)]) == ([], [], [])  # forgotten once finished
    assert not processor.has_unfinished()


def test_snapshots_do_not_change_after_later_steps():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor)
    outputs, _ = stream(processor, seq, encode("abc"))
    first = outputs[0][0].outputs[0]
    assert (first.text, first.token_ids, first.text_delta) == ("a", [97], "a")


def test_stop_string_across_tokens_is_held_back_and_reported():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, stop=["STOP"])
    outputs, stops = stream(processor, seq, encode("ok STOP more"), last_status=None)
    deltas = [out[0].outputs[0].text_delta if out else None for out in outputs]
    assert deltas[:7] == ["o", "k", " ", "", "", "", ""]  # "STO" held back until "P" decides
    assert stops[6] == [("r", "STOP")]
    final = outputs[6][0]
    assert final.finished
    completion = final.outputs[0]
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("ok ", "stop", "STOP")
    assert outputs[7:] == [[]] * 5  # the engine finishes it; late tokens are ignored


def test_stop_strings_wait_for_min_tokens():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, stop=["ab"], min_tokens=4)
    outputs, stops = stream(processor, seq, encode("abxabyab"), last_status=None)
    assert [bool(s) for s in stops] == [False] * 4 + [True] + [False] * 3
    assert outputs[4][0].outputs[0].text == "abx"


def test_held_text_is_released_when_the_sequence_ends_otherwise():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, stop=["abc"])
    outputs, _ = stream(processor, seq, encode("xab"))
    assert [out[0].outputs[0].text_delta for out in outputs] == ["x", "", "ab"]
    assert outputs[-1][0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_dropped_unless_included(include):
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, stop_token_ids=[ord("!")], include_stop_str_in_output=include)
    outputs, _ = stream(processor, seq, encode("ok!"), RequestStatus.FINISHED_STOPPED, ord("!"))
    completion = outputs[-1][0].outputs[0]
    assert completion.text == ("ok!" if include else "ok")
    assert completion.token_ids == encode("ok!")
    assert (completion.finish_reason, completion.stop_reason) == ("stop", ord("!"))


def test_special_eos_is_skipped_or_shown():
    for skip, expected in ((True, "ok"), (False, "ok<eos>")):
        processor = OutputProcessor(ByteTokenizer())
        (seq,) = add(processor, skip_special_tokens=skip, include_stop_str_in_output=True)
        outputs, _ = stream(processor, seq, encode("ok") + [EOS], RequestStatus.FINISHED_STOPPED)
        assert outputs[-1][0].outputs[0].text == expected


def test_parallel_samples_share_one_output():
    processor = OutputProcessor(ByteTokenizer())
    first, second = add(processor, n=2, max_tokens=3)
    out, _, _ = processor.process([append(first, ord("a")), append(second, ord("x"))])
    assert len(out) == 1 and [c.text for c in out[0].outputs] == ["a", "x"]
    out, _, _ = processor.process([append(second, ord("y"))])
    first_out, second_out = out[0].outputs
    assert (first_out.index, first_out.text, first_out.text_delta, first_out.num_new_tokens) == (0, "a", "", 0)
    assert (second_out.index, second_out.text, second_out.text_delta, second_out.num_new_tokens) == (1, "xy", "y", 1)
    out, _, _ = processor.process([append(first, ord("b"), RequestStatus.FINISHED_STOPPED, "b")])
    assert not out[0].finished and out[0].outputs[0].finish_reason == "stop"
    out, _, _ = processor.process([append(second, ord("z"), RequestStatus.FINISHED_LENGTH)])
    assert out[0].finished and [c.finish_reason for c in out[0].outputs] == ["stop", "length"]
    assert [c.text for c in out[0].outputs] == ["ab", "xyz"]


def test_logprobs_accumulate_only_when_asked():
    processor = OutputProcessor(ByteTokenizer())
    (with_lp,) = add(processor, "a", logprobs=1)
    (without,) = add(processor, "b")
    lp = [TokenLogprob(ord("h"), -0.5, 1, {ord("h"): -0.5}), TokenLogprob(ord("i"), -1.5, 2, {ord("j"): -0.2})]
    processor.process([append(with_lp, ord("h"), logprob=lp[0]), append(without, ord("h"))])
    out, _, _ = processor.process([append(with_lp, ord("i"), logprob=lp[1]), append(without, ord("i"))])
    assert out[0].outputs[0].logprobs == lp
    assert out[1].outputs[0].logprobs is None


def test_without_a_tokenizer_text_stays_empty_and_stop_strings_are_refused():
    processor = OutputProcessor(None)
    (seq,) = add(processor, max_tokens=5)
    outputs, _ = stream(processor, seq, [5, 6, 7])
    assert (outputs[-1][0].outputs[0].text, outputs[-1][0].outputs[0].token_ids) == ("", [5, 6, 7])
    with pytest.raises(ValueError, match="stop"):
        add(processor, "other", stop=["x"])


def test_abort_and_fail_end_the_request():
    processor = OutputProcessor(ByteTokenizer())
    (seq,) = add(processor, "a")
    processor.process([append(seq, ord("h"))])
    aborted = processor.abort("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].text == "h"
    assert processor.process([append(seq, ord("i"))]) == ([], [], [])
    assert processor.abort("a") is None
    first, second = add(processor, "b", n=2)
    processor.process([append(first, ord("x"), RequestStatus.FINISHED_LENGTH)])
    failed = processor.fail("b", "boom")
    assert failed.error == "boom" and [c.finish_reason for c in failed.outputs] == ["length", "error"]
    assert not processor.has_unfinished()


def test_request_ids_must_be_unique():
    processor = OutputProcessor(ByteTokenizer())
    add(processor, "a")
    with pytest.raises(ValueError, match="request_id"):
        add(processor, "a")
