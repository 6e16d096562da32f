"""RoPE against a float64 rotation written out here: both pairings, a partial rotary_dim, and
the prefill's shared cos/sin table (one table per (pos, T), remade when either changes)."""

import numpy as np
import pytest

from pyml.nn.rope import RoPE


def _rotated(x, pos, base, rotary_dim, interleaved):
    """x [T, H, hd] rotated in float64: pair k turns by (pos + t) / base^(2k / rotary_dim)."""
    T, _, hd = x.shape
    half = rotary_dim // 2
    angle = (pos + np.arange(T))[:, None] / base ** (np.arange(half) * 2.0 / rotary_dim)[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    y = x.astype(np.float64)
    a_idx = np.arange(0, rotary_dim, 2) if interleaved else np.arange(half)
    b_idx = a_idx + 1 if interleaved else a_idx + half
    a, b = y[..., a_idx].copy(), y[..., b_idx].copy()
    y[..., a_idx], y[..., b_idx] = a * c - b * s, b * c + a * s
    return y


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("hd, rotary_dim", [(16, 16), (24, 8)])
def test_prefill_and_decode_match_the_float64_rotation(style, hd, rotary_dim):
    rope = RoPE(hd, 500.0, style=style, rotary_dim=rotary_dim)
    rng = np.random.default_rng(3)
    for pos, T, H in [(0, 37, 3), (37, 1, 3), (5, 37, 1), (0, 37, 3)]:  # the table made, reused, remade
        x = rng.standard_normal((T, H, hd), dtype=np.float32)
        want = _rotated(x, pos, 500.0, rotary_dim, style == "interleaved")
        got = rope(x.copy(), pos)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * (1 + pos + T))
        if rotary_dim < hd:
            np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_a_shared_table_is_remade_for_new_positions():
    rope = RoPE(8, 10000.0)
    x = np.ones((4, 2, 8), np.float32)
    first = rope(x.copy(), 0)
    later = rope(x.copy(), 100)
    np.testing.assert_allclose(later, _rotated(x, 100, 10000.0, 8, False), atol=1e-4)
    assert not np.allclose(first, later)


def test_the_decode_steps_angles_are_remade_when_the_position_or_the_frequencies_change():
    """decode_recipe._rope_angles keeps one position's cos and sin for a step's layers: each call
    must leave the angles of its own position and frequencies, whatever the buffers held before."""
    import numba

    from pyml.nn.decode_recipe import _rope_angles

    @numba.njit
    def angles(pos, inv_freq, rot, rot_of):
        _rope_angles(pos, inv_freq, rot, rot_of)

    local, wide = (1.0 / base ** (np.arange(0, 16, 2) / 16.0) for base in (10_000.0, 1_000_000.0))
    rot, rot_of = np.zeros((2, 1, 8), np.float32), np.full(9, np.nan)
    # each call after the first repeats or changes one of the two (a key missing either fails)
    for pos, inv_freq in [(5, local), (5, local), (6, local), (6, wide), (6, local), (0, local), (5, local)]:
        angles(pos, inv_freq, rot, rot_of)
        np.testing.assert_allclose(rot[0, 0], np.cos(pos * inv_freq), rtol=0, atol=1e-7)
        np.testing.assert_allclose(rot[1, 0], np.sin(pos * inv_freq), rtol=0, atol=1e-7)
