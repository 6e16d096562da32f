"""float32 -> K-quant super-blocks (256 values) bit for bit as ggml's reference quantizers.

A port of quantize_row_q{2,3,4,5,6}_K_ref in ggml-quants.c (what llama-quantize runs without an
imatrix), with its helpers make_qkx2_quants, make_q3_quants and make_qx_quants. The arithmetic is
float32, operation by operation and in C's order (no fastmath: nothing fused or reassociated), and
every int -> float conversion is explicit, since Numba would widen float32 * int to float64.
`nearest_int` is ggml's 1.5*2^23 trick, i.e. round half to even, which is np.rint.
Every quantizer is `quantize(x [R, n] f32, out [R, n/256*type_size] u8) -> out`.

Block layouts (ggml-common.h; offsets in bytes, fp16 little-endian):
    Q2_K  84 B  scales[16] (lo nibble: scale, hi: min) | qs[64] 2-bit | d | dmin
                16 sub-blocks of 16: x = d*sc*q - dmin*mn
    Q3_K 110 B  hmask[32] (bit j//32 of hmask[j%32]: the 3rd bit) | qs[64] 2-bit | scales[12] | d
                16 sub-blocks of 16, 6-bit signed scales (lo nibbles in 0..7, hi pairs in 8..11):
                x = d*(sc-32)*(q-4)
    Q4_K 144 B  d | dmin | scales[12] (get_scale_min_k4) | qs[128]: x = d*sc*q - dmin*mn, 8 of 32
    Q5_K 176 B  d | dmin | scales[12] | qh[32] (5th bits: bit 2c / 2c+1 for chunk c) | qs[128]
    Q6_K 210 B  ql[128] | qh[64] | scales[16] i8 | d: x = d*sc*(q-32), 16 sub-blocks of 16
The 2-bit qs pack four quarter-blocks of 32: qs[32h + l] = L[128h+l] | L[..+32]<<2 | <<4 | <<6.
"""

from __future__ import annotations

import numba
import numpy as np

from pyml.core.simd import f32_to_half, half_to_f32
from pyml.quant.quantizers import put_half

QK_K = 256


@numba.njit
def _nearest_int(v):  # ggml's nearest_int (v + 1.5*2^23 in float32): round half to even
    return np.int32(np.rint(v))


@numba.njit
def _as_half(v):  # the float32 value an fp16 store keeps
    return half_to_f32(f32_to_half(v))


