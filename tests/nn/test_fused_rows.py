"""decode_rows (FusedStep.rows) on the block shapes no stand-in model has: q, k, v apart and gate and
up apart (their types differ), x8 and the file's layout, against the layer-by-layer batched path
over the same KVPool (TransformerBlock over a Batch, quant.decode_rows as forward_batch sets it).
The stand-in architectures are held to it in tests/nlp/test_batch_fused.py."""

import numpy as np
import pytest

from pyml import quant
from pyml.nn.batch import Batch
from pyml.nn.feed_forward import GatedMLP
from pyml.nn.fused import FusedStep
from pyml.nn.kv_cache import KVPool
from pyml.quant import QuantType
from tests.nn.test_fused import _linear, make_block

PROMPTS = [5, 2, 9]  # each sequence's prefill length: rows at their own positions


def _blocks(pack: bool):
    """Two blocks (Q4_0 with q, k, v apart), gate Q8_0 beside up Q4_0: both products apart."""
    blocks = []
    for i in range(2):
        b = make_block(QuantType.Q4_0, separate_qkv=True, seed=i, index=i)
        rng = np.random.default_rng(10 + i)
        d, f = b.attn_norm.weight.shape[0], b.ffn.down.in_features
        b.ffn = GatedMLP(_linear(rng, QuantType.Q8_0, f, d, "gate_proj"), _linear(rng, QuantType.Q4_0, f, d, "up_proj"),
                         b.ffn.down, "silu", name="mlp")
        assert not b.ffn.fused
        if pack:
            for lin in b.linears():
                lin.pack()
        blocks.append(b)
    return blocks


@pytest.mark.parametrize("pack", [True, False], ids=["x8", "file layout"])
def test_rows_with_products_apart_equal_layer_by_layer(pack):
    blocks = _blocks(pack)
    step = FusedStep(blocks, [b.fused() for b in blocks])
    assert step.runs[0][0].shape.n_proj == 3 and step.runs[0][0].shape.mlp == 2
    a, d = blocks[0].attn, blocks[0].attn_norm.weight.shape[0]
    pool = KVPool(len(PROMPTS), len(blocks), a.n_kv_heads, a.head_dim, 16, "f32")
    rng = np.random.default_rng(3)
    for s, n in enumerate(PROMPTS):  # each sequence's prompt, layer by layer
        x = rng.standard_normal((n, d)).astype(np.float32)
        for b in blocks:
            x = b(x, 0, pool.sequence(s))
    for step_i in range(2):
        rows = [(s, [0], n + step_i) for s, n in enumerate(PROMPTS)]
        batch = Batch(pool, rows)
        for s, end in zip(batch.decode_seqs.tolist(), batch.decode_ends.tolist()):
            pool.sequence(s).claim_layers(range(len(blocks)), end - 1)
        x = rng.standard_normal((len(rows), d)).astype(np.float32)
        ref = x
        with quant.decode_rows(len(rows)):
            for b in blocks:
                ref = b(ref, None, batch)
        got = step.rows(x, pool, batch.decode_seqs, batch.decode_ends)  # rewrites the same keys and values, then attends over them
        assert np.array_equal(got, ref), np.abs(got - ref).max()
