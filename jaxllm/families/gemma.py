"""Gemma 2 and Gemma 3 (1B-27B; the 4B and larger are published as image-text models, whose
text decoder we serve): (1 + w) norms stored as w, sandwich norms, scaled embeddings, GELU,
softcapping (Gemma 2), QK-norm and local RoPE on the sliding layers (Gemma 3)."""

from __future__ import annotations

from jaxllm.families.base import GGUF_QK_NORM_NAMES, Family, GGUFFormat, register

_GEMMA = {
    "tie_word_embeddings": True,  # transformers' default for Gemma configs that omit it
    "norm_offset": 1.0,
    "sandwich_norms": True,
    "scale_embeddings": True,
    "hidden_act": "gelu_pytorch_tanh",
}


def _even_layers_slide(config: dict, num_layers: int) -> list[bool]:
    return [i % 2 == 0 for i in range(num_layers)]


def _all_but_every_nth_slide(config: dict, num_layers: int) -> list[bool]:
    """All but every `sliding_window_pattern`-th layer (6 unless the config says)."""
    period = config.get("sliding_window_pattern") or 6
    return [(i + 1) % period != 0 for i in range(num_layers)]


# Gemma's chat template (google/gemma-3-*-it): <bos> first, the roles user and model, and a
# system prompt folded into the first user turn (text parts only: image parts are dropped).
_GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm *before* the MLP, which
# Gemma calls pre_feedforward_layernorm (its post_attention_layernorm is after attention).
_GEMMA3_GGUF_NAMES = {
    **GGUF_QK_NORM_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def _gemma3_gguf_config(reader, config: dict) -> dict:
    """What Gemma 3 needs beyond the common keys; llama.cpp hard-codes most of it."""
    num_layers = config["num_hidden_layers"]
    # Every 6th layer is global, the others slide (llama.cpp: `set_swa_pattern(6)`); a file
    # may state the pattern as a period or as one flag per layer (true = sliding). Without a
    # window (llama.cpp reads none as 0) every layer is global.
    pattern = reader.field("gemma3.attention.sliding_window_pattern", 6)
    if not config["sliding_window"]:
        sliding = [False] * num_layers
    elif isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    # llama.cpp scales queries by 1/sqrt(hidden / heads) in the 27B (its only 62-layer size)
    # and by 1/sqrt(head_dim) in every other size.
    if num_layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    else:
        scalar = config["head_dim"]
    return {
        "layer_types": [
            "sliding_attention" if s else "full_attention" for s in sliding[:num_layers]
        ],
        "rope_local_base_freq": reader.field("gemma3.rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
    }


register(
    Family("Gemma2ForCausalLM", _GEMMA, sliding_layers=_even_layers_slide),
    Family(
        "Gemma3ForCausalLM",
        {
            **_GEMMA,
            "qk_norm": True,
            "rope_theta": 1_000_000.0,  # transformers' defaults, for configs that omit them
            "rope_local_theta": 10_000.0,
        },
        sliding_layers=_all_but_every_nth_slide,
        gguf=GGUFFormat(
            "gemma3",
            "gemma3_text",
            _GEMMA3_GGUF_NAMES,
            norm_shift=1.0,
            chat_template=_GEMMA_CHAT_TEMPLATE,
            end_of_turn=("<end_of_turn>",),
            read_config=_gemma3_gguf_config,
        ),
    ),
    Family("Gemma3ForConditionalGeneration", text_of="Gemma3ForCausalLM"),
)
