"""Streaming detokenizers: text that is always exactly ``decode(tokens)`` once
finalized, and never part of a UTF-8 character.

``ByteLevelDetokenizer`` works on byte-level BPE pieces (GPT-2 alphabet);
``DecodeDetokenizer`` re-decodes a window of tokens for other tokenizers.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["ByteLevelDetokenizer", "DecodeDetokenizer", "StreamingDetokenizer",
           "incomplete_utf8_tail", "token_bytes"]


# ---------------------------------------------------------------------------
# Byte-level alphabet (GPT-2): every byte is shown as one printable character.
# ---------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_level_char_to_byte() -> dict[str, int]:
    # Printable Latin-1 bytes keep their own character; the others (controls,
    # space, DEL, NBSP, soft hyphen ...) are shifted to U+0100 and upwards in
    # byte order.
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table: dict[str, int] = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


def token_bytes(token: str) -> bytes:
    """The bytes a ByteLevel decoder produces for one token string.

    A token made only of alphabet characters is mapped back byte by byte; any
    other token (an added token such as ``"\\n"`` or ``"x y"``) is taken as
    UTF-8 text, which is what the ``tokenizers`` ByteLevel decoder does.
    """
    table = _byte_level_char_to_byte()
    out = bytearray()
    for ch in token:
        b = table.get(ch)
        if b is None:
            return token.encode("utf-8")
        out.append(b)
    return bytes(out)


def incomplete_utf8_tail(buf: bytes | bytearray) -> int:
    """Number of trailing bytes that are the valid start of an unfinished character.

    Those bytes may still become a character when more bytes arrive, so a
    streaming decoder holds them back. Anything else (complete characters and
    invalid bytes) can be decoded now: a maximal invalid subpart never extends
    over a lead byte, so decoding in pieces cut here gives the same text as
    decoding the whole.
    """
    n = len(buf)
    for k in range(1, min(3, n) + 1):
        c = buf[n - k]
        if 0x80 <= c <= 0xBF:
            continue
        if 0xC2 <= c <= 0xDF:
            need = 2
        elif 0xE0 <= c <= 0xEF:
            need = 3
        elif 0xF0 <= c <= 0xF4:
            need = 4
        else:
            return 0
        if k >= need:
            return 0
        if k >= 2:
            second = buf[n - k + 1]
            if (
                (c == 0xE0 and second < 0xA0)
                or (c == 0xED and second > 0x9F)
                or (c == 0xF0 and second < 0x90)
                or (c == 0xF4 and second > 0x8F)
            ):
                return 0
        return k
    return 0


# ---------------------------------------------------------------------------
# Streaming detokenizers
# ---------------------------------------------------------------------------


class StreamingDetokenizer:
    """Interface: ``reset``, ``add_token``, ``finalize``, ``text``, ``tokens``, ``last_segment``.

    ``text`` is the text decoded so far (text that might still change is held
    back); ``last_segment`` is the text added since it was last read;
    after ``finalize()``, ``text == tokenizer.decode(tokens)``.
    """

    tokens: list[int]

    def reset(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def add_token(self, token: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def finalize(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def text(self) -> str:
        return self._text

    @property
    def last_segment(self) -> str:
        seg = self._segment
        self._segment = ""
        return seg

    def _emit(self, piece: str) -> None:
        if not piece:
            return
        if self._trim_pending:
            self._trim_pending = False
            if piece[0] == " ":
                piece = piece[1:]
                if not piece:
                    return
        self._text += piece
        self._segment += piece


class ByteLevelDetokenizer(StreamingDetokenizer):
    """Linear-time streaming decoder for byte-level BPE tokenizers.

    Keeps the bytes of an unfinished UTF-8 character pending until it is
    complete (or proven invalid), so no segment ever holds part of a character
    or a replacement character that the full decode would not have.

    ``trim_leading_space=True`` drops one space at the very start of the text,
    as mlx-lm's ``BPEStreamingDetokenizer`` does; the default gives exactly
    ``decode(tokens)``.
    """

    def __init__(
        self,
        token_bytes: list[bytes],
        special_ids: frozenset[int] = frozenset(),
        *,
        skip_special_tokens: bool = False,
        trim_leading_space: bool = False,
    ) -> None:
        self._token_bytes = token_bytes
        self._special_ids = special_ids
        self.skip_special_tokens = skip_special_tokens
        self.trim_leading_space = trim_leading_space
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self._pending = b""
        self._text = ""
        self._segment = ""
        self._trim_pending = self.trim_leading_space

    def add_token(self, token: int) -> None:
        token = int(token)
        self.tokens.append(token)
        if token < 0 or token >= len(self._token_bytes):
            return  # decode() ignores ids outside the vocabulary
        if self.skip_special_tokens and token in self._special_ids:
            return
        buf = self._pending + self._token_bytes[token]
        hold = incomplete_utf8_tail(buf)
        if hold:
            ready, self._pending = buf[:-hold], buf[-hold:]
        else:
            ready, self._pending = buf, b""
        if ready:
            self._emit(ready.decode("utf-8", "replace"))

    def finalize(self) -> None:
        if self._pending:
            self._emit(self._pending.decode("utf-8", "replace"))
            self._pending = b""


class DecodeDetokenizer(StreamingDetokenizer):
    """Fallback for tokenizers without a ByteLevel decoder (quadratic time).

    Re-decodes all tokens after each one and emits the new text, holding back
    trailing replacement characters until more tokens arrive.
    """

    def __init__(self, decode, *, skip_special_tokens: bool = False, trim_leading_space: bool = False):
        self._decode = decode
        self.skip_special_tokens = skip_special_tokens
        self.trim_leading_space = trim_leading_space
        self.reset()

    def reset(self) -> None:
        self.tokens = []
        self._text = ""
        self._segment = ""
        self._raw = ""
        self._trim_pending = self.trim_leading_space

    def _advance(self, final: bool) -> None:
        full = self._decode(self.tokens, skip_special_tokens=self.skip_special_tokens)
        stable = full if final else full.rstrip("\ufffd")
        if stable.startswith(self._raw) and len(stable) > len(self._raw):
            piece = stable[len(self._raw) :]
            self._raw = stable
            self._emit(piece)

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        self._advance(final=False)

    def finalize(self) -> None:
        self._advance(final=True)
