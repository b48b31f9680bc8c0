"""Block dequantizers, one per GGUF weight type: uint8 blocks [B, block_bytes] → float32 [B, block_elems].

Each follows gguf-py's NumPy twin (`gguf/quants.py`) operation for operation, so the results are
bit-identical to `gguf.quants.dequantize`: float32 math, products rounded in the same order (the
K-quants compute (d·sc)·q − dmin·m, never a fused multiply-add). Layouts from ggml-common.h; K-quant
super-blocks hold 256 weights (QK_K). Block fields are read as byte columns; a field of several
bytes is copied to its own contiguous tensor, then reinterpreted (little-endian, as GGUF stores it).
"""

from __future__ import annotations

import torch

QK_K = 256
# IQ4_NL's 16 non-uniform levels (kvalues_iq4nl in ggml-common.h).
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_IQ4_NL_LEVELS = torch.tensor(IQ4_NL_LEVELS, dtype=torch.float32)
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).to(torch.uint8)  # [256, 8], lowest bit first


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, as float32 [B, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed uint8 [R, n] → each byte's `bits`-wide fields, lowest first: uint8 [R, 8/bits, n].

    Shifts and masks four bytes at a time as int32 words (10x faster than uint8 ops that broadcast).
    """
    packed = packed.contiguous()
    if packed.storage_offset() % 4 or packed.stride(0) % 4:  # one row sliced from a block: a fresh copy
        packed = torch.empty(packed.shape, dtype=packed.dtype).copy_(packed)
    words = packed.view(torch.int32)
    mask = int.from_bytes(bytes([(1 << bits) - 1] * 4), "little")
    fields = torch.empty(packed.shape[0], 8 // bits, words.shape[1], dtype=torch.int32)
    for i in range(8 // bits):
        torch.bitwise_and(words >> (i * bits), mask, out=fields[:, i])
    return fields.view(torch.uint8)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [B, 16] → [B, 32]: the low nibbles (weights 0–15), then the high ones (16–31)."""
    return _fields(qs, 4).reshape(qs.shape[0], 32)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """qh [B, 4] (a little-endian uint32) → its 32 bits [B, 32], bit j at column j."""
    return _BYTE_BITS.index_select(0, qh.reshape(-1).int()).view(qh.shape[0], 32)


def f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()  # the top half of a float32: exact


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; i8 qs[32] → d·q."""
    return blocks[:, 2:].view(torch.int8).float().mul_(_f16(blocks, 0))


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; u8 qs[16] (low nibbles are weights 0–15, high 16–31) → d·(q − 8)."""
    return _nibbles(blocks[:, 2:]).float().sub_(8).mul_(_f16(blocks, 0))


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; f16 m; u8 qs[16] → d·q + m."""
    return _nibbles(blocks[:, 4:]).float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; u32 qh (bit j = bit 4 of weight j); u8 qs[16] → d·(q − 16)."""
    q = _nibbles(blocks[:, 6:]) | (_bits32(blocks[:, 2:6]) << 4)
    return q.float().sub_(16).mul_(_f16(blocks, 0))


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; f16 m; u32 qh; u8 qs[16] → d·q + m."""
    q = _nibbles(blocks[:, 8:]) | (_bits32(blocks[:, 4:8]) << 4)
    return q.float().mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; u8 qs[16] as in Q4_0 → d·LEVELS[q]."""
    q = _nibbles(blocks[:, 2:]).reshape(-1).int()
    return _IQ4_NL_LEVELS.index_select(0, q).view(-1, 32).mul_(_f16(blocks, 0))


def block_codes(blocks: torch.Tensor, type_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks [B, bytes] of a 32-weight type → their codes int8 [B, 32], scales d float32 [B] and,
    for the types with a min (Q4_1 3, Q5_1 7), the mins m float32 [B]: weight = d·code (+ m). The
    symmetric types (Q8_0 8, Q4_0 2, Q5_0 6, IQ4_NL 20) have signed codes and no min (None); these
    are what the 8-bit-activation integer dot multiplies."""
    m = None
    if type_id == 8:
        q = blocks[:, 2:].contiguous().view(torch.int8)
    elif type_id == 2:
        q = (_nibbles(blocks[:, 2:]).to(torch.int16) - 8).to(torch.int8)
    elif type_id == 6:
        q = ((_nibbles(blocks[:, 6:]) | (_bits32(blocks[:, 2:6]) << 4)).to(torch.int16) - 16).to(torch.int8)
    elif type_id == 20:
        q = _IQ4_NL_LEVELS.index_select(0, _nibbles(blocks[:, 2:]).reshape(-1).int()).view(-1, 32).to(torch.int8)
    elif type_id == 3:
        q, m = _nibbles(blocks[:, 4:]).to(torch.int8), _f16(blocks, 2).reshape(-1)
    elif type_id == 7:
        q = (_nibbles(blocks[:, 8:]) | (_bits32(blocks[:, 4:8]) << 4)).to(torch.int8)
        m = _f16(blocks, 2).reshape(-1)
    else:
        raise ValueError(f"ggml type {type_id} is not a 32-weight type (Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1)")
    return q, _f16(blocks, 0).reshape(-1), m


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes → 6-bit (scale, min) of the 8 sub-blocks, each [B, 8] uint8.

    Bytes 0–3 hold scales 0–3 (low 6 bits), bytes 4–7 mins 0–3; sub-blocks 4–7 keep their low 4
    bits in bytes 8–11 (scale low nibble, min high nibble) and their top 2 bits in the spare top
    bits of bytes 0–3 (scales) and 4–7 (mins) — `get_scale_min_k4`.
    """
    s = scales.reshape(-1, 3, 4)
    lo, hi, rest = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 63, (rest & 15) | ((lo >> 2) & 48)], dim=-1)
    mn = torch.cat([hi & 63, (rest >> 4) | ((hi >> 2) & 48)], dim=-1)
    return sc, mn


