"""--lm-head-quant: store a float output head as ggml Q8_0 / Q4_0 blocks at load.

The head is the one matrix read whole on every decode step whatever the prompt: Gemma 3's
[262144 x 1152] is 1.21 GB in F32, 604 MB in BF16, 321 MB in Q8_0, 170 MB in Q4_0. Decode is
bound by the bytes it reads, so re-storing the head in a block format cuts the step by about
that difference. The embedding keeps its own (float) weight even when the head is tied to it:
an embedding lookup reads one row, and quantizing it would only add error.

The conversion runs in slabs of rows, so the load never holds a float32 copy of the head.
"""

from __future__ import annotations

import numpy as np

from pyml import quant
from pyml.core import perf
from pyml.core.errors import PymlError
from pyml.nn.linear import Linear, Weight
from pyml.quant import FLOAT_TYPES, QuantType

_perf = perf.get("pyml.nlp.head")

HEAD_TYPES = {"q8_0": QuantType.Q8_0, "q4_0": QuantType.Q4_0}
_SLAB_ROWS = 8192  # 8192 x 1152 float32 = 38 MB in flight


def quantize_head(model, kind: str) -> Linear:
    """Replace `model.lm_head` by the same matrix in `kind` blocks ("q8_0" or "q4_0")."""
    qtype = HEAD_TYPES.get(str(kind).lower())
    if qtype is None:
        raise PymlError(f"--lm-head-quant {kind!r}: use one of {', '.join(HEAD_TYPES)}")
    head = model.lm_head
    w = head.weight
    if w.qtype not in FLOAT_TYPES:
        raise PymlError(f"--lm-head-quant {kind}: the output head is already stored as {w.type_name}; "
                        f"the option re-stores float (F32/F16/BF16) heads only")
    n_rows, n_cols = w.shape
    block = quant.format_of(qtype).block_size
    if n_cols % block:
        raise PymlError(f"--lm-head-quant {kind}: the head's rows have {n_cols} values, "
                        f"not a multiple of the {qtype.name} block of {block}")
    with _perf.debug("head::quantize", "{} {}->{}", [n_rows, n_cols], w.type_name, qtype.name,
                     module=head.name, op="quantize"):
        blocks = np.empty((n_rows, quant.row_bytes(qtype, n_cols)), np.uint8)
        for r0 in range(0, n_rows, _SLAB_ROWS):
            r1 = min(n_rows, r0 + _SLAB_ROWS)
            blocks[r0:r1] = quant.quantize(w.rows(np.arange(r0, r1)), qtype)
    blocks.flags.writeable = False
    before, after = w.data.nbytes, blocks.nbytes
    _perf.logger.debug("lm_head: %s -> %s at load: %s -> %s bytes read per decode step (%.1f MB saved)",
                       w.type_name, qtype.name, f"{before:,}", f"{after:,}", (before - after) / 1e6)
    model.lm_head = Linear(Weight(blocks, qtype, (n_rows, n_cols)), head.bias, name=head.name)
    return model.lm_head
