"""Verification of draft tokens, on the device inside the head-and-sampler program (see the
package's docstring for why it is exact): each logit row samples a token as it would without
speculation, and a row is kept when every earlier row of its request sampled the draft that row
verifies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyInputs:
    """Per logit row: where its token goes on the device, and which draft it verifies."""

    sample_rows: jax.Array  # i32[L]  batch row whose `last_tokens` entry gets it, else dropped
    drafts: jax.Array  # i32[L]  the draft the row's token must equal for the next row; -1: none
    first_rows: jax.Array  # i32[L]  the first logit row of the row's request


def padding_verify(n: int, dropped_row: int) -> VerifyInputs:
    """Inputs for `n` rows that verify nothing and whose tokens go nowhere (`dropped_row`: one
    past the last batch row)."""
    return VerifyInputs(
        sample_rows=np.full(n, dropped_row, np.int32),
        drafts=np.full(n, -1, np.int32),
        first_rows=np.arange(n, dtype=np.int32),
    )


def kept_rows(sampled: jax.Array, verify: VerifyInputs) -> jax.Array:
    """bool[L]: the rows whose tokens the step keeps (the accepted drafts' rows of each request
    and the one after them)."""
    mismatch = (sampled != verify.drafts).astype(jnp.int32)
    before = jnp.cumsum(mismatch) - mismatch  # mismatches in the rows before each row
    return before == before[verify.first_rows]


def accepted_rows(kept: np.ndarray, first_rows: np.ndarray, num_drafts: np.ndarray) -> list:
    """On the host, per request that sampled (its first logit row, its drafts): the logit rows
    whose tokens it keeps."""
    return [
        np.arange(f, f + 1 + k)[kept[f : f + 1 + k]]
        for f, k in zip(first_rows.tolist(), num_drafts.tolist(), strict=True)
    ]