def q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks → q in 0..15 per sub-block, uint8 [B, 8, 32]: 32-byte chunk c of qs holds
    sub-block 2c in its low nibbles, 2c+1 in its high ones."""
    return _fields(blocks[:, 16:].reshape(-1, 32), 4).view(-1, 8, 32)


def q5_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks → q in 0..31, uint8 [B, 8, 32]: Q4_K's nibbles (qs after qh[32]) with bit 4 of
    weight l of sub-block j at bit j of qh[l]."""
    low = _fields(blocks[:, 48:].reshape(-1, 32), 4).view(-1, 8, 32)
    return low | (_fields(blocks[:, 16:48], 1) << 4)


def q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks → unsigned q in 0..63 (the weight is q − 32), uint8 [B, 16, 16].

    Per 128-weight half: ql's 64 bytes give weights 0–63 (low nibbles) and 64–127 (high); qh's 32
    bytes give their top 2 bits, weights 32i..32i+31 from bits 2i, 2i+1.
    """
    low = _fields(blocks[:, :128].reshape(-1, 64), 4).view(-1, 16, 16)
    high = _fields(blocks[:, 128:192].reshape(-1, 32), 2).view(-1, 16, 16)
    return low | (high << 4)


def q2_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks (u8 scales[16], qs[64], f16 d, dmin) → q in 0..3, uint8 [B, 16, 16].

    Per 128-weight half h, qs bytes 32h..32h+31 give weights 32j..32j+31 of the half from bits 2j,
    2j+1: weight 128h + 32j + l from byte 32h + l (`dequantize_row_q2_K`)."""
    return _fields(blocks[:, 16:80].reshape(-1, 32), 2).view(-1, 16, 16)


def q3_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks (u8 hmask[32], qs[64], scales[12], f16 d) → unsigned q in 0..7 (the weight is
    q − 4), uint8 [B, 16, 16]: Q2_K's 2-bit fields of qs, bit 2 from hmask, weight 32b + l (b the
    128-weight half times 4 plus the qs field) at bit b of hmask[l]. llama.cpp subtracts 4 where
    that bit is clear, so the bit is the code's bit 2."""
    low = _fields(blocks[:, 32:96].reshape(-1, 32), 2).view(-1, 16, 16)
    high = _fields(blocks[:, :32], 1).view(-1, 16, 16)
    return low | (high << 2)


