"""jaxllm's logprobs (`Logprob` per token) in OpenAI's shapes: completions', chat's, and vLLM's
prompt_logprobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxllm.outputs import Logprob

LOGPROB_FLOOR = -9999.0  # what -inf logprobs become (JSON has no -inf), as in vLLM


def _json_logprob(logprob: float) -> float:
    """-inf (and NaN) has no JSON form: it becomes LOGPROB_FLOOR."""
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _token_text(token_id: int, entry: Logprob | None, decode: Callable[[int], str] | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id) if decode is not None else f"token_id:{token_id}"


def _top(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The step's `num` most likely tokens, most likely first."""
    return sorted(
        ((t, lp) for t, lp in step.items() if lp.rank <= num), key=lambda item: item[1].rank
    )


def _check_lengths(token_ids: Sequence[int], logprobs: Sequence[Any]) -> None:
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} token ids but {len(logprobs)} logprob entries")


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num: int,
    tokenizer_decode: Callable[[int], str],
    initial_text_offset: int = 0,
) -> dict[str, list]:
    """OpenAI's completions logprobs for `token_ids`: per token its text, its logprob, a dict
    of the `num` most likely tokens' texts to logprobs plus the sampled one (up to num + 1
    entries, as OpenAI documents), and its character offset in the text, starting at
    `initial_text_offset` (the length of the text before these tokens: echoed prompt, earlier
    stream chunks). A None entry (a token without logprobs) gives None logprobs."""
    _check_lengths(token_ids, logprobs)
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = initial_text_offset
    for token_id, step in zip(token_ids, logprobs, strict=True):
        entry = None if step is None else step.get(token_id)
        token = _token_text(token_id, entry, tokenizer_decode)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if step is None or entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_json_logprob(entry.logprob))
        top = _top(step, num)
        if all(t != token_id for t, _ in top):
            top.append((token_id, entry))
        out["top_logprobs"].append(
            {_token_text(t, lp, tokenizer_decode): _json_logprob(lp.logprob) for t, lp in top}
        )
    return out


def prompt_logprobs_json(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None], num: int
) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token its own entry and
    the `num` most likely, each {"logprob", "rank", "decoded_token"}; None for the first."""
    _check_lengths(token_ids, logprobs)
    out: list[dict[int, dict[str, Any]] | None] = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        if step is None:
            out.append(None)
            continue
        entries = dict(_top(step, num))
        if token_id in step:
            entries[token_id] = step[token_id]
        out.append(
            {
                t: {
                    "logprob": _json_logprob(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }  # fmt: skip
                for t, lp in entries.items()
            }
        )
    return out


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    num: int,
    tokenizer_decode: Callable[[int], str] | None = None,
) -> dict[str, list]:
    """OpenAI's chat logprobs for `token_ids`: {"content": [{"token", "logprob", "bytes",
    "top_logprobs": the `num` most likely, each {"token", "logprob", "bytes"}}]}. Token texts
    come from the Logprob's decoded_token, else `tokenizer_decode`, else "token_id:<id>"."""
    _check_lengths(token_ids, logprobs)
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=True):
        entry = None if step is None else step.get(token_id)
        token = _token_text(token_id, entry, tokenizer_decode)
        item: dict[str, Any] = {
            "token": token,
            "logprob": LOGPROB_FLOOR if entry is None else _json_logprob(entry.logprob),
            "bytes": _utf8(token),
            "top_logprobs": [],
        }
        if step is not None:
            for t, lp in _top(step, num):
                text = _token_text(t, lp, tokenizer_decode)
                item["top_logprobs"].append(
                    {"token": text, "logprob": _json_logprob(lp.logprob), "bytes": _utf8(text)}
                )
        content.append(item)
    return {"content": content}
