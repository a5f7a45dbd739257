"""POST /v1/chat/completions: the messages, logprobs, and the tools with tool_choice (checked,
handed to the chat template, and constraining the output when a call is forced)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from annotated_types import Ge, Le
from pydantic import Field, ValidationInfo, field_validator, model_validator

from jaxllm.structured_outputs import StructuredOutputsParams
from server.protocol.errors import APIError, _ParamError, _short
from server.protocol.fields import ChatMessage, _ChatTemplateFields, _integer
from server.protocol.sampling import MaxTokens, _constraint_error, _SamplingRequest
from server.tool_parsers import required_tool_calls_schema

MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's limit)
_ANY_OBJECT = {"type": "object"}  # the arguments of a function that declares no parameters

TopLogprobs = _integer(Ge(0), Le(MAX_TOP_LOGPROBS))


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """POST /v1/chat/completions."""

    _PROMPT_PARAM: ClassVar[str] = "messages"

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    echo: bool | None = False
    tools: list[dict[str, Any]] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} once
    # validated (validated when unset too: with tools, it is then "auto").
    tool_choice: Any = Field(None, validate_default=True)
    parallel_tool_calls: bool | None = True
    functions: Any = None
    function_call: Any = None
    # vLLM's: with a --reasoning-parser, False leaves the thinking out of the response.
    include_reasoning: bool = True

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tools(cls, value: Any) -> Any:
        """Each tool as {"type": "function", "function": {"name", "description",
        "parameters"}} (the keys vLLM hands the chat template; others are dropped)."""
        if value is None:
            return None
        if not isinstance(value, list):
            raise ValueError("tools must be a list of {'type': 'function', 'function': {...}}")
        out, names = [], set()
        for i, tool in enumerate(value):
            where = f"tools.{i}"
            if not isinstance(tool, dict):
                raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"{where}.function.name must be a non-empty string")
            if name in names:
                raise ValueError(f"{where}.function.name: two tools are named {_short(name)}")
            names.add(name)
            description = function.get("description")
            if description is not None and not isinstance(description, str):
                raise ValueError(f"{where}.function.description must be a string")
            parameters = function.get("parameters")
            if parameters is not None:
                if not isinstance(parameters, dict):
                    raise ValueError(f"{where}.function.parameters must be a JSON schema object")
                try:  # compiles as the constraint of a call to it would
                    StructuredOutputsParams(json=parameters)
                except ValueError as e:
                    raise ValueError(_constraint_error(f"{where}.function.parameters", e)) from None
            out.append(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": description,
                        "parameters": parameters,
                    },
                }
            )
        return out

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if value is None:
            value = "auto" if tools else "none"
        if value == "none":
            return value
        name = None
        if isinstance(value, dict) and value.get("type") == "function":
            function = value.get("function")
            name = function.get("name") if isinstance(function, dict) else None
        if value not in ("auto", "required") and not (isinstance(name, str) and name):
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}"
            )
        if tools is None:
            raise ValueError("tool_choice needs tools")
        if name is None:
            return value if tools else "none"  # no tools to call (vLLM, for "required")
        if all(t["function"]["name"] != name for t in tools):
            raise ValueError(f"tool_choice: no tool is named {_short(name)}")
        return {"type": "function", "function": {"name": name}}

    @field_validator("parallel_tool_calls", mode="before")
    @classmethod
    def _null_parallel_tool_calls(cls, value: Any) -> Any:
        return True if value is None else value

    @field_validator("functions", "function_call")
    @classmethod
    def _check_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            raise ValueError(f"{info.field_name} is not supported; use tools and tool_choice")
        return value

    @model_validator(mode="after")
    def _check_chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _ParamError("top_logprobs", "top_logprobs is only allowed when logprobs is true")
        return self

    def _requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        if "max_completion_tokens" in self.model_fields_set and "max_tokens" not in (
            self.model_fields_set
        ):
            return "max_completion_tokens", None
        return "max_tokens", self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def named_tool(self) -> str | None:
        """The function tool_choice names, if it names one."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def check_tool_choice(self, *, auto_tool_choice: bool) -> None:
        """400 for tool_choice "auto" on a server without a tool call parser (vLLM's words)."""
        if self.tool_choice == "auto" and not auto_tool_choice:
            raise APIError.bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                "tool_choice",
            )

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        out = super()._constraints()
        if self.named_tool is not None:
            tool = next(t for t in self.tools if t["function"]["name"] == self.named_tool)
            out.append(("tool_choice", {"json": tool["function"]["parameters"] or _ANY_OBJECT}))
        elif self.tool_choice == "required":
            try:
                schema = required_tool_calls_schema(self.tools, parallel=self.parallel_tool_calls)
            except ValueError as e:
                raise _ParamError("tools", str(e)) from None
            out.append(("tool_choice", {"json": schema}))
        return out

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        if self.tools and self.tool_choice != "none":
            kwargs["tools"] = self.tools
        return kwargs
