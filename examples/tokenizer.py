#!/usr/bin/python3
"""Byte tokenizer for kvrope's examples: token id = byte value, vocabulary 256.

Text is encoded as UTF-8, one token per byte, so every string round-trips
exactly and a character offset maps to a token range by re-encoding the
prefix (`byte_span`). There are no special tokens: the example models have
vocab_size 256 and every id is a byte.
"""

VOCAB_SIZE = 256


def encode(text):
    """str (or bytes) -> list of int token ids in [0, 256)."""
    if isinstance(text, (bytes, bytearray)):
        return list(text)
    return list(text.encode("utf-8"))


def decode(ids, errors="replace"):
    """Token ids -> str. Invalid UTF-8 (e.g. a cut multi-byte character)
    becomes U+FFFD unless errors="strict"."""
    return decode_bytes(ids).decode("utf-8", errors=errors)


def decode_bytes(ids):
    """Token ids -> bytes, checking every id is a byte."""
    ids = [int(i) for i in ids]
    for i in ids:
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} is not a byte (vocab {VOCAB_SIZE})")
    return bytes(ids)


def byte_span(text, start, end):
    """Token range [a, b) covering characters text[start:end]."""
    a = len(text[:start].encode("utf-8"))
    b = a + len(text[start:end].encode("utf-8"))
    return a, b


class ByteTokenizer:
    """Object form of the functions above, for code that expects a tokenizer."""

    vocab_size = VOCAB_SIZE

    def encode(self, text):
        return encode(text)

    def decode(self, ids, errors="replace"):
        return decode(ids, errors)

    def byte_span(self, text, start, end):
        return byte_span(text, start, end)
