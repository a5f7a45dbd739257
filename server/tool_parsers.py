"""Tool calls out of a chat completion's text, as the text grows.

One `ToolCallStream` follows one choice's output. `update(text, final=...)` takes the whole
text so far (each call's text extends the last one's) and returns what it adds: content, the
first delta of each new call (its tool-call index and name, with the arguments known so far),
and argument fragments of calls already announced. A non-streamed response runs the same
machine once over the whole text (`extract`), so streamed deltas concatenate (`assemble`) to
exactly the non-streamed content and calls, whatever the chunking.

The streams:
- `NamedToolCall`: `tool_choice` names a function; the output, constrained to its parameters
  schema, is the arguments.
- `RequiredToolCalls`: `tool_choice: "required"`; the output, constrained to
  `required_tool_calls_schema`, is a JSON array of `{"name", "parameters"}`. Scanned character
  by character: a call is announced once its name string is complete, and the raw text of its
  `parameters` value streams as its arguments.
- The parsers of `tool_choice: "auto"` (`TOOL_PARSERS`, `--tool-call-parser`), for models'
  own formats: `hermes`, `llama3_json`, `mistral`, `pythonic`, `qwen3_coder` and `openai`
  (gpt-oss's harmony messages, `harmony.py`). Their arguments are the call's JSON object
  re-serialized (`json.dumps(..., ensure_ascii=False)`, as vLLM does). Text that does not parse
  as a call stays content; when no call is found the content is the text unchanged.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import string
from collections.abc import Iterable
from typing import Any, ClassVar

from server.harmony import FUNCTIONS, MessageScanner

_WHITESPACE = " \t\n\r"


@dataclasses.dataclass
class ToolCallDelta:
    """What one update adds to one call: its first delta has the name (the client's id and
    type go with it), later ones only argument text."""

    index: int
    name: str | None = None
    arguments: str = ""
    id: str | None = None  # the call's id where the format has its own (with the name)


@dataclasses.dataclass
class Delta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str | None = None  # None: the server's own form


@dataclasses.dataclass
class Extracted:
    content: str
    tool_calls: list[ToolCall]


class ToolCallStream:
    """Splits one output's text into content and tool calls as it grows (see the module
    docstring). `skip_special_tokens` False asks the engine to keep special tokens in the
    text: some models' call markers are special tokens. `uses_tools`: the stream is made
    with the request's `tools` (to type arguments the model writes as text)."""

    skip_special_tokens: ClassVar[bool] = True
    uses_tools: ClassVar[bool] = False

    def update(self, text: str, *, final: bool) -> Delta:
        raise NotImplementedError


def assemble(deltas: Iterable[Delta]) -> Extracted:
    """The content and calls that a sequence of deltas adds up to."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.name is not None:
                assert d.index == len(calls), "calls are announced in index order"
                calls.append(ToolCall(d.name, "", d.id))
            calls[d.index].arguments += d.arguments
    return Extracted("".join(content), calls)


def extract(stream: ToolCallStream, text: str) -> Extracted:
    """The content and calls of a whole output (a fresh `stream` over all of `text`)."""
    return assemble([stream.update(text, final=True)])


def _loads(text: str) -> Any:
    """The JSON value of `text`; None if it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(obj: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed `{"name": ..., <argument key>: {...}}`; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None or not isinstance(obj[key], dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))


def _partial_suffix(text: str, start: int, marker: str) -> int:
    """The length of the longest end of `text[start:]` that `marker` starts with (a marker
    that may still be arriving)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - n :]):
            return n
    return 0


class _JsonScanner:
    """Where JSON text is, one character at a time: how deep in containers, and whether in a
    string."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self._escape = False

    def feed(self, c: str) -> None:
        if self.in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "[{":
            self.depth += 1
        elif c in "]}":
            self.depth -= 1


class NamedToolCall(ToolCallStream):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the whole output is the
    arguments of one call to that function."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sent: int | None = None

    def update(self, text: str, *, final: bool) -> Delta:
        if self._sent is None:
            self._sent = len(text)
            return Delta(tool_calls=[ToolCallDelta(0, self.name, text)])
        new, self._sent = text[self._sent :], len(text)
        return Delta(tool_calls=[ToolCallDelta(0, arguments=new)] if new else [])