@numba.njit
def _make_qkx2_quants(nmax, x, weights, L, Laux, rmin, rdelta, nstep, use_mad):
    """Levels L in [0, nmax] and (scale, min) for x ~ scale*L - min, searched over nstep+1 scales
    for the least weighted error (squared, or absolute with use_mad). Returns (scale, the_min)."""
    n = x.shape[0]
    zero = np.float32(0.0)
    vmin, vmax = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < vmin:
            vmin = x[i]
        if x[i] > vmax:
            vmax = x[i]
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if vmin > 0:
        vmin = zero
    if vmax == vmin:
        L[:n] = 0
        return zero, -vmin
    fnmax = np.float32(nmax)
    iscale = fnmax / (vmax - vmin)
    scale = np.float32(1.0) / iscale
    best_error = zero
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest_int(iscale * (x[i] - vmin))))
        diff = scale * np.float32(L[i]) + vmin - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_error += weights[i] * diff
    if nstep < 1:
        return scale, -vmin
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + fnmax) / (vmax - vmin)
        sum_l, sum_l2, sum_xl = zero, zero, zero
        for i in range(n):
            level = max(0, min(nmax, _nearest_int(iscale * (x[i] - vmin))))
            Laux[i] = level
            fl, w = np.float32(level), weights[i]
            sum_l += w * fl
            sum_l2 += w * fl * fl
            sum_xl += w * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = zero
                this_scale = sum_xl / sum_l2
            cur_error = zero
            for i in range(n):
                diff = this_scale * np.float32(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur_error += weights[i] * diff
            if cur_error < best_error:
                L[:n] = Laux[:n]
                best_error = cur_error
                scale = this_scale
                vmin = this_min
    return scale, -vmin


@numba.njit
def _signed_amax(x):  # the value of largest |x|, the first on ties
    amax, vmax = np.float32(0.0), np.float32(0.0)
    for i in range(x.shape[0]):
        if abs(x[i]) > amax:
            amax, vmax = abs(x[i]), x[i]
    return vmax


@numba.njit
def _make_qx_quants(nmax, x, L):
    """Signed levels L-nmax in [-nmax, nmax) with weights x^2 (rmse_type 1, no imatrix): the scale
    of least weighted error over 19 trial scales around nmax/max (Q6_K's call)."""
    n = x.shape[0]
    zero = np.float32(0.0)
    vmax = _signed_amax(x)
    if abs(vmax) < np.float32(1e-15):  # GROUP_MAX_EPS: all zero
        L[:n] = 0
        return zero
    fnmax = np.float32(nmax)
    iscale = -fnmax / vmax
    sumlx, suml2 = zero, zero
    for i in range(n):
        level = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = level + nmax
        w, fl = x[i] * x[i], np.float32(level)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    scale = sumlx / suml2 if suml2 != 0 else zero
    best = scale * sumlx
    for trial in range(-9, 10):
        if trial == 0:
            continue
        iscale = -(fnmax + np.float32(0.1) * np.float32(trial)) / vmax
        sumlx, suml2 = zero, zero
        for i in range(n):
            fl = np.float32(max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i]))))
            w = x[i] * x[i]
            sumlx += w * x[i] * fl
            suml2 += w * fl * fl
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@numba.njit
def _make_q3_quants(nmax, x, L):
    """Signed levels in [-nmax, nmax) (stored +nmax) with weights x^2, refined level by level for up to
    5 passes (do_rmse): Q3_K's call. Returns the scale."""
    n = x.shape[0]
    zero = np.float32(0.0)
    vmax = _signed_amax(x)
    if abs(vmax) < np.float32(1e-15):  # GROUP_MAX_EPS: all zero
        L[:n] = 0
        return zero
    iscale = -np.float32(nmax) / vmax
    sumlx, suml2 = zero, zero
    for i in range(n):
        level = max(-nmax, min(nmax - 1, _nearest_int(iscale * x[i])))
        L[i] = level
        w, fl = x[i] * x[i], np.float32(level)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w, fl = x[i] * x[i], np.float32(L[i])
            slx = sumlx - w * x[i] * fl
            if slx > 0:
                sl2 = suml2 - w * fl * fl
                new_l = max(-nmax, min(nmax - 1, _nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    fnew = np.float32(new_l)
                    slx += w * x[i] * fnew
                    sl2 += w * fnew * fnew
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx, suml2 = slx, sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else zero


@numba.njit
def _pack_2bit(L, out, o):  # 256 levels (< 4) -> 64 bytes at o, four quarter-blocks per byte
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            out[o + 32 * h + l] = np.uint8(L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6))


@numba.njit
def _scale_min_k4(j, sc):  # Q4_K/Q5_K 6-bit (scale, min) of sub-block j from scales[12]
    if j < 4:
        return sc[j] & 63, sc[j + 4] & 63
    return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)


@numba.njit
def _q2_k_block(x, y, L, Laux, weights, scales, mins):  # x [256] f32 -> y [84] u8
    zero = np.float32(0.0)
    q4scale = np.float32(15.0)
    max_scale, max_min = zero, zero
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        for l in range(16):
            weights[l] = abs(xs[l])
        scales[j], mins[j] = _make_qkx2_quants(3, xs, weights, L[16 * j:16 * j + 16], Laux,
                                               np.float32(-0.5), np.float32(0.1), 15, True)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    sc = y[0:16]
    if max_scale > 0:
        iscale = q4scale / max_scale
        for j in range(16):
            sc[j] = np.uint8(_nearest_int(iscale * scales[j]) & 0xFF)
        put_half(y, 80, max_scale / q4scale)
    else:
        sc[:] = 0
        put_half(y, 80, zero)
    if max_min > 0:
        iscale = q4scale / max_min
        for j in range(16):
            sc[j] = np.uint8((sc[j] | (_nearest_int(iscale * mins[j]) << 4)) & 0xFF)
        put_half(y, 82, max_min / q4scale)
    else:
        put_half(y, 82, zero)
    d_all, dmin_all = _as_half(max_scale / q4scale if max_scale > 0 else zero), \
        _as_half(max_min / q4scale if max_min > 0 else zero)
    for j in range(16):
        d = d_all * np.float32(sc[j] & 0xF)
        if d == 0:
            continue
        dm = dmin_all * np.float32(sc[j] >> 4)
        for i in range(16):
            L[16 * j + i] = max(0, min(3, _nearest_int((x[16 * j + i] + dm) / d)))
    _pack_2bit(L, y, 16)


