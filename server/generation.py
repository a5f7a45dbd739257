"""Generations: the engine requests of one HTTP request and the responses they make, for
`/v1/completions` (`Completion`) and `/v1/chat/completions` (`ChatCompletion`; Anthropic's
`/v1/messages` renders the same generation in its own shape, `server.anthropic_api`).

A generation runs the n completions of each prompt of the request, merged in one stream of
(choice index, snapshot) events; a subclass builds its endpoint's choices and stream chunks.
The helpers before it check and render what a request asks (prompts, chat template, sampling
parameters).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import jinja2
from pydantic import BaseModel

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.errors import EngineDeadError, InputError, RequestFailedError
from jaxllm.multimodal.chat import split_images
from server import protocol, reasoning_parsers, tool_parsers
from server.protocol import APIError
from server.reasoning_parsers import ReasoningStream
from server.serving import ServerState
from server.tool_parsers import ToolCallStream

logger = logging.getLogger("jaxllm.server")


# Characters JSON may carry raw but many line readers split on (str.splitlines, and so httpx's
# aiter_lines): a token decoding to one of them cut a `data:` line in two for such clients.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(body: BaseModel) -> str:
    """One server-sent event; its JSON escapes every character a line reader could break on
    (JSON already escapes the control characters), so each event is one line for any client."""
    return f"data: {body.model_dump_json().translate(_LINE_BREAKS)}\n\n"


def sampling_params(eng: AsyncLLM, req, ids: list[int], param: str):
    """The prompt's and the request's checks (the engine's input path: `InputError`s are
    400s naming the parameter), and the request's `SamplingParams`."""
    room = eng.input_processor.check_prompt(ids, param)
    params = req.to_sampling_params(
        default_max_tokens=room, generation_defaults=eng.generation_config
    )
    eng.input_processor.check_params(params)
    return params


def completion_prompts(eng: AsyncLLM, req) -> list[tuple[list[int], str | None]]:
    """(ids, text) of each prompt; texts that cannot fit are refused before tokenizing."""
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            eng.input_processor.check_text_fits(p, "prompt")
            out.append((eng.tokenizer.encode(p, add_special_tokens=req.add_special_tokens), p))
        else:
            out.append((list(p), None))
    return out


def render_chat(
    eng: AsyncLLM, req, *, add_special_tokens: bool = False, check_fits: bool = True
) -> list[int]:
    """The prompt's token ids of a conversation (see `render_chat_inputs`)."""
    return render_chat_inputs(
        eng, req, add_special_tokens=add_special_tokens, check_fits=check_fits
    )[0]


def render_chat_inputs(
    eng: AsyncLLM, req, *, add_special_tokens: bool = False, check_fits: bool = True
) -> tuple[list[int], list]:
    """(token ids, images as `MultiModalItem`s) of a conversation rendered by the chat
    template: its image parts loaded and run through the model's processor with the prompt
    (an image-text model; any other refuses them, naming the part)."""
    conversation, sources = split_images(req.conversation())
    images = eng.input_processor.images
    if sources and images is None:
        raise InputError(f"{sources[0][1]}: this model takes no images", sources[0][1])
    try:
        text = eng.tokenizer.apply_chat_template(
            conversation, tokenize=False, **req.template_kwargs()
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError):  # the template refused
        raise APIError.bad_request(
            "the chat template rejected these messages", "messages"
        ) from None
    if check_fits:  # /tokenize counts any conversation's tokens
        eng.input_processor.check_text_fits(text, "messages")
    # The template already holds any BOS token, unless the caller asks for one.
    if not sources:
        return eng.tokenizer.encode(text, add_special_tokens=add_special_tokens), []
    loaded = images.load(sources, "messages")
    return images.process(text, loaded, add_special_tokens=add_special_tokens, param="messages")


def _error_event(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, EngineDeadError | RequestFailedError):
        err = APIError.internal("the engine failed this request")
    else:
        logger.exception("stream failed", exc_info=exc)
        err = APIError.internal()
    return f"data: {json.dumps(err.body())}\n\n"


