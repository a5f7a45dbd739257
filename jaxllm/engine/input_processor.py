"""The front end's one input path: a prompt and its `SamplingParams` become the engine core's
`AddRequest` messages here, for `LLM`, `AsyncLLM` and the server alike.

    check (prompt text fits, prompt ids, parameters against the vocabulary)
      -> resolve (max_tokens against the context, seeds, EOS ids)
      -> fan out n completions (the first computes the prompt, the others share its blocks)

Every check raises `InputError`, a ValueError naming the parameter, which the server answers
as a 400 with that `param`. What `SamplingParams` checks alone (ranges, types) it checks when
it is built; what needs the model (the vocabulary, the context length) is checked here, once.
The engine core guards its own socket with the same checks (`CoreLoop.handle`): a request
that passed here never fails there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxllm.config.kv_transfer import check_kv_transfer_params
from jaxllm.engine.messages import AddRequest, Ready
from jaxllm.errors import InputError
from jaxllm.lora import LoRARequest
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import MultiModalItem


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        *,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        max_model_len: int,
        seed: int | None = None,
        images=None,
    ):
        """`images`: an image-text model's `jaxllm.multimodal.processor.ImageProcessor`
        (prompts may carry images), else None."""
        self.tokenizer = tokenizer
        self.images = images
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # A text longer than max_model_len tokens of this many characters cannot fit: it is
        # refused before tokenizing (`check_text_fits`).
        self.max_token_chars = longest_token_chars(tokenizer)
        self._rng = np.random.default_rng(seed)  # seeds of requests that bring none
        self._ids = itertools.count()

    @classmethod
    def create(
        cls,
        tokenizer,
        generation_config: dict,
        *,
        model_eos_token_ids: Sequence[int],
        vocab_size: int,
        max_model_len: int,
        seed: int | None = None,
    ) -> InputProcessor:
        """The ids that end a request are the model config's, the generation config's and
        the tokenizer's EOS, together."""
        return cls(
            tokenizer,
            eos_token_ids=resolve_eos_token_ids(model_eos_token_ids, generation_config, tokenizer),
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            seed=seed,
        )

    @classmethod
    def for_engine(
        cls,
        tokenizer,
        generation_config: dict,
        ready: Ready,
        seed: int | None = None,
        images=None,
    ) -> InputProcessor:
        """The front end's processor for the engine that said `ready`: a pooling model's
        takes prompts only (no EOS ids, no sampling); a generative model's as `create`, with
        `images` (see `__init__`)."""
        if ready.pooling:
            return cls(
                tokenizer,
                eos_token_ids=(),
                vocab_size=ready.vocab_size,
                max_model_len=ready.max_model_len,
            )
        processor = cls.create(
            tokenizer,
            generation_config,
            model_eos_token_ids=ready.eos_token_ids,
            vocab_size=ready.vocab_size,
            max_model_len=ready.max_model_len,
            seed=seed,
        )
        processor.images = images
        return processor

    def next_request_id(self) -> str:
        return str(next(self._ids))

    # ---- checks ------------------------------------------------------------------------

    @property
    def max_text_chars(self) -> int:
        """The most characters a text that fits can have (0: no bound known): see
        `check_text_fits`."""
        return 2 * self.max_model_len * self.max_token_chars

    def _kept_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many tokens `truncate_prompt_tokens` keeps (-1: max_model_len; None: all)."""
        k = truncate_prompt_tokens
        return self.max_model_len if k == -1 else k

    def check_text_fits(self, text: str, param: str = "prompt") -> None:
        """Refuses a text that cannot fit before it is tokenized (megabytes of text take the
        tokenizer seconds, holding the GIL): no token covers more than `max_token_chars`
        characters, so a text longer than max_model_len of them has more tokens than fit.
        Twice that, since a normalizer may shorten text."""
        limit = self.max_text_chars
        if limit and len(text) > limit:
            raise InputError(
                f"{param} is {len(text)} characters long, more than max_model_len "
                f"({self.max_model_len}) tokens of this model can hold",
                param,
            )

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Every id a token of the vocabulary: an id out of range must never reach the
        embedding lookup or a host array of int32."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            shown = str(bad) if abs(bad) < 10**20 else f"{str(bad)[:20]}..."
            raise InputError(
                f"{param}: token id {shown} is outside the vocabulary [0, {self.vocab_size})",
                param,
            )

    def check_prompt(self, ids: Sequence[int], param: str = "prompt") -> int:
        """Raises unless the prompt can run (not empty, in the vocabulary, room for at least
        one new token); returns the room it leaves in the context."""
        if not ids:
            raise InputError(f"{param} must not be empty (it has no tokens)", param)
        self.check_token_ids(ids, param)
        if len(ids) >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens "
                f"(max_model_len), but the {param} has {len(ids)} tokens; it must leave room "
                "for at least one generated token.",
                param,
            )
        return self.max_model_len - len(ids)

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` alone cannot know: its token ids must be in the vocabulary.
        (Values past the vocabulary elsewhere mean "all": a top_k larger than it is off.)"""
        if not isinstance(params, SamplingParams):
            raise InputError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}",
                "sampling_params",
            )
        self.check_token_ids(params.stop_token_ids or (), "stop_token_ids")
        self.check_token_ids(params.logit_bias or (), "logit_bias")
        if params.reasoning_end_token_ids is not None:
            self.check_token_ids(params.reasoning_end_token_ids, "reasoning_end_token_ids")

    def tokenize(self, prompt: str | dict[str, Any], *, add_special_tokens: bool = True):
        """(text or None, checked token ids) of `LLM`'s prompt forms: a string, or a dict with
        `prompt_token_ids` (and optionally the `prompt` text they came from)."""
        text, ids, _ = self.prompt_inputs(prompt, add_special_tokens=add_special_tokens)
        return text, ids

    def prompt_inputs(
        self, prompt: str | dict[str, Any], images: list | None = None, *, add_special_tokens=True
    ):
        """(text or None, checked token ids, images as `MultiModalItem`s) of `LLM`'s prompt
        forms: a string, or a dict with `prompt` text or `prompt_token_ids` and optionally
        `multi_modal_data` {"image": an image, a list, or {"image_embeds": ...}} (vLLM's).
        `images`: images already loaded (a chat's), for a prompt without `multi_modal_data`."""
        param = "multi_modal_data"
        embeds = None  # {"image_embeds": ...}: the images as embeddings
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            data = prompt["multi_modal_data"]
            unknown = sorted(set(data) - {"image"}) if isinstance(data, dict) else None
            if unknown is None or unknown:
                raise InputError(
                    "multi_modal_data must be a dict with 'image' (an image or a list of "
                    f"them){'; got ' + ', '.join(map(repr, unknown)) if unknown else ''}",
                    param,
                )
            sources = data.get("image")
            if self.images is None:
                raise InputError(f"{param}: this model takes no images", param)
            if isinstance(sources, dict) and "image_embeds" in sources:
                embeds = sources
            else:
                sources = list(sources) if isinstance(sources, list | tuple) else [sources]
                images = self.images.load(sources, param)
        if not images and embeds is None:
            text, ids, came_as = self._prompt_ids(prompt, add_special_tokens)
            self.check_prompt(ids, came_as)
            return text, ids, []
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, source, _ = self._prompt_ids(prompt, add_special_tokens)
        else:
            text = source = prompt if isinstance(prompt, str) else prompt.get("prompt")
            if not isinstance(source, str) or not source:
                raise InputError("prompt must be a non-empty string", "prompt")
            self.check_text_fits(source)
        if embeds is not None:  # the images' embeddings instead of the images
            ids, items = self.images.process_embeds(
                source, embeds, add_special_tokens=add_special_tokens, param=param
            )
        else:
            ids, items = self.images.process(
                source, images, add_special_tokens=add_special_tokens, param=param
            )
        self.check_prompt(ids, "prompt")
        return text, ids, items

    def pooling_prompt(
        self,
        prompt: str | dict[str, Any],
        truncate_prompt_tokens: int | None = None,
        *,
        add_special_tokens: bool = True,
        param: str | None = None,
    ):
        """(text or None, checked token ids) of a pooling request's prompt, tokenized with the
        model's special tokens (BERT's [CLS] and [SEP]) unless told not to; errors name
        `param` (None: "prompt" or "prompt_token_ids", as the prompt came). With
        `truncate_prompt_tokens` k (-1: max_model_len), a text is cut by its tokenizer to k
        tokens (on the tokenizer's truncation side, special tokens kept, as vLLM and
        sentence-transformers cut it) and token ids to their last k."""
        k = self._kept_tokens(truncate_prompt_tokens)
        if isinstance(prompt, str) and prompt and k is not None and self.tokenizer is not None:
            # Only the characters that can hold the k tokens kept are tokenized (a text of
            # megabytes takes the tokenizer seconds): see check_text_fits.
            limit = self.max_text_chars
            text = prompt
            if limit and len(text) > limit:
                left = getattr(self.tokenizer, "truncation_side", "right") == "left"
                text = text[-limit:] if left else text[:limit]
            ids = self.tokenizer(
                text, add_special_tokens=add_special_tokens, truncation=True, max_length=k
            )["input_ids"]
            text, came_as = prompt, "prompt"
        else:
            text, ids, came_as = self._prompt_ids(prompt, add_special_tokens)
            if k is not None:
                ids = ids[-k:]
        self.check_pooling_ids(ids, param or came_as)
        return text, ids

    def pair_prompt(
        self, first: str, second: str, truncate_prompt_tokens: int | None = None, *, param: str
    ) -> tuple[list[int], list[int] | None]:
        """(checked token ids, segment ids or None) of a text pair, as a cross-encoder reads
        it: tokenized together (BERT: [CLS] first [SEP] second [SEP], the second's tokens of
        type 1), cut to `truncate_prompt_tokens` (-1: max_model_len) from the longer text
        first, as transformers truncates pairs. Errors name `param`."""
        if self.tokenizer is None:
            raise InputError(f"{param}: this model has no tokenizer to pair texts with", param)
        for text in (first, second):
            if not text:
                raise InputError(f"{param}: a text must not be empty", param)
            self.check_text_fits(text, param)
        k = self._kept_tokens(truncate_prompt_tokens)
        encoded = self.tokenizer(
            first,
            second,
            truncation="longest_first" if k is not None else False,
            max_length=k,
            return_token_type_ids=True,
        )
        ids = list(encoded["input_ids"])
        types = encoded.get("token_type_ids")
        self.check_pooling_ids(ids, param)
        return ids, None if types is None else list(types)

    def check_pooling_ids(self, ids: Sequence[int], param: str = "prompt_token_ids") -> None:
        """Raises unless a pooling request's ids can run: not empty, in the vocabulary, and
        unlike a generative prompt they may fill max_model_len (nothing is generated after)."""
        if not ids:
            raise InputError(f"{param} must not be empty (it has no tokens)", param)
        self.check_token_ids(ids, param)
        if len(ids) > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens "
                f"(max_model_len), but the {param} has {len(ids)} tokens; shorten it or set "
                "truncate_prompt_tokens.",
                param,
            )

    def _prompt_ids(self, prompt: str | dict[str, Any], add_special_tokens: bool):
        """(text or None, token ids, the parameter they came from) of a prompt: a string,
        tokenized, or a dict with `prompt_token_ids` (and optionally its `prompt` text)."""
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = prompt["prompt"]  # vLLM's {"prompt": text}
            if not isinstance(prompt, str):
                raise InputError("prompt must be a string", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("prompt must not be empty", "prompt")
            if self.tokenizer is None:
                raise InputError(
                    "prompt: this model has no tokenizer; pass prompt_token_ids", "prompt"
                )
            self.check_text_fits(prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return prompt, ids, "prompt"
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids
            ):
                raise InputError("prompt_token_ids must be a list of integers", "prompt_token_ids")
            return prompt.get("prompt"), [int(t) for t in ids], "prompt_token_ids"
        raise InputError(
            "prompt must be a string or a dict with 'prompt_token_ids', got "
            f"{type(prompt).__name__}",
            "prompt",
        )

    # ---- requests ----------------------------------------------------------------------

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        index: int = 0,
        priority: int = 0,
        prefix_parent: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
        kv_transfer_params: dict | None = None,
    ) -> AddRequest:
        """Completion `index` of a checked prompt, resolved for the core: its output bound
        (max_tokens, never past the context), its seed, the model's EOS ids. `mm_items`: its
        images (`prompt_inputs`)."""
        if not mm_items and self.images is not None:
            if self.images.vision.image_token_id in prompt_token_ids:
                raise InputError(
                    "prompt: it holds image placeholder tokens but no image was given",
                    "prompt",
                )
        problem = check_kv_transfer_params(kv_transfer_params)
        if problem is not None:
            raise InputError(problem, "kv_transfer_params")
        room = self.max_model_len - len(prompt_token_ids)
        return AddRequest(
            request_id,
            list(prompt_token_ids),
            params,
            max_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
            seed=derive_seed(params.seed, index, self._rng),
            eos_token_ids=list(self.eos_token_ids),
            priority=priority,
            prefix_parent=prefix_parent,
            lora_request=lora_request,
            mm_items=list(mm_items),
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        )

    def fan_out(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs
    ) -> list[tuple[int, AddRequest]]:
        """The n completions of one checked prompt, as (index, request): one request of that
        id when n is 1, else "{id}-{index}", each but the first starting from the first's
        cached prompt (`prefix_parent`), so the prompt is computed once."""
        if params.n == 1:
            return [(0, self.request(request_id, prompt_token_ids, params, **kwargs))]
        if kwargs.get("kv_transfer_params"):
            # One prefill's blocks serve one decode (vLLM's proxies send n = 1).
            raise InputError("kv_transfer_params: n must be 1 with prefill/decode disaggregation", "n")  # fmt: skip
        first = f"{request_id}-0"
        return [
            (
                i,
                self.request(
                    f"{request_id}-{i}",
                    prompt_token_ids,
                    params,
                    index=i,
                    prefix_parent=first if i else None,
                    **kwargs,
                ),
            )
            for i in range(params.n)
        ]


def derive_seed(seed: int | None, index: int, rng: np.random.Generator) -> int:
    """The sampling seed of completion `index` of a request: a fresh one from `rng` when the
    request has none; else `seed` itself for the first completion and distinct, reproducible
    seeds for the other n - 1."""
    if seed is None:
        return int(rng.integers(0, 2**63))
    if index == 0:
        return seed
    return int(np.random.default_rng([seed % 2**64, index]).integers(0, 2**63))


def resolve_eos_token_ids(
    model_eos: Sequence[int], generation_config: dict, tokenizer
) -> tuple[int, ...]:
    """The ids that end a request: the model config's, the generation config's and the
    tokenizer's EOS, together."""
    ids = set(model_eos)
    gen_eos = generation_config.get("eos_token_id")
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token of `tokenizer` covers, bounded by its longest
    vocabulary entry (a byte-level BPE entry of n characters stands for n bytes; a
    SentencePiece one for as many characters, its "▁" a space); 0 without a tokenizer."""
    if tokenizer is None:
        return 0
    return max((len(token) for token in tokenizer.get_vocab()), default=0)