@numba.njit
def _q3_k_block(x, y, L, scales):  # x [256] f32 -> y [110] u8; L int8 scratch
    for j in range(16):
        scales[j] = _make_q3_quants(4, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
    max_scale = _signed_amax(scales)
    sc = y[96:108]
    sc[:] = 0
    if max_scale != 0:
        iscale = np.float32(-32.0) / max_scale
        for j in range(16):
            lv = max(-32, min(31, np.int32(np.int8(_nearest_int(iscale * scales[j]) & 0xFF)))) + 32
            if j < 8:
                sc[j] = np.uint8(lv & 0xF)
            else:
                sc[j - 8] |= np.uint8((lv & 0xF) << 4)
            sc[j % 4 + 8] |= np.uint8((lv >> 4) << (2 * (j // 4)))
        put_half(y, 108, np.float32(1.0) / iscale)
        d_all = _as_half(np.float32(1.0) / iscale)
    else:
        put_half(y, 108, np.float32(0.0))
        d_all = np.float32(0.0)
    for j in range(16):
        lo = np.int32(sc[j]) & 0xF if j < 8 else np.int32(sc[j - 8]) >> 4
        s = (lo | (((np.int32(sc[8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
        d = d_all * np.float32(s)
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-4, min(3, _nearest_int(x[16 * j + i] / d))) + 4
    hmask = y[0:32]
    hmask[:] = 0
    for j in range(QK_K):
        if L[j] > 3:
            hmask[j % 32] |= np.uint8(1 << (j // 32))
            L[j] -= 4
    _pack_2bit(L, y, 32)


@numba.njit
def _q45_k_scales(x, y, L, Laux, weights, scales, mins, nmax, rmin, nstep):
    """Q4_K/Q5_K's first half: per sub-block of 32 (scale, min) by make_qkx2_quants, their 6-bit codes
    into y[4:16], d and dmin into y[0:4]; then the levels L re-derived from the stored scales."""
    zero = np.float32(0.0)
    max_scale, max_min = zero, zero
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sum_x2 = zero
        for l in range(32):
            sum_x2 += xs[l] * xs[l]
        av_x = np.sqrt(sum_x2 / np.float32(32.0))
        for l in range(32):
            weights[l] = av_x + abs(xs[l])
        scales[j], mins[j] = _make_qkx2_quants(nmax, xs, weights, L[32 * j:32 * j + 32], Laux,
                                               rmin, np.float32(0.1), nstep, False)
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else zero
    inv_min = np.float32(63.0) / max_min if max_min > 0 else zero
    sc = y[4:16]
    sc[:] = 0
    for j in range(8):
        ls = min(63, _nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, _nearest_int(inv_min * mins[j]) & 0xFF)
        if j < 4:
            sc[j] = np.uint8(ls)
            sc[j + 4] = np.uint8(lm)
        else:
            sc[j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
            sc[j - 4] |= np.uint8((ls >> 4) << 6)
            sc[j] |= np.uint8((lm >> 4) << 6)
    put_half(y, 0, max_scale / np.float32(63.0))
    put_half(y, 2, max_min / np.float32(63.0))
    d_all, dmin_all = _as_half(max_scale / np.float32(63.0)), _as_half(max_min / np.float32(63.0))
    for j in range(8):
        s, m = _scale_min_k4(j, sc)
        d = d_all * np.float32(s)
        if d == 0:
            continue
        dm = dmin_all * np.float32(m)
        for i in range(32):
            L[32 * j + i] = max(0, min(nmax, _nearest_int((x[32 * j + i] + dm) / d)))


@numba.njit
def _q4_k_block(x, y, L, Laux, weights, scales, mins):  # x [256] f32 -> y [144] u8
    _q45_k_scales(x, y, L, Laux, weights, scales, mins, 15, np.float32(-1.0), 20)
    for c in range(4):  # chunk c: low nibbles sub-block 2c, high nibbles 2c+1
        for l in range(32):
            y[16 + 32 * c + l] = np.uint8(L[64 * c + l] | (L[64 * c + 32 + l] << 4))


@numba.njit
def _q5_k_block(x, y, L, Laux, weights, scales, mins):  # x [256] f32 -> y [176] u8
    _q45_k_scales(x, y, L, Laux, weights, scales, mins, 31, np.float32(-0.5), 15)
    qh = y[16:48]
    qh[:] = 0
    for c in range(4):
        for l in range(32):
            l1, l2 = L[64 * c + l], L[64 * c + 32 + l]
            if l1 > 15:
                l1 -= 16
                qh[l] |= np.uint8(1 << (2 * c))
            if l2 > 15:
                l2 -= 16
                qh[l] |= np.uint8(2 << (2 * c))
            y[48 + 32 * c + l] = np.uint8(l1 | (l2 << 4))


@numba.njit
def _q6_k_block(x, y, L, scales):  # x [256] f32 -> y [210] u8; L int8 scratch
    for j in range(16):
        scales[j] = _make_qx_quants(32, x[16 * j:16 * j + 16], L[16 * j:16 * j + 16])
    max_scale = _signed_amax(scales)
    if abs(max_scale) < np.float32(1e-15):  # GROUP_MAX_EPS: an all-zero block
        y[:] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    put_half(y, 208, np.float32(1.0) / iscale)
    d_all = _as_half(np.float32(1.0) / iscale)
    for j in range(16):
        y[192 + j] = np.uint8(min(127, _nearest_int(iscale * scales[j])) & 0xFF)
    for j in range(16):
        d = d_all * np.float32(np.int8(y[192 + j]))
        if d == 0:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, _nearest_int(x[16 * j + i] / d))) + 32
    for h in range(2):  # halves of 128: ql += 64, qh += 32
        for l in range(32):
            j = 128 * h + l
            q1, q2, q3, q4 = L[j], L[j + 32], L[j + 64], L[j + 96]
            y[64 * h + l] = np.uint8((q1 & 0xF) | ((q3 & 0xF) << 4))
            y[64 * h + 32 + l] = np.uint8((q2 & 0xF) | ((q4 & 0xF) << 4))
            y[128 + 32 * h + l] = np.uint8((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6))


@numba.njit(cache=True)
def _quantize_rows(x, out, kind):  # kind 2..6: Q{kind}_K; x [R, n] f32 -> out [R, n/256*type_size] u8
    size = out.shape[1] // (x.shape[1] // QK_K)
    L, Laux = np.zeros(QK_K, np.int32), np.zeros(32, np.int32)
    weights, scales, mins = np.zeros(32, np.float32), np.zeros(16, np.float32), np.zeros(16, np.float32)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // QK_K):
            xb, yb = x[r, QK_K * b:QK_K * (b + 1)], out[r, size * b:size * (b + 1)]
            if kind == 2:
                _q2_k_block(xb, yb, L, Laux, weights, scales, mins)
            elif kind == 3:
                _q3_k_block(xb, yb, L, scales)
            elif kind == 4:
                _q4_k_block(xb, yb, L, Laux, weights, scales, mins)
            elif kind == 5:
                _q5_k_block(xb, yb, L, Laux, weights, scales, mins)
            else:
                _q6_k_block(xb, yb, L, scales)
    return out


def quantize_q2_k(x, out):  # x [R, n] f32 -> out [R, n/256*84] u8
    return _quantize_rows(x, out, 2)


def quantize_q3_k(x, out):  # x [R, n] f32 -> out [R, n/256*110] u8
    return _quantize_rows(x, out, 3)


def quantize_q4_k(x, out):  # x [R, n] f32 -> out [R, n/256*144] u8
    return _quantize_rows(x, out, 4)


def quantize_q5_k(x, out):  # x [R, n] f32 -> out [R, n/256*176] u8
    return _quantize_rows(x, out, 5)


def quantize_q6_k(x, out):  # x [R, n] f32 -> out [R, n/256*210] u8
    return _quantize_rows(x, out, 6)