class _Generation:
    """Runs the n completions of each prompt of one HTTP request, merged in one stream of
    (choice index, snapshot) events. Subclasses build the choices of their endpoint's
    response and stream chunk models."""

    response_cls: ClassVar[type[BaseModel]]
    chunk_cls: ClassVar[type[BaseModel]]

    def __init__(self, req, model: str, jobs, eng: AsyncLLM, lora=None, mm_items=()):
        """`lora`: the LoRA adapter `model` names (`ServerState.lora_request`), or None.
        `mm_items`: the images of a chat's one prompt."""
        self.req, self.model, self.jobs, self.eng = req, model, jobs, eng
        if getattr(req, "kv_transfer_params", None) and len(jobs) > 1:
            # One prefill's blocks serve one decode, and the response carries one answer.
            raise InputError("kv_transfer_params: one prompt per request with prefill/decode disaggregation", "prompt")  # fmt: skip
        self.prompt_logprobs: dict[int, list] = {}  # choice -> the engine's prompt_logprobs
        self.kv_transfer_params: dict | None = None  # a prefiller's answer (`kv_transfer`)
        # The response model's own id form ("cmpl-...", "chatcmpl-..."), one for all chunks.
        self.id = self.response_cls.model_fields["id"].get_default(call_default_factory=True)
        # The engine requests, in choice order: the n completions of each prompt.
        self.requests = [
            request
            for p, (ids, params, _) in enumerate(jobs)
            for request in eng.input_processor.fan_out(
                f"{self.id}-{p}",
                ids,
                params,
                lora_request=lora,
                mm_items=mm_items,
                cache_salt=req.cache_salt,
                kv_transfer_params=req.kv_transfer_params,
            )
        ]
        self.created = int(time.time())
        self.arrival = time.monotonic()

    @property
    def num_requests(self) -> int:
        """Engine requests: n per prompt."""
        return len(self.requests)

    async def _events(self) -> AsyncIterator[tuple[int, Any]]:
        # Bounded: while the client does not read, the choices' tasks wait here, and the
        # engine's outputs pile up as one snapshot per request (AsyncLLM), not one per token.
        queue: asyncio.Queue = asyncio.Queue(maxsize=2 * self.num_requests)

        async def run(choice: int, index: int, request):
            try:
                async for ro in self.eng.generate(request, index=index, arrival_time=self.arrival):
                    if ro.prompt_logprobs is not None:
                        self.prompt_logprobs[choice] = ro.prompt_logprobs
                    if ro.kv_transfer_params is not None:
                        self.kv_transfer_params = ro.kv_transfer_params
                    await queue.put((choice, ro.outputs[0]))
            except asyncio.CancelledError:
                raise  # the response is over: nobody reads the queue any more
            except Exception as e:
                await queue.put((choice, e))

        tasks = [
            asyncio.create_task(run(choice, index, request))
            for choice, (index, request) in enumerate(self.requests)
        ]
        try:
            done = 0
            while done < len(tasks):
                choice, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    done += 1
                yield choice, item
        finally:
            for t in tasks:
                t.cancel()

    def _job_of(self, choice: int):
        for ids, params, text in self.jobs:
            if choice < params.n:
                return ids, params, text
            choice -= params.n
        raise IndexError(choice)

    def _usage(self, finals: dict[int, Any]) -> protocol.UsageInfo:
        return protocol.UsageInfo.of(
            prompt_tokens=sum(len(ids) for ids, _, _ in self.jobs),
            completion_tokens=sum(len(o.token_ids) for o in finals.values()),
        )

    async def _finals(self) -> dict[int, Any]:
        """Each choice's last snapshot, once all have finished."""
        finals: dict[int, Any] = {}
        try:
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    if out.finish_reason is not None:
                        finals[choice] = out
        except (EngineDeadError, RequestFailedError):
            raise APIError.internal("the engine failed this request") from None
        return finals

    async def full(self) -> BaseModel:
        finals = await self._finals()
        return self.response_cls(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[self._choice(c, finals[c]) for c in sorted(finals)],
            usage=self._usage(finals),
            kv_transfer_params=self.kv_transfer_params,
        )

    def _chunk(self, choices: list, usage: protocol.UsageInfo | None = None) -> BaseModel:
        return self.chunk_cls(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    async def stream(self) -> AsyncIterator[str]:
        opts = self.req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        sent: dict[int, tuple[int, int]] = {}  # choice -> (chars, tokens) already sent
        finals: dict[int, Any] = {}
        try:
            for chunk in self._stream_start():
                yield _sse(chunk)
            async with contextlib.aclosing(self._events()) as events:
                async for choice, out in events:
                    chars, toks = sent.get(choice, (0, 0))
                    delta = self._delta(choice, out, chars, toks)
                    sent[choice] = (len(out.text), len(out.token_ids))
                    if out.finish_reason is not None:
                        finals[choice] = out
                    if delta is None:
                        continue
                    usage = self._usage({**finals, choice: out}) if continuous else None
                    yield _sse(self._chunk([delta], usage))
            if include_usage:
                yield _sse(self._chunk([], self._usage(finals)))
        except Exception as e:
            yield _error_event(e)
        yield "data: [DONE]\n\n"

    def _stream_start(self) -> list[BaseModel]:
        """The chunks sent before the first token."""
        return []


class Completion(_Generation):
    response_cls = protocol.CompletionResponse
    chunk_cls = protocol.CompletionStreamResponse

    def _logprobs(self, choice: int, out, start_token: int, start_char: int):
        """Logprobs of the tokens from `start_token` on, whose text starts at `start_char`;
        with echo, the first chunk also covers the echoed prompt (its prompt logprobs)."""
        ids, params, _ = self._job_of(choice)
        if params.logprobs is None or out.logprobs is None:
            return None
        token_ids, logprobs = out.token_ids[start_token:], out.logprobs[start_token:]
        if self.req.echo:
            if start_token == 0:
                token_ids = [*ids, *token_ids]
                logprobs = [*self.prompt_logprobs.get(choice, [None] * len(ids)), *logprobs]
            else:
                start_char += len(self._echo(choice))
        return protocol.CompletionLogProbs(
            **protocol.completion_logprobs(
                token_ids,
                logprobs,
                params.logprobs,
                lambda t: self.eng.tokenizer.decode([t]),
                initial_text_offset=start_char,
            )
        )

    def _prompt_logprobs(self, choice: int):
        ids, params, _ = self._job_of(choice)
        if self.req.prompt_logprobs is None or choice not in self.prompt_logprobs:
            return None
        return protocol.prompt_logprobs_json(
            ids, self.prompt_logprobs[choice], self.req.prompt_logprobs
        )

    def _echo(self, choice: int) -> str:
        if not self.req.echo:
            return ""
        ids, _, text = self._job_of(choice)
        return text if text is not None else self.eng.tokenizer.decode(ids)

    def _choice(self, choice: int, out) -> protocol.CompletionResponseChoice:
        return protocol.CompletionResponseChoice(
            index=choice,
            text=self._echo(choice) + out.text,
            logprobs=self._logprobs(choice, out, 0, 0),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=self._prompt_logprobs(choice),
        )

    def _delta(self, choice: int, out, chars: int, toks: int):
        text = out.text[chars:]
        if toks == 0:
            text = self._echo(choice) + text
        if not text and out.finish_reason is None and len(out.token_ids) == toks:
            return None
        return protocol.CompletionResponseChoice(
            index=choice,
            text=text,
            logprobs=self._logprobs(choice, out, toks, chars),
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            prompt_logprobs=self._prompt_logprobs(choice) if toks == 0 else None,
        )


def tool_call_streams(
    req, parser: type[ToolCallStream] | None
) -> Callable[[], ToolCallStream] | None:
    """What reads the tool calls out of each choice of a chat request: a callable making a
    fresh `ToolCallStream`, or None (the output is content)."""
    if req.named_tool is not None:
        return functools.partial(tool_parsers.NamedToolCall, req.named_tool)
    if req.tool_choice == "required":
        return tool_parsers.RequiredToolCalls
    if req.tool_choice == "auto":  # only on a server with a parser (check_tool_choice)
        return functools.partial(parser, tools=req.tools) if parser.uses_tools else parser
    return None


class ChatCompletion(_Generation):
    response_cls = protocol.ChatCompletionResponse
    chunk_cls = protocol.ChatCompletionStreamResponse

    def __init__(
        self,
        req,
        model: str,
        jobs,
        eng: AsyncLLM,
        tool_parser: type[ToolCallStream] | None,
        reasoning: Callable[[], ReasoningStream] | None = None,
        lora=None,
        mm_items=(),
    ):
        """`reasoning`: makes each choice's `ReasoningStream` (a server with a
        --reasoning-parser): the thinking is split off first, and the rest (the answer) is
        what content and tool calls are read from."""
        super().__init__(req, model, jobs, eng, lora, mm_items)
        self.new_tool_stream = tool_call_streams(req, tool_parser)
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice -> its stream
        self.called: set[int] = set()  # choices that made a tool call so far
        self.new_reasoning_stream = reasoning
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.answers: dict[int, str] = {}  # choice -> its answer's text so far

    def _split(self, choice: int, out, *, whole: bool) -> tuple[str, str]:
        """(the reasoning the output adds, the answer's whole text so far); `whole`: a
        non-streamed choice, split at once."""
        if self.new_reasoning_stream is None:
            return "", out.text
        final = out.finish_reason is not None
        if whole:
            d = self.new_reasoning_stream().update(out.text, final=final)
            return d.reasoning, d.content
        stream = self.reasoning_streams.get(choice)
        if stream is None:
            stream = self.reasoning_streams[choice] = self.new_reasoning_stream()
        d = stream.update(out.text, final=final)
        self.answers[choice] = self.answers.get(choice, "") + d.content
        return d.reasoning, self.answers[choice]

    def _reasoning(self, text: str) -> dict:
        """The message's reasoning fields (vLLM's two names), unless the request leaves the
        thinking out."""
        if not text or not self.req.include_reasoning:
            return {}
        return {"reasoning_content": text, "reasoning": text}

    def _tool_delta(self, stream: ToolCallStream, out, text: str) -> tool_parsers.Delta:
        delta = stream.update(text, final=out.finish_reason is not None)
        if not self.req.parallel_tool_calls:  # the first call only (vLLM's rule)
            delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
        return delta

    def _finish_reason(self, out, called: bool) -> str | None:
        """The engine's finish reason, but "tool_calls" when calls end the output (the engine
        says "stop"), except for a named function, whose call is all the output can be (as in
        vLLM)."""
        if called and out.finish_reason == "stop" and self.req.named_tool is None:
            return "tool_calls"
        return out.finish_reason

    def _message(self, extracted: tool_parsers.Extracted) -> protocol.ChatResponseMessage:
        calls = [
            protocol.ToolCall(
                id=c.id or protocol.tool_call_id(),
                function=protocol.FunctionCall(name=c.name, arguments=c.arguments),
            )
            for c in extracted.tool_calls
        ]
        if self.req.tool_choice != "auto":
            content = ""  # a forced call: no content (vLLM's "")
        else:
            content = extracted.content or (None if calls else "")
        return protocol.ChatResponseMessage(content=content, tool_calls=calls or None)

    @staticmethod
    def _delta_tool_call(call: tool_parsers.ToolCallDelta) -> protocol.DeltaToolCall:
        if call.name is None:
            function = protocol.DeltaFunctionCall(arguments=call.arguments)
            return protocol.DeltaToolCall(index=call.index, function=function)
        return protocol.DeltaToolCall(
            index=call.index,
            id=call.id or protocol.tool_call_id(),
            type="function",
            function=protocol.DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )

    def _logprobs(self, choice: int, out, start_token: int):
        params = self._job_of(choice)[1]
        if params.logprobs is None or out.logprobs is None:
            return None
        return protocol.ChatCompletionLogProbs.model_validate(
            protocol.chat_logprobs(
                out.token_ids[start_token:], out.logprobs[start_token:], params.logprobs
            )
        )

    def _choice(self, choice: int, out) -> protocol.ChatCompletionResponseChoice:
        reasoning, answer = self._split(choice, out, whole=True)
        message = protocol.ChatResponseMessage(content=answer)
        finish_reason = out.finish_reason
        if self.new_tool_stream is not None:
            delta = self._tool_delta(self.new_tool_stream(), out, answer)
            extracted = tool_parsers.assemble([delta])
            message = self._message(extracted)
            finish_reason = self._finish_reason(out, bool(extracted.tool_calls))
        if self.new_reasoning_stream is not None:
            if reasoning and not answer and message.content == "" and not message.tool_calls:
                message.content = None  # all thinking, no answer (vLLM's null content)
            message = message.model_copy(update=self._reasoning(reasoning))
        return protocol.ChatCompletionResponseChoice(
            index=choice,
            message=message,
            logprobs=self._logprobs(choice, out, 0),
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )

    def _stream_start(self) -> list[BaseModel]:
        first = protocol.DeltaMessage(role="assistant", content="")
        n = self.jobs[0][1].n
        return [
            self._chunk(
                [protocol.ChatCompletionStreamChoice(index=i, delta=first) for i in range(n)]
            )
        ]

    def _delta(self, choice: int, out, chars: int, toks: int):
        text, tool_calls, finish_reason = out.text[chars:], None, out.finish_reason
        new_tokens = len(out.token_ids) > toks
        reasoning = ""
        if self.new_reasoning_stream is not None:
            before = len(self.answers.get(choice, ""))
            reasoning, answer = self._split(choice, out, whole=False)
            text = answer[before:]
        else:
            answer = out.text
        if self.new_tool_stream is not None:
            stream = self.tool_streams.get(choice)
            if stream is None:
                stream = self.tool_streams[choice] = self.new_tool_stream()
            delta = self._tool_delta(stream, out, answer)
            text = delta.content
            tool_calls = [self._delta_tool_call(c) for c in delta.tool_calls] or None
            if any(c.name is not None for c in delta.tool_calls):
                self.called.add(choice)
            finish_reason = self._finish_reason(out, choice in self.called)
            # Tokens of a call still being read send nothing, but their logprobs (as vLLM).
            new_tokens = new_tokens and self._job_of(choice)[1].logprobs is not None
        thinking = self._reasoning(reasoning)
        if not text and not tool_calls and not thinking and out.finish_reason is None:
            if not new_tokens:
                return None
        return protocol.ChatCompletionStreamChoice(
            index=choice,
            delta=protocol.DeltaMessage(content=text or None, tool_calls=tool_calls, **thinking),
            logprobs=self._logprobs(choice, out, toks),
            finish_reason=finish_reason,
            stop_reason=out.stop_reason,
        )


async def chat_generation(
    state: ServerState,
    eng: AsyncLLM,
    req,
    model: str,
    cls: Callable[..., ChatCompletion] | None = None,
) -> ChatCompletion:
    """The generation of a checked chat request: its rendered prompt, sampling parameters
    and parsers (tools, reasoning), as `/v1/chat/completions` runs it, and `/v1/messages` (its
    own `cls`, a ChatCompletion answering in its shape)."""
    ids, items = await state.tokenizing(render_chat_inputs, eng, req)
    params = sampling_params(eng, req, ids, "messages")
    if req.tool_choice == "auto" and not state.tool_parser.skip_special_tokens:
        params.skip_special_tokens = False  # the parser reads special tokens (vLLM's rule)
    reasoning = None
    if state.reasoning_parser is not None:
        # The end of the prompt says whether the template opened a thinking block, or
        # opened and closed it (thinking off).
        tail = eng.tokenizer.decode(ids[-16:], skip_special_tokens=False)
        opens = reasoning_parsers.prompt_opens_thinking(tail)
        reasoning = functools.partial(state.reasoning_parser, prompt_opens=opens)
        if not state.reasoning_parser.skip_special_tokens:
            params.skip_special_tokens = False  # the parser reads special tokens
        if params.structured_outputs is not None and not (
            reasoning_parsers.prompt_closes_thinking(tail)
        ):
            # Structured outputs (and forced tool calls) constrain the answer only.
            params.reasoning_end_token_ids = state.reasoning_parser.end_token_ids(eng.tokenizer)
    cls = cls or ChatCompletion
    lora = state.lora_request(model)
    return cls(
        req, model, [(ids, params, None)], eng, state.tool_parser, reasoning, lora, mm_items=items
    )
