"""Incremental detokenization with real BPE tokenizers trained here with `tokenizers`."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sparkd.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "机器学习是人工智能的一个分支。今天天气很好，我们去公园散步吧！",
    "日本語のテキストも少し入れます。東京は大きな都市です。",
    "한국어 문장도 있습니다. 안녕하세요!",
    "Emoji: 😀🎉🚀 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 hearts ❤️💙",
    "Café crème brûlée, naïve façade, déjà vu, Ångström, São Paulo, Tiếng Việt: Hà Nội, Đà Nẵng.",
    "Plain ASCII text with some words repeated: the quick brown fox jumps over the lazy dog.",
]
TEXTS = [
    "今天天气很好 😀🚀 Hà Nội déjà vu 👨‍👩‍👧",
    "東京は大きな都市です。안녕하세요! 🇫🇷🇯🇵 ❤️",
    "the lazy dog 机器学习 Ångström São Paulo 💙🎉",
    "全新的字符 🦀 ŷ ǆ are not in the training text",  # unseen chars: raw byte tokens only
]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


@pytest.fixture(scope="module")
def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Llama-3 / Qwen style: bytes mapped to chars, a small vocab so most
    CJK characters and emoji are split over several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return tokenizer


@pytest.fixture(scope="module")
def sentencepiece_bpe() -> Tokenizer:
    """Llama-2 style: "▁" for spaces, <0xXX> byte-fallback tokens for unseen
    characters, and the decoder strips the leading space of the first token."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer.train_from_iterator([CORPUS[4], CORPUS[5]] * 10, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def stream(tokenizer, ids, chunk_sizes=None, skip_special_tokens=True) -> list[str]:
    """Feed ids in chunks (one by one by default) -> deltas, the flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    sizes = iter(chunk_sizes or [])
    deltas, i = [], 0
    while i < len(ids):
        size = next(sizes, 1)
        deltas.append(detokenizer.feed(ids[i:i + size]))
        i += size
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_streaming_reassembles_the_text(byte_level_bpe, text):
    ids = byte_level_bpe.encode(text).ids
    assert any("\ufffd" in byte_level_bpe.decode([i]) for i in ids), "no token splits a character"
    deltas = stream(byte_level_bpe, ids)
    assert "".join(deltas) == text == byte_level_bpe.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # the last token completes the text; nothing waited for flush


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_streaming_keeps_spaces_and_bytes(sentencepiece_bpe, text):
    ids = sentencepiece_bpe.encode(text).ids
    deltas = stream(sentencepiece_bpe, ids)
    assert "".join(deltas) == sentencepiece_bpe.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # Decoding token by token would lose the spaces the decoder strips at the start.
    assert "".join(sentencepiece_bpe.decode([i]) for i in ids) != sentencepiece_bpe.decode(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_and_chunks_match_a_full_decode(byte_level_bpe, skip_special_tokens):
    # Random ids produce invalid UTF-8 and special tokens anywhere; the deltas must
    # still add up to exactly what a full decode shows, U+FFFD included.
    rng = random.Random(0)
    vocab_size = byte_level_bpe.get_vocab_size()
    for _ in range(40):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 60))]
        chunks = [rng.randint(1, 4) for _ in ids]
        deltas = stream(byte_level_bpe, ids, chunks, skip_special_tokens)
        assert "".join(deltas) == byte_level_bpe.decode(ids, skip_special_tokens=skip_special_tokens)


def test_special_tokens_are_skipped_or_kept(byte_level_bpe):
    eos = byte_level_bpe.token_to_id("<|endoftext|>")
    text_ids = byte_level_bpe.encode("今天 😀").ids
    ids = text_ids[:2] + [eos] + text_ids[2:] + [eos]
    assert "".join(stream(byte_level_bpe, ids)) == "今天 😀"
    assert "".join(stream(byte_level_bpe, ids, skip_special_tokens=False)) == \
        byte_level_bpe.decode(ids, skip_special_tokens=False)
    assert "<|endoftext|>" in byte_level_bpe.decode(ids, skip_special_tokens=False)


class CountingTokenizer:
    """Records how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_does_not_grow_with_the_output(byte_level_bpe):
    ids = byte_level_bpe.encode(" ".join(TEXTS * 40)).ids
    counting = CountingTokenizer(byte_level_bpe)
    assert "".join(stream(counting, ids)) == byte_level_bpe.decode(ids)
    assert len(ids) > 2000
    assert max(counting.window_sizes) <= 16  # longest character split plus its context
    assert sum(counting.window_sizes) <= 8 * len(ids)