def required_tool_calls_schema(tools: list[dict[str, Any]], *, parallel: bool) -> dict:
    """The JSON schema of `tool_choice: "required"` (vLLM's): an array of at least one
    (exactly one unless `parallel`) `{"name": <a tool's name>, "parameters": <its schema>}`.
    `tools` are OpenAI's tool dicts. The tools' `$defs` move to the root, where their
    `#/$defs/...` references point from inside the array."""
    defs: dict[str, Any] = {}
    alternatives = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or {"type": "object"})
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"tools define $defs/{name} in more than one way")
        alternatives.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclasses.dataclass
class _Item:
    """One object of the required array, as far as it has been read."""

    name: str | None = None
    args_start: int | None = None  # the raw `parameters` value: text[args_start:args_end]
    args_end: int | None = None
    index: int | None = None  # the tool-call index, once announced
    sent: int | None = None  # where the arguments not yet sent start


class RequiredToolCalls(ToolCallStream):
    """`tool_choice: "required"`: the output is a JSON array of `{"name", "parameters"}`
    objects (`required_tool_calls_schema`). Each call's arguments are the raw text of its
    `parameters` value, without the whitespace around it; they stream as the value arrives,
    once the call's name is complete. The text is read once, character by character, up to
    the end of the array (under ignore_eos, free text may follow it)."""

    def __init__(self) -> None:
        self._scanner = _JsonScanner()
        self._pos = 0  # characters read
        self._done = False  # the array is complete
        self._items: list[_Item] = []
        self._key: str | None = None  # the member of the current object being read
        self._key_start: int | None = None  # where the key string being read starts
        self._in_value = False  # between the member's ":" and its "," or "}"
        self._value_start: int | None = None
        self._num_calls = 0

    def update(self, text: str, *, final: bool) -> Delta:
        for i in range(self._pos, len(text)):
            if self._done:
                break
            self._read(text, i)
        self._pos = len(text)
        return Delta(tool_calls=self._announce(text))

    def _read(self, text: str, i: int) -> None:
        c = text[i]
        scanner = self._scanner
        depth, was_in_string = scanner.depth, scanner.in_string
        scanner.feed(c)
        if was_in_string:
            if self._in_value:
                self._mark(i)
            if not scanner.in_string and depth == 2 and self._items:  # a member's string ended
                if self._in_value and self._key == "name":
                    name = _loads(text[self._value_start : i + 1])
                    self._items[-1].name = name if isinstance(name, str) else None
                elif not self._in_value:
                    self._key = _loads(text[self._key_start : i + 1])
            return
        if c in _WHITESPACE:
            return
        self._done = depth == 1 and scanner.depth == 0
        if depth == 2 and c in ",}":  # a member of the call object ends
            self._in_value, self._key = False, None
        elif depth == 2 and c == ":":
            self._in_value, self._value_start = True, None
        elif depth == 1 and c == "{":
            self._items.append(_Item())
        elif self._in_value:
            self._mark(i)
        elif depth == 2 and c == '"':
            self._key_start = i

    def _mark(self, i: int) -> None:
        """Character i is part of the current member's value."""
        if self._value_start is None:
            self._value_start = i
        if self._key == "parameters" and self._items:
            item = self._items[-1]
            if item.args_start is None or item.args_start == self._value_start:
                item.args_start, item.args_end = self._value_start, i + 1

    def _announce(self, text: str) -> list[ToolCallDelta]:
        out = []
        for item in self._items:
            if item.name is None:
                continue
            start = item.args_start if item.sent is None else item.sent
            arguments = "" if start is None else text[start : item.args_end]
            if item.index is None:
                item.index, self._num_calls = self._num_calls, self._num_calls + 1
                out.append(ToolCallDelta(item.index, item.name, arguments))
            elif arguments:
                out.append(ToolCallDelta(item.index, arguments=arguments))
            if start is not None:
                item.sent = item.args_end
        return out


