"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens) and for
SentencePiece (a leading space depends on the previous token), so each step decodes a short
window: the text of `tokens[prefix_offset:]` minus the text of `tokens[prefix_offset:
read_offset]` is the new text, held back while it ends in an incomplete character ("\ufffd").
The window starts with the last few prompt tokens for context, as vLLM's does.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.tokens = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, *, skip_text: bool = False, check_stop: bool = True) -> bool:
        """Appends a token; returns True when a stop string ended the text.

        `skip_text` leaves the token's text out (a stop token the user named); `check_stop`
        False looks for no stop string in the new text (the output is short of min_tokens)."""
        if skip_text:
            return False
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # nothing printable yet
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        old_len = len(self.text)
        self.text += delta
        return check_stop and self._check_stop(old_len)

    @property
    def stable_text(self) -> str:
        """The text that no stop string can take back any more: all of it but the last
        (longest stop string - 1) characters, which a stop string completed later would cut
        (vLLM's streaming holds them back the same way). With include_stop_str_in_output the
        text is never cut, so all of it."""
        if not self.stop or self.include_stop_str_in_output or self.stop_reason is not None:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: max(len(self.text) - hold, 0)]

    def flush(self, *, check_stop: bool = True) -> bool:
        """At the end of the output, adds text held back for an incomplete character (it
        will never complete: the bytes really are invalid UTF-8). Returns True when that text
        completes a stop string."""
        if self.stop_reason is not None:
            return False
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix):
            return False
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.tokens)
        return check_stop and self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> bool:
        """Truncates the text at the earliest stop string that the last delta completed."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # A new match must end inside the delta, so it starts after this point.
            idx = self.text.find(stop, max(old_len - len(stop) + 1, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        self.text = self.text[: idx + len(stop) if self.include_stop_str_in_output else idx]
        self.stop_reason = stop
        return True
