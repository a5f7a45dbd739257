"""A reasoning model's thinking out of a chat completion's text, as the text grows
(`--reasoning-parser`, vLLM's names): `message.reasoning_content` apart from `content`, streamed
as `delta.reasoning_content` before the answer's deltas.

One `ReasoningStream` follows one choice's output. `update(text, final=...)` takes the whole
text so far (each call's text extends the last one's) and returns what it adds to the
reasoning and to the answer. A tag that may still be arriving ("</thi") is held back until the
next text tells; the final update lets it go. A non-streamed response runs the same machine
once over the whole text, so streamed deltas add up to exactly the non-streamed split,
whatever the chunking. The answer then goes to the tool call parser, if any: tool calls are
read from the answer only.

The parsers (the tags are `<think>` and `</think>`):
- `deepseek_r1`: everything before `</think>` is reasoning (a leading `<think>` dropped: the
  template usually opens the block in the prompt); with no `</think>` all of it is.
- `qwen3`: the output thinks if it starts with `<think>`, or if the prompt opened the block
  (a template that ends the generation prompt with `<think>`); it then reasons until
  `</think>`. Otherwise (thinking off: `chat_template_kwargs: {"enable_thinking": false}`
  closes the block inside the prompt) all of it is the answer.
- `openai_gptoss` (gpt-oss's harmony format, `harmony.py`): the analysis channel is the
  reasoning, the final and commentary channels the answer; a tool call's message goes to the
  answer as written, for the `openai` tool call parser. It reads the special tokens.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from server.harmony import MessageScanner

START, END = "<think>", "</think>"


@dataclasses.dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits one output's text into reasoning and answer as it grows (module docstring).
    `prompt_opens`: the prompt ends inside an open thinking block."""

    # Whether an output that does not open a block itself reasons from its first character.
    reasons_unopened: ClassVar[bool] = True
    # False: the parser reads special tokens, which the text must then keep.
    skip_special_tokens: ClassVar[bool] = True

    @classmethod
    def end_token_ids(cls, tokenizer) -> list[int] | None:
        """The tokens that end the thinking (what structured outputs wait for before they
        constrain), or None where they cannot be told: `</think>` where it is one token."""
        end = end_token_id(tokenizer)
        return None if end is None else [end]

    def __init__(self, *, prompt_opens: bool = False):
        # "start": not known yet whether it thinks; "reasoning"; "content".
        self.mode = "reasoning" if prompt_opens or self.reasons_unopened else "start"
        self.done = 0  # characters of the text already given out
        self.skip_start = True  # a leading <think> is the block's tag, not reasoning

    def update(self, text: str, *, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        while True:
            rest = text[self.done :]
            if self.mode == "start":
                if rest.startswith(START):
                    self.done += len(START)
                    self.mode, self.skip_start = "reasoning", False
                    continue
                if START.startswith(rest) and not final:
                    return out  # may still become <think>
                self.mode = "content"
                continue
            if self.mode == "content":
                out.content += rest
                self.done = len(text)
                return out
            # reasoning
            if self.skip_start:
                if rest.startswith(START):
                    self.done += len(START)
                    self.skip_start = False
                    continue
                if START.startswith(rest) and not final:
                    return out  # may still become <think>
                self.skip_start = False
            end = rest.find(END)
            if end >= 0:
                out.reasoning += rest[:end]
                self.done += end + len(END)
                self.mode = "content"
                continue
            keep = 0 if final else _held(rest, END)
            out.reasoning += rest[: len(rest) - keep]
            self.done = len(text) - keep
            return out


class DeepSeekR1ReasoningStream(ReasoningStream):
    reasons_unopened = True


class Qwen3ReasoningStream(ReasoningStream):
    reasons_unopened = False


class HarmonyReasoningStream(ReasoningStream):
    """`openai_gptoss`: analysis is reasoning; the rest is the answer, a tool call's message
    whole, header and end marker included (`harmony.py`)."""

    skip_special_tokens = False
    FINAL = "<|channel|>final<|message|>"  # the answer's header

    @classmethod
    def end_token_ids(cls, tokenizer) -> list[int] | None:
        return tokenizer.encode(cls.FINAL, add_special_tokens=False) or None

    def __init__(self, *, prompt_opens: bool = False):
        self.scanner = MessageScanner()

    def update(self, text: str, *, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        for p in self.scanner.update(text, final=final):
            if p.recipient is not None:  # a call: the tool call parser reads it as written
                out.content += (p.header or "") + p.body + (p.end or "")
            elif p.channel == "analysis":
                out.reasoning += p.body
            else:
                out.content += p.body
        return out


REASONING_PARSERS: dict[str, type[ReasoningStream]] = {
    "deepseek_r1": DeepSeekR1ReasoningStream,
    "qwen3": Qwen3ReasoningStream,
    "openai_gptoss": HarmonyReasoningStream,
}


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a thinking block it opened (its last `<think>`
    has no `</think>` after it)."""
    start = prompt_text.rfind(START)
    return start >= 0 and prompt_text.find(END, start) < 0


def prompt_closes_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends after a thinking block it opened and closed (thinking
    turned off by the template: `enable_thinking: false`)."""
    start = prompt_text.rfind(START)
    return start >= 0 and prompt_text.find(END, start) >= 0


def end_token_id(tokenizer) -> int | None:
    """The id of `</think>` where it is one token of the vocabulary (what structured outputs
    wait for before they constrain), else None."""
    ids = tokenizer.encode(END, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def split(stream: ReasoningStream, text: str) -> ReasoningDelta:
    """The reasoning and answer of a whole output (a fresh `stream` over all of `text`)."""
    return stream.update(text, final=True)
