"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a
regex, one of several strings, or a grammar (vLLM's `structured_outputs`), with llguidance.

Front end: `StructuredOutputsParams` (in `SamplingParams`) is checked when it is built: exactly
one constraint, and it compiles (llguidance's own validation, which needs no tokenizer), so a
bad schema, regex or grammar is a ValueError naming the field before it reaches the engine.

Engine core: the scheduler asks `StructuredOutputManager.grammar` for a request's `Grammar`
when the request arrives. Matchers compile on a thread pool (llguidance releases the GIL), so
neither the engine loop nor the server's event loop waits for them; a compiled grammar is
cached by its text and each request gets a copy. A request waits until its grammar is ready,
and fails if that takes more than `compile_timeout_s`.

Each step, for the rows that sample with a grammar, the scheduler fills a packed bitmask
(`fill_bitmask`: llguidance's layout, int32 words, bit i of word w allowing token 32 w + i),
in parallel over the rows and without the GIL; with draft tokens, row j of a request is its
matcher after the first j drafts, and drafts the grammar refuses are cut before they are
scheduled. The runner sends the rows to the device only in such a step, and the sampler
unpacks them there (see `sampler.py`). After the step each matcher consumes the tokens its
request kept. A preempted request keeps its tokens and so its matcher; each of n completions
has its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# The whitespace JSON may have between two tokens unless the request says otherwise: enough
# to pretty-print (a newline and the indent of a few levels), too little to loop on. Departs
# from vLLM, whose default is any amount: the demo model, sampled at temperature 0.3, wrote
# newlines until max_tokens in 1 of 60 responses with that.
JSON_WHITESPACE = r"[ \t\n]{0,16}"
COMPILE_TIMEOUT_S = 30.0  # longest a request waits for its grammar to compile
MAX_CACHED_GRAMMARS = 256


@dataclasses.dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's names). Exactly one of the first five is set."""

    json: dict[str, Any] | str | None = None
    """A JSON schema (a dict, or its JSON text)."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A grammar in Lark syntax (llguidance's) or GBNF (llama.cpp's)."""
    json_object: bool | None = None
    """Any JSON object."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between its tokens (default: up to `JSON_WHITESPACE`)."""
    disable_additional_properties: bool = False
    """JSON objects hold only the properties their schema names."""
    whitespace_pattern: str | None = None
    """A regex for the whitespace JSON may have between its tokens."""

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar or json_object "
                f"must be set, got {', '.join(set_) or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        error = validate(self.compile_grammar())
        if error:
            raise ValueError(f"structured_outputs.{self.kind}: {error}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def compile_grammar(self) -> str:
        """The llguidance grammar of this constraint (what its matcher compiles); a ValueError
        naming the field for a schema that is not JSON."""
        import llguidance
        from llguidance import LLMatcher

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json is None else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
            if self.disable_additional_properties:
                schema = _no_additional_properties(schema)
            options: dict[str, Any] = {"whitespace_flexible": not self.disable_any_whitespace}
            if not self.disable_any_whitespace:
                options["whitespace_pattern"] = self.whitespace_pattern or JSON_WHITESPACE
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: {e}") from None
        kind = self.kind
        text = self.choice if kind == "choice" else getattr(self, kind)
        try:
            return llguidance.grammar_from(kind, text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None


def validate(grammar: str) -> str:
    """llguidance's verdict on a grammar: "" if it compiles, else the error."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


class Grammar:
    """One request's matcher: compiling (a future), then ready, or failed."""

    def __init__(self, future: Future, timeout_s: float):
        self._future = future
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self.matcher = None
        self.error: str | None = None

    def ready(self) -> bool:
        """Whether the grammar is compiled or failed (then `error` says why)."""
        if self.matcher is not None or self.error is not None:
            return True
        if self._future.done():
            try:
                self.matcher = self._future.result()
            except Exception as e:  # the tokenizer or grammar would not build
                self.error = f"structured_outputs: {e}"
            return True
        if time.monotonic() > self._deadline:
            self.error = f"structured_outputs: the grammar did not compile in {self._timeout_s} s"
            return True
        return False

    @property
    def compiled(self) -> bool:
        """Ready and not failed: the request may run (a failed one waits to be failed)."""
        return self.ready() and self.matcher is not None

    def wait(self, timeout: float) -> None:
        """Blocks until the grammar is compiled, at most `timeout` seconds."""
        try:
            self._future.exception(
                timeout=max(0.0, min(timeout, self._deadline - time.monotonic()))
            )
        except TimeoutError:
            pass

    def accept(self, tokens: list[int]) -> bool:
        """Advances the matcher over sampled tokens; False (and logged) if it refused one or
        is in error (out of its parser limits: its mask then allows only EOS, which must not
        pass for a complete output). Once the grammar is complete (stopped) the matcher takes
        nothing more, and its mask allows only EOS."""
        matcher = self.matcher
        for token in tokens:
            if matcher.is_stopped() and not matcher.is_error():
                break
            if not matcher.consume_token(token):
                logger.error("structured outputs: token %d broke the grammar: %s", token,
                             matcher.get_error())  # fmt: skip
                return False
        return not matcher.is_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (draft tokens) the grammar accepts from here, in order."""
        return self.matcher.validate_tokens(tokens)


class StructuredOutputManager:
    """Compiles matchers (cached by grammar) and fills the step's token bitmask.

    `load_tokenizer() -> (a fast transformers tokenizer, its EOS ids)` runs once, on the pool,
    when the first constrained request arrives: an engine that never sees one never pays for
    it (about 0.3 s for the demo model's vocabulary)."""

    def __init__(
        self,
        load_tokenizer: Callable[[], tuple[Any, list[int]]],
        vocab_size: int,
        *,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_workers: int = 2,
    ):
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)  # int32 words per bitmask row
        self.compile_timeout_s = compile_timeout_s
        self._load_tokenizer = load_tokenizer
        self._tokenizer = None
        self._lock = threading.Lock()  # the cache (taken on the engine thread)
        self._tokenizer_lock = threading.Lock()  # the tokenizer's one load (pool threads)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()  # grammar -> pristine matcher
        self._executor = None

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """Starts compiling (or reuses) the matcher of a request's constraint."""
        text = params.compile_grammar()
        with self._lock:
            pristine = self._cache.get(text)
            if pristine is None:
                pristine = self._pool.submit(self._compile, text)
                self._cache[text] = pristine
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(text)
        if pristine.done() and pristine.exception() is None:
            copy: Future = Future()
            copy.set_result(pristine.result().deep_copy())
        else:
            copy = self._pool.submit(lambda: pristine.result().deep_copy())
        return Grammar(copy, self.compile_timeout_s)

    def _compile(self, text: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self._ll_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def _ll_tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                tokenizer, eos_ids = self._load_tokenizer()
                self._tokenizer = llguidance.hf.from_tokenizer(
                    tokenizer, n_vocab=self.vocab_size, eos_token=list(eos_ids)
                )
            return self._tokenizer

    def fill_bitmask(self, rows: list[tuple[Grammar, list[int]]]) -> np.ndarray:
        """The packed masks of constrained requests, int32 [sum of 1 + drafts, words]: for
        each (grammar, draft tokens), one row per draft prefix."""
        import llguidance
        import llguidance.numpy as lln

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        num_rows = sum(1 + len(drafts) for _, drafts in rows)
        bitmask = np.full((num_rows, self.num_words), -1, np.int32)
        plain, with_drafts, start = [], [], 0
        for grammar, drafts in rows:
            if drafts:
                with_drafts.append((grammar.matcher, start, list(drafts)))
            else:
                plain.append((grammar.matcher, start))
            start += 1 + len(drafts)
        if plain:
            lln.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if with_drafts:
            lln.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)
        return bitmask

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
