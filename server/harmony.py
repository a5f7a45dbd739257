"""gpt-oss's harmony format, read from an output's text as it grows: the reasoning parser
`openai_gptoss` and the tool call parser `openai` (vLLM's names).

The model writes messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`. The
prompt ends with `<|start|>assistant`, so the first header starts at `<|channel|>`; later ones
at `<|start|>` (the role, and possibly ` to=RECIPIENT`). A header names its channel
(`analysis`: reasoning; `commentary`: tool calls, or a preamble to the user; `final`: the
answer) and may name a recipient (` to=functions.NAME`, a call whose body is its JSON
arguments) and a content type (` <|constrain|>json`). A body ends at `<|end|>`, or at
`<|call|>` / `<|return|>`, which stop the generation (and so are usually not in the text).
These markers are special tokens: both parsers ask for the text with special tokens kept.

`MessageScanner` cuts the text into messages as it grows, holding back what may be the start
of a marker. The two parsers share it:
- `reasoning_parsers.HarmonyReasoningStream` (`openai_gptoss`): analysis bodies are reasoning, the final and
  commentary bodies the answer, and a message with a recipient (a tool call) goes to the
  answer whole, header and all, for the tool call parser to read;
- `tool_parsers.HarmonyToolCalls` (`openai`): a message to `functions.NAME` is a call of NAME whose
  arguments stream as its body arrives; other bodies are content (the header of a call to a
  built-in tool too: only `functions.` calls are the client's).
Text outside any message (a model that writes no header) is content.
"""

from __future__ import annotations

import dataclasses
import re

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."  # the recipient prefix of the client's tools


@dataclasses.dataclass
class Piece:
    """What one update adds to one message: `header` (its raw text) on the update where the
    message's body starts, body text, and `end` (its raw end marker) on the one it ends."""

    channel: str | None
    recipient: str | None
    header: str | None = None
    body: str = ""
    end: str | None = None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class MessageScanner:
    """Cuts an output's text into harmony messages as it grows (module docstring)."""

    def __init__(self) -> None:
        self.done = 0  # characters of the text handled
        self.channel: str | None = None  # the open message's, while in a body
        self.recipient: str | None = None
        self.in_body = False

    def update(self, text: str, *, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while self.done < len(text):
            rest = text[self.done :]
            if not self.in_body:
                if not rest.startswith((START, CHANNEL)):
                    if not final and (START.startswith(rest) or CHANNEL.startswith(rest)):
                        break  # may still become a header
                    # No header: text outside a message, up to the next header, is content.
                    stop = min((i for m in (START, CHANNEL) if (i := rest.find(m)) > 0), default=-1)
                    if stop < 0:
                        keep = 0 if final else _held(rest, (START, CHANNEL))
                        stop = len(rest) - keep
                        if stop == 0:
                            break
                    pieces.append(Piece(None, None, body=rest[:stop]))
                    self.done += stop
                    continue
                body = rest.find(MESSAGE)
                if body < 0:
                    if final:  # a header cut short: nothing to say
                        self.done = len(text)
                    break
                header = rest[: body + len(MESSAGE)]
                channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
                self.channel = re.split(r"[\s<]", channel, maxsplit=1)[0] or None
                found = _RECIPIENT.search(header)
                self.recipient = found.group(1) if found else None
                self.in_body = True
                self.done += len(header)
                pieces.append(Piece(self.channel, self.recipient, header=header))
                continue
            ends = [(i, m) for m in ENDS if (i := rest.find(m)) >= 0]
            if ends:
                i, marker = min(ends)
                pieces.append(Piece(self.channel, self.recipient, body=rest[:i], end=marker))
                self.done += i + len(marker)
                self.in_body = False
                continue
            keep = 0 if final else _held(rest, ENDS)
            if len(rest) > keep:
                pieces.append(Piece(self.channel, self.recipient, body=rest[: len(rest) - keep]))
                self.done += len(rest) - keep
            break
        return pieces