def q3_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes → the 16 signed 6-bit scales, int32 [B, 16]: scale j's low 4 bits are
    the low (j < 8) or high (j >= 8) nibble of byte j % 8, its top 2 bits bits 2·(j // 4) of byte
    8 + j % 4; the stored value is offset by 32."""
    sc = blocks[:, 96:108].int()
    low = torch.cat([sc[:, :8] & 15, sc[:, :8] >> 4], dim=1)
    high = (sc[:, 8:12].repeat(1, 4) >> torch.arange(0, 8, 2).repeat_interleave(4)) & 3
    return (low | (high << 4)) - 32


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """u8 scales[16] (scale low nibble, min high); u8 qs[64]; f16 d; f16 dmin → (d·sc_j)·q −
    dmin·m_j over 16 sub-blocks of 16."""
    sc = blocks[:, :16]
    scale = (_f16(blocks, 80) * (sc & 15).float())[:, :, None]
    offset = (_f16(blocks, 82) * (sc >> 4).float())[:, :, None]
    return q2_k_codes(blocks).float().mul_(scale).sub_(offset).view(-1, QK_K)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d → (d·sc_j)·(q − 4) over 16 sub-blocks of 16."""
    scale = (_f16(blocks, 108) * q3_k_scales(blocks).float())[:, :, None]
    return q3_k_codes(blocks).float().sub_(4).mul_(scale).view(-1, QK_K)


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """(d·sc_j)·q − dmin·m_j over 8 sub-blocks of 32; q [B, 8, 32] uint8."""
    sc, mn = k_scales(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * sc.float())[:, :, None]
    offset = (_f16(blocks, 2) * mn.float())[:, :, None]
    return q.float().mul_(scale).sub_(offset).view(-1, QK_K)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """f16 d; f16 dmin; u8 scales[12]; u8 qs[128] → (d·sc_j)·q − dmin·m_j."""
    return _k_affine(blocks, q4_k_codes(blocks))


def _q4_k_r_order() -> torch.Tensor:
    """Byte i of a repacked Q4_K block is byte `order[i]` of the Q4_K block: d, dmin and the scales in
    place; code chunk c's 4-byte group j is Q4_K chunk j % 4's group 2c + j // 4 (`csrc/kquant.cpp`
    `Q4KR`: a chunk's lanes then hold different sub-blocks)."""
    order = list(range(16))
    for c in range(4):
        for j in range(8):
            at = 16 + 32 * (j % 4) + 4 * (2 * c + j // 4)
            order.extend(range(at, at + 4))
    return torch.tensor(order)


Q4_K_R_ORDER = _q4_k_r_order()
Q4_K_ORDER_OF_R = torch.argsort(Q4_K_R_ORDER)


def repack_q4_k(rows: torch.Tensor) -> torch.Tensor:
    """Q4_K rows uint8 [..., nb·144] → the same blocks repacked for the one-row kernel (a copy)."""
    return rows.reshape(*rows.shape[:-1], -1, 144)[..., Q4_K_R_ORDER].reshape(rows.shape)


def unrepack_q4_k(rows: torch.Tensor) -> torch.Tensor:
    """`repack_q4_k` undone: the Q4_K blocks, byte for byte."""
    return rows.reshape(*rows.shape[:-1], -1, 144)[..., Q4_K_ORDER_OF_R].reshape(rows.shape)


def q4_k_r(blocks: torch.Tensor) -> torch.Tensor:
    """Repacked Q4_K blocks (`repack_q4_k`) → the weights Q4_K's would give."""
    return q4_k(unrepack_q4_k(blocks))


def _k_pack_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`k_scales` undone: 6-bit (scale, min) [B, 8] each → Q4_K's 12 scale bytes [B, 12]."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    hi = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    rest = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return torch.cat([lo, hi, rest], dim=-1)


def _tiles(rows: torch.Tensor, name: str = "Q4_K", block_bytes: int = 144) -> tuple[int, int]:
    """(tiles, super-blocks a row) of K-quant rows [..., N, nb·block_bytes] taken 16 at a time (so
    experts [E, N, ·] tile each expert's rows alike); ValueError otherwise."""
    if rows.dim() < 2 or rows.shape[-2] % 16 or rows.shape[-1] % block_bytes:
        need = f"need uint8 [..., 16·n, nb·{block_bytes}], got {tuple(rows.shape)}"
        raise ValueError(f"{name} rows tile 16 at a time: {need}")
    return rows[..., 0].numel() // 16, rows.shape[-1] // block_bytes


def tile_q4_k(rows: torch.Tensor) -> torch.Tensor:
    """Q4_K rows uint8 [N, nb·144] (N a multiple of 16) → the same bytes tiled by 16 rows for the
    16-lane kernel (`csrc/kquant.cpp`, `kQ4KT`): per tile and super-block, 2304 bytes: the 16 rows'
    d, then their dmin (fp16 each), then 16 values (sc_0..7, m_0..7) of 12 bytes, row r's 6 bits at
    bits 6r..6r+5, then 32 groups (c, g) of 64 bytes, row r's Q4_K code bytes 32c + 4g .. +3 at 4r."""
    tiles, nb = _tiles(rows)
    b = rows.reshape(tiles, 16, nb, 144).transpose(1, 2).reshape(-1, 144)  # [tiles·nb·16, 144]
    sc, mn = k_scales(b[:, 4:16])
    values = torch.cat([sc, mn], dim=-1).view(-1, 16, 16).transpose(1, 2)  # [tiles·nb, value, row]
    bits = _BYTE_BITS.index_select(0, values.reshape(-1).int())[:, :6].reshape(-1, 16, 96)
    packed = (bits.view(-1, 16, 12, 8).int() << torch.arange(8)).sum(-1).to(torch.uint8)
    b = b.view(-1, 16, 144)
    codes = b[:, :, 16:].reshape(-1, 16, 4, 8, 4).permute(0, 2, 3, 1, 4)  # [.., c, g, row, 4]
    tile = torch.cat(
        [b[:, :, 0:2].reshape(-1, 32), b[:, :, 2:4].reshape(-1, 32), packed.reshape(-1, 192), codes.reshape(-1, 2048)],
        dim=-1,
    )
    return tile.reshape(rows.shape)


def untile_q4_k(rows: torch.Tensor) -> torch.Tensor:
    """`tile_q4_k` undone: the Q4_K rows, byte for byte."""
    tiles, nb = _tiles(rows)
    t = rows.reshape(-1, 2304)
    d, dmin = t[:, 0:32].reshape(-1, 16, 2), t[:, 32:64].reshape(-1, 16, 2)
    bits = _BYTE_BITS.index_select(0, t[:, 64:256].reshape(-1).int()).view(-1, 16, 16, 6)  # [.., value, row, bit]
    values = (bits.int() << torch.arange(6)).sum(-1).to(torch.uint8).transpose(1, 2).reshape(-1, 16)
    scales = _k_pack_scales(values[:, :8], values[:, 8:]).view(-1, 16, 12)
    codes = t[:, 256:].reshape(-1, 4, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(-1, 16, 128)
    b = torch.cat([d, dmin, scales, codes], dim=-1)  # [tiles·nb, row, 144]
    return b.view(tiles, nb, 16, 144).transpose(1, 2).reshape(rows.shape)


def q4_k_t(blocks: torch.Tensor) -> torch.Tensor:
    """Tiled Q4_K blocks cannot be read a block at a time: `traits.dequantize` untiles whole rows."""
    raise ValueError("Q4_K_T blocks are tiled across 16 rows: dequantize them as rows (traits.dequantize)")


def _q6_k_order() -> tuple[torch.Tensor, torch.Tensor]:
    """Where a tiled Q6_K super-block's code groups take their weights: for group m's two nibble
    vectors, weights [m, half (low, high nibble), n - 2m, i] (4n + i and 128 + 4n + i); for its top
    bits, weights [m, k, i] (8m + i, 8m + 4 + i, 128 + 8m + i, 128 + 8m + 4 + i)."""
    m, i = torch.arange(16)[:, None, None], torch.arange(4)
    nib = torch.stack([8 * m + 4 * torch.arange(2)[:, None] + i, 128 + 8 * m + 4 * torch.arange(2)[:, None] + i], 1)
    top = torch.stack([8 * m[:, 0] + i, 8 * m[:, 0] + 4 + i, 128 + 8 * m[:, 0] + i, 132 + 8 * m[:, 0] + i], 1)
    return nib, top


def tile_q6_k(rows: torch.Tensor) -> torch.Tensor:
    """Q6_K rows uint8 [N, nb·210] (N a multiple of 16) → the same bytes tiled by 16 rows for the
    16-lane kernel (`csrc/kquant.cpp`, `kQ6KT`): per tile and super-block, 3360 bytes: the 16 rows'
    d (fp16), their scales (sub-block j's 16 at 32 + 16j), then 16 groups m of 192 bytes: two
    vectors of low nibbles (row r's 4 bytes at 4r; byte i: weight 4n + i low, 128 + 4n + i high,
    n = 2m, 2m + 1), one of top 2 bits (byte i, bits 2k: weights 8m + i, 8m + 4 + i, 128 + 8m + i,
    132 + 8m + i)."""
    tiles, nb = _tiles(rows, "Q6_K", 210)
    b = rows.reshape(tiles, 16, nb, 210).transpose(1, 2).reshape(-1, 16, 210)  # [tiles·nb, row, 210]
    codes = q6_k_codes(b.reshape(-1, 210)).view(-1, 16, 256)  # [.., row, weight]
    nib_at, top_at = _q6_k_order()
    nib = codes[:, :, nib_at.flatten()].view(-1, 16, 16, 2, 2, 4)  # [.., row, m, half, n', i]
    nib = (nib[:, :, :, 0] & 15) | ((nib[:, :, :, 1] & 15) << 4)  # [.., row, m, n', i]
    top = (codes[:, :, top_at.flatten()].view(-1, 16, 16, 4, 4) >> 4) << (2 * torch.arange(4))[:, None].to(torch.uint8)
    top = top.sum(3, dtype=torch.uint8)  # [.., row, m, i]: the 4 fields are disjoint bits
    groups = torch.cat([nib.permute(0, 2, 3, 1, 4), top[:, :, :, None].permute(0, 2, 3, 1, 4)], 2)  # [.., m, 3, row, 4]
    scales = b[:, :, 192:208].transpose(1, 2)  # [.., j, row]
    tile = torch.cat([b[:, :, 208:210].reshape(-1, 32), scales.reshape(-1, 256), groups.reshape(-1, 3072)], dim=-1)
    return tile.reshape(rows.shape)


def untile_q6_k(rows: torch.Tensor) -> torch.Tensor:
    """`tile_q6_k` undone: the Q6_K rows, byte for byte."""
    tiles, nb = _tiles(rows, "Q6_K", 210)
    t = rows.reshape(-1, 3360)
    groups = t[:, 288:].reshape(-1, 16, 3, 16, 4).permute(0, 3, 1, 2, 4)  # [.., row, m, 3, i]
    nib_at, top_at = _q6_k_order()
    codes = torch.zeros(t.shape[0], 16, 256, dtype=torch.uint8)
    nib = groups[:, :, :, :2]  # [.., row, m, n', i]
    codes[:, :, nib_at[:, 0].flatten()] = (nib & 15).reshape(-1, 16, 128)
    codes[:, :, nib_at[:, 1].flatten()] = (nib >> 4).reshape(-1, 16, 128)
    top = (groups[:, :, :, 2, None] >> (2 * torch.arange(4))[:, None].to(torch.uint8)) & 3  # [.., row, m, k, i]
    codes[:, :, top_at.flatten()] |= (top << 4).reshape(-1, 16, 256)
    # ggml's packing (`q6_k_codes` undone): weight 128h + 32i + l in ql[64h + l + 32(i & 1)] at
    # bits 4(i >> 1) and qh[32h + l] at bits 2i
    c = codes.view(-1, 16, 2, 4, 32)  # [.., row, h, i, l]
    low, high = c & 15, c >> 4
    ql = torch.cat([low[:, :, :, 0] | (low[:, :, :, 2] << 4), low[:, :, :, 1] | (low[:, :, :, 3] << 4)], -1)
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
    scales = t[:, 32:288].reshape(-1, 16, 16).transpose(1, 2)  # [.., row, j]
    b = torch.cat([ql.reshape(-1, 16, 128), qh.reshape(-1, 16, 64), scales, t[:, :32].reshape(-1, 16, 2)], -1)
    return b.view(tiles, nb, 16, 210).transpose(1, 2).reshape(rows.shape)


def q6_k_t(blocks: torch.Tensor) -> torch.Tensor:
    """Tiled Q6_K blocks cannot be read a block at a time: `traits.dequantize` untiles whole rows."""
    raise ValueError("Q6_K_T blocks are tiled across 16 rows: dequantize them as rows (traits.dequantize)")


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """As Q4_K with qh[32] before qs: 5-bit q."""
    return _k_affine(blocks, q5_k_codes(blocks))


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d (last) → d·sc_j·(q − 32) over 16 sub-blocks of 16."""
    scale = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()
    return q6_k_codes(blocks).float().sub_(32).mul_(scale[:, :, None]).view(-1, QK_K)
