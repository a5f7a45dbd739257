"""M-RoPE positions (Qwen2.5-VL), on the host: a prompt's tokens as (time, row, column)
triples, as transformers' `get_rope_index` makes them.

Text tokens count on from the position after what came before, the same in all three. An
image's tokens, a grid of t x h x w, start at that position p: (p + frame, p + row, p + column);
the text after it starts at p + max(h, w). A request's tokens past its prompt (generated, or a
resumed request's) are at their index plus `delta`, the same in all three.
"""

from __future__ import annotations

import numpy as np


def mrope_positions(
    num_tokens: int, grids: list[tuple[int, int, int, int]]
) -> tuple[np.ndarray, int]:
    """(i32[3, num_tokens] positions of a prompt whose images are at `grids` (first
    placeholder, frames, rows, columns), the delta of the tokens after it)."""
    out = np.empty((3, num_tokens), np.int32)
    at = position = 0  # the next text token's index and position
    for offset, t, h, w in sorted(grids):
        out[:, at:offset] = position + np.arange(offset - at)
        position += offset - at
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"))
        out[:, offset : offset + t * h * w] = position + grid.reshape(3, -1)
        at = offset + t * h * w
        position += max(h, w)
    out[:, at:] = position + np.arange(num_tokens - at)
    delta = int(out.max(initial=-1)) + 1 - num_tokens
    return out, delta