class HermesToolCalls(ToolCallStream):
    """Hermes' format (also Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>` blocks. A block streams as one call once it closes; at the end, an unclosed
    last block counts if its JSON is complete (as in vLLM). A block that is not a call stays
    content, as does the text outside blocks, except whitespace between and after calls."""

    START, END = "<tool_call>", "</tool_call>"
    skip_special_tokens = False  # <tool_call> is a special token in some models (vLLM's)

    def __init__(self) -> None:
        self._pos = 0  # text before this is handled
        self._block: int | None = None  # where the open block's START is
        self._held: str | None = None  # whitespace after a call, dropped unless text follows
        self._num_calls = 0

    def update(self, text: str, *, final: bool) -> Delta:
        out = Delta()
        while True:
            if self._block is None:
                start = text.find(self.START, self._pos)
                if start < 0:
                    end = len(text)
                    if not final:  # hold back what may be the beginning of a START
                        end -= _partial_suffix(text, self._pos, self.START)
                    self._outside(out, text[self._pos : end])
                    self._pos = end
                    break
                self._outside(out, text[self._pos : start])
                self._block, self._pos = start, start + len(self.START)
                continue
            end = text.find(self.END, self._pos)
            if end < 0 and not final:
                # Not closed yet: search on from where a new END could begin.
                self._pos = max(self._pos, len(text) - len(self.END) + 1)
                break
            body_start = self._block + len(self.START)
            body = text[body_start:end] if end >= 0 else text[body_start:]
            stop = end + len(self.END) if end >= 0 else len(text)
            call = self._parse(body)
            if call is None:
                self._outside(out, text[self._block : stop])
            else:
                out.tool_calls.append(ToolCallDelta(self._num_calls, call.name, call.arguments))
                self._num_calls += 1
                self._held = ""
            self._block, self._pos = None, stop
            if end < 0:
                break
        return out

    def _parse(self, body: str) -> ToolCall | None:
        """The call a block holds, or None if it is not one."""
        return _call(_loads(body), ("arguments",))

    def _outside(self, out: Delta, text: str) -> None:
        """Text outside the blocks (or a block that is not a call): content."""
        if self._held is not None:
            if not text.strip(_WHITESPACE):
                self._held += text
                return
            text, self._held = self._held + text, None
        out.content += text


