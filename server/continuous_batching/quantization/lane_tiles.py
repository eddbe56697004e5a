"""The tiled layout of ``cpu_kernels/qgemm_lanes.h``: a packed weight's rows in tiles of 16,
each tile's codes and scales interleaved so that one 64-byte load holds the 16 rows' next codes
(the rows are then the vector lanes of the matmul: ``qgemm_lanes.h`` on AVX512-VNNI, 16 rows a
register; ``qgemm_lanes_avx2.h`` on AVX2, each 64-byte vector as two halves of 8 rows).

Each tensor's bytes stay inside the tile's own rows: per tile, the scales [16, C] are stored
[C, 16]; 4-bit codes as [K/8, 16, 4] bytes whose low nibbles are codes 8p..8p+3 and high
nibbles 8p+4..8p+7 (same shape); 8-bit codes of Q5_K (0..31) as 5 bits: per 32 k, the low
nibbles of k-quads 0-7 as the 4-bit tiles, then a [16, 4] vector of their bit 4, k-quad q's at
bit q (rows of K * 5 / 8 bytes, ``bits`` 5); of Q6_K (-32..31 plus 32) as 6 bits: per 16 k,
the low nibbles of k-quads 0-1 and 2-3 as above, then a [16, 4] vector of their bits 4-5,
k-quad q's at bits 2q and 2q + 1 (rows of K * 3 / 4 bytes, ``bits`` 6).
``cpu_kernels.lane_tile_codes`` writes the codes; the functions here undo it (the reference
path dequantises the plain layout) and move the scales.
"""

from __future__ import annotations

import torch

#: Weight rows per tile: one 32-bit lane of a 512-bit register each.
LANE_ROWS = 16


def tile_rows(values: torch.Tensor) -> torch.Tensor:
    """[N, C] per-row values (scales, offsets) with each tile of 16 rows stored [C, 16]."""
    n, c = values.shape
    return values.view(n // LANE_ROWS, LANE_ROWS, c).transpose(1, 2).contiguous().view(n, c)


def _picked(tiled: torch.Tensor, rows: torch.Tensor | None, row_dim: int) -> torch.Tensor:
    """``tiled`` [tiles, ...] with a tile's row along ``row_dim``: the rows ``rows`` (all when
    None), each as [...] without its row dimension, stacked first."""
    if rows is None:
        rows = torch.arange(tiled.shape[0] * LANE_ROWS)
    index: list[torch.Tensor | slice] = [slice(None)] * tiled.dim()
    index[0], index[row_dim] = rows // LANE_ROWS, rows % LANE_ROWS
    return tiled[tuple(index)]


def untile_rows(values: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``tile_rows``: the rows ``rows`` (all when None) of the plain [N, C]."""
    n, c = values.shape
    return _picked(values.view(n // LANE_ROWS, c, LANE_ROWS), rows, 2).contiguous()


def untile_codes(
    codes: torch.Tensor, bits: int, code_offset: int = 0, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Tiled codes back in the packed layout (``packed_gguf``: 4-bit, uint8, byte j of a group
    of 32 holds elements j and j + 16; 5- and 6-bit tiles as 8-bit int8 codes, less
    ``code_offset``):
    the rows ``rows``, all when None (an embedding lookup untiles only its tokens' rows)."""
    n, row_bytes = codes.shape
    k = row_bytes * 8 // bits
    tiles = n // LANE_ROWS
    if bits == 5:
        blocks = _picked(codes.view(tiles, k // 32, 5, LANE_ROWS, 4), rows, 3).to(torch.int16)
        nibbles = torch.stack([blocks[:, :, :4] & 0x0F, blocks[:, :, :4] >> 4], dim=3)
        shifts = torch.arange(8, dtype=torch.int16).view(1, 1, 8, 1)
        high = (blocks[:, :, 4:5] >> shifts) & 1  # [rows, K/32, 8 quads, 4]
        values = (nibbles.reshape(-1, k // 32, 8, 4) | (high << 4)) - code_offset
        return values.reshape(-1, k).to(torch.int8)
    if bits == 6:
        blocks = _picked(codes.view(tiles, k // 16, 3, LANE_ROWS, 4), rows, 3).to(torch.int16)
        nibbles = torch.stack(  # [rows, K/16, 4 quads, 4]
            [
                blocks[:, :, 0] & 0x0F,
                blocks[:, :, 0] >> 4,
                blocks[:, :, 1] & 0x0F,
                blocks[:, :, 1] >> 4,
            ],
            dim=2,
        )
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16).view(1, 1, 4, 1)
        high = (blocks[:, :, 2:3] >> shifts) & 3
        values = (nibbles | (high << 4)) - code_offset
        return values.reshape(-1, k).to(torch.int8)
    octets = _picked(codes.view(tiles, k // 8, LANE_ROWS, 4), rows, 2)  # [rows, K/8, 4]
    halves = torch.stack([octets & 0x0F, octets >> 4], dim=2)  # k = 8p + 4h + j
    values = halves.reshape(-1, k // 32, 2, 16)
    return (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(-1, k // 2)