class Llama3JsonToolCalls(ToolCallStream):
    """Llama 3's JSON format: the output is `{"name": ..., "parameters": {...}}` objects
    ("arguments" is taken too), separated by ";" and whitespace, possibly after
    `<|python_tag|>`. Each object streams as one call once it is complete. An output that does
    not start so is content; so is everything from the first object that is not a call."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._state = "start"  # then "calls" or "content"
        self._pos = 0  # text before this is handled (sent as content or read as calls)
        self._content_from = 0  # where content starts if the calls end
        self._scanner = _JsonScanner()
        self._object: int | None = None  # where the object being read starts
        self._num_calls = 0

    def update(self, text: str, *, final: bool) -> Delta:
        out = Delta()
        if self._state == "start":
            self._start(text, final)
        if self._state == "calls":
            self._read_calls(text, out)
            if final and (self._object is not None or not self._num_calls):
                # An object cut short is content; with no call at all, the whole text is.
                self._state, self._pos = "content", self._content_from
        if self._state == "content" or (final and self._state == "start"):
            out.content += text[self._pos :]
            self._pos = len(text)
        return out

    def _start(self, text: str, final: bool) -> None:
        """Decides from the first characters past whitespace whether calls follow."""
        rest = text[self._pos :].lstrip(_WHITESPACE)
        if rest.startswith(self.TAG):
            self._state, self._pos = "calls", len(text) - len(rest) + len(self.TAG)
        elif rest.startswith("{"):
            self._state, self._pos = "calls", len(text) - len(rest)
        elif rest and not (self.TAG.startswith(rest) and not final):
            self._state = "content"

    def _read_calls(self, text: str, out: Delta) -> None:
        scanner = self._scanner
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._object is None:  # between objects
                if c in _WHITESPACE or c == ";":
                    continue
                if c != "{":
                    self._state, self._pos = "content", self._content_from
                    return
                self._object = i
            scanner.feed(c)
            if scanner.depth == 0:
                call = _call(_loads(text[self._object : i + 1]), ("parameters", "arguments"))
                if call is None:
                    self._state, self._pos = "content", self._content_from
                    return
                out.tool_calls.append(ToolCallDelta(self._num_calls, call.name, call.arguments))
                self._num_calls += 1
                self._object, self._content_from = None, i + 1
        self._pos = len(text)


class Qwen3CoderToolCalls(HermesToolCalls):
    """Qwen3-Coder's XML-like format: `<tool_call><function=NAME><parameter=KEY>VALUE
    </parameter>...</function></tool_call>`, each value on lines of its own. A value is text,
    typed by the tool's parameters schema as vLLM types it (string as is; integer, number,
    boolean; object and array as JSON; `null` is null; a parameter the schema does not know
    stays text). Blocks stream as hermes' do."""

    uses_tools = True
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._schemas = {
            t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties") or {}
            for t in tools or []
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
        }

    def _parse(self, body: str) -> ToolCall | None:
        m = self._FUNCTION.search(body)
        if m is None or body[: m.start()].strip(_WHITESPACE) or body[m.end() :].strip(_WHITESPACE):
            return None
        name = m.group(1).strip()
        schema = self._schemas.get(name, {})
        arguments = {}
        for p in self._PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            value = p.group(2).removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed(value, (schema.get(key) or {}).get("type"))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as its schema's type says (vLLM's rules for Qwen3-Coder)."""
    if value.strip().lower() == "null":
        return None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    try:
        if kind in ("integer", "int"):
            return int(value.strip())
        if kind in ("number", "float"):
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value else number
        if kind in ("boolean", "bool"):
            return value.strip().lower() == "true"
        if kind in ("object", "array", "dict", "list"):
            return json.loads(value)
    except ValueError:
        pass
    return value


class PythonicToolCalls(ToolCallStream):
    """Llama 3.2 and 4's pythonic format: the output starts with a Python list of calls with
    literal keyword arguments, `[get_weather(city="Paris", days=3), now()]` (Llama 4 may wrap
    it in `<|python_start|>` ... `<|python_end|>`). The calls stream together once the list
    closes; text after it (past the closing tag) is content, sent at the end. An output that
    does not start so, or whose list is not such calls, is content."""

    skip_special_tokens = False  # Llama 4's <|python_start|> (vLLM's)
    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self) -> None:
        self._state = "start"  # then "list", then "after" (the calls read) or "content"
        self._pos = 0
        self._list = 0  # where the list starts

    def update(self, text: str, *, final: bool) -> Delta:
        out = Delta()
        if self._state == "start":
            rest = text.lstrip(_WHITESPACE)
            body = rest.removeprefix(self.START).lstrip(_WHITESPACE)
            if body.startswith("["):
                self._state, self._list = "list", len(text) - len(body)
            elif not final and (
                self.START.startswith(rest) or (rest.startswith(self.START) and not body)
            ):
                return out  # a list may still open
            else:
                self._state = "content"
        if self._state == "list":
            end = _python_list_end(text, self._list)
            if end is None and not final:
                return out
            calls = None if end is None else _python_calls(text[self._list : end])
            if calls is None:
                self._state = "content"
            else:
                out.tool_calls = [
                    ToolCallDelta(i, c.name, c.arguments) for i, c in enumerate(calls)
                ]
                self._state, self._pos = "after", end
        if self._state == "after":  # text after the list: content, told at the end
            if final:
                tail = text[self._pos :].lstrip(_WHITESPACE).removeprefix(self.END)
                out.content += tail if tail.strip(_WHITESPACE) else ""
            return out
        if self._state == "content":
            out.content += text[self._pos :]
            self._pos = len(text)
        return out


def _python_list_end(text: str, start: int) -> int | None:
    """Where the Python list at `text[start]` closes (one past its "]"), or None."""
    depth, quote, escape = 0, None, False
    for i in range(start, len(text)):
        c = text[i]
        if quote is not None:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _python_calls(source: str) -> list[ToolCall] | None:
    """The calls of a pythonic list (`[f(a=1), g()]`), or None if it is not one."""
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func) if isinstance(node.func, ast.Name | ast.Attribute) else None
        if name is None or any(k.arg is None for k in node.keywords):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            text = json.dumps(arguments, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append(ToolCall(name, text))
    return calls


class MistralToolCalls(ToolCallStream):
    """Mistral's format: content, then `[TOOL_CALLS]` and the calls, either a JSON array of
    `{"name", "arguments"}` (its v3 tokenizer: Mistral 7B v0.3, Mixtral 8x22B) or
    `name[ARGS]{...}` per call, each after its own `[TOOL_CALLS]` (v11 and later: Mistral
    Small 3.2, Devstral). The calls are read when the output ends; if they do not parse, the
    text from `[TOOL_CALLS]` on is content. Call ids are 9 letters and digits, the only form
    Mistral's chat templates take back (vLLM's rule)."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def __init__(self) -> None:
        self._pos = 0  # content before this is sent
        self._tag: int | None = None  # where the calls start

    def update(self, text: str, *, final: bool) -> Delta:
        out = Delta()
        if self._tag is None:
            tag = text.find(self.TAG, self._pos)
            end = tag if tag >= 0 else len(text)
            if tag < 0 and not final:
                end -= _partial_suffix(text, self._pos, self.TAG)
            out.content, self._pos = text[self._pos : end], end
            if tag >= 0:
                self._tag = tag
        if self._tag is not None and final:
            calls = self._calls(text[self._tag :])
            if calls is None:
                out.content += text[self._tag :]
            else:
                out.tool_calls = [
                    ToolCallDelta(i, c.name, c.arguments, _mistral_id())
                    for i, c in enumerate(calls)
                ]
        return out

    def _calls(self, text: str) -> list[ToolCall] | None:
        body = text.removeprefix(self.TAG).strip(_WHITESPACE)
        if body.startswith("["):  # the JSON array
            items = _loads(body)
            if not isinstance(items, list) or not items:
                return None
            calls = [_call(_arguments_object(i), ("arguments",)) for i in items]
            return None if None in calls else calls
        calls = []
        for part in text.split(self.TAG)[1:]:
            name, sep, arguments = part.partition(self.ARGS)
            value = _loads(arguments.strip(_WHITESPACE))
            if not sep or not name.strip() or not isinstance(value, dict):
                return None
            calls.append(ToolCall(name.strip(), json.dumps(value, ensure_ascii=False)))
        return calls or None


def _arguments_object(item: Any) -> Any:
    """A Mistral call whose arguments came as a JSON string, with them parsed."""
    if isinstance(item, dict) and isinstance(item.get("arguments"), str):
        parsed = _loads(item["arguments"])
        if isinstance(parsed, dict):
            return {**item, "arguments": parsed}
    return item


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class HarmonyToolCalls(ToolCallStream):
    """gpt-oss's harmony format (`harmony.py`): each message to `functions.NAME` is a call,
    its body the arguments, streamed as they come (as written: the model writes JSON);
    other bodies are content."""

    skip_special_tokens = False  # the headers are special tokens

    def __init__(self) -> None:
        self._scanner = MessageScanner()
        self._num_calls = 0

    def update(self, text: str, *, final: bool) -> Delta:
        out = Delta()
        for p in self._scanner.update(text, final=final):
            if p.recipient is None or not p.recipient.startswith(FUNCTIONS):
                out.content += p.body
            elif p.header is not None:  # a call starts
                name = p.recipient[len(FUNCTIONS) :]
                out.tool_calls.append(ToolCallDelta(self._num_calls, name, p.body))
                self._num_calls += 1
            elif out.tool_calls and out.tool_calls[-1].index == self._num_calls - 1:
                out.tool_calls[-1].arguments += p.body  # the call began in this update
            elif p.body:
                out.tool_calls.append(ToolCallDelta(self._num_calls - 1, None, p.body))
        return out


TOOL_PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesToolCalls,
    "openai": HarmonyToolCalls,
    "llama3_json": Llama3JsonToolCalls,
    "mistral": MistralToolCalls,
    "pythonic": PythonicToolCalls,
    "qwen3_coder": Qwen3CoderToolCalls,
}
