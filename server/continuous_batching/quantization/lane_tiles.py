"""The tiled layout of ``cpu_kernels/qgemm_lanes.h``: a packed weight's rows in tiles of 16,
each tile's codes and scales interleaved so that one 64-byte load holds the 16 rows' next codes
(the rows are then the vector lanes of the AVX512-VNNI matmul).

Each tensor's bytes stay inside the tile's own rows: per tile, the scales [16, C] are stored
[C, 16]; 4-bit codes as [K/8, 16, 4] bytes whose low nibbles are codes 8p..8p+3 and high
nibbles 8p+4..8p+7 (same shape); 8-bit codes (Q5_K's 0..31, Q6_K's -32..31 plus 32) as 6
bits: per 16 k, the low nibbles of k-quads 0-1 and 2-3 as above, then a [16, 4] vector of
their bits 4-5, k-quad q's at bits 2q and 2q + 1 (rows of K * 3 / 4 bytes, ``bits`` 6).
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


def untile_rows(values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``tile_rows``."""
    n, c = values.shape
    return values.view(n // LANE_ROWS, c, LANE_ROWS).transpose(1, 2).contiguous().view(n, c)


def untile_codes(codes: torch.Tensor, bits: int, code_offset: int = 0) -> torch.Tensor:
    """Tiled codes back in the packed layout (``packed_gguf``: 4-bit, uint8, byte j of a group
    of 32 holds elements j and j + 16; 6-bit tiles as 8-bit int8 codes, less ``code_offset``)."""
    n, row_bytes = codes.shape
    k = row_bytes * 8 // bits
    tiles = n // LANE_ROWS
    if bits == 6:
        blocks = codes.view(tiles, k // 16, 3, LANE_ROWS, 4).to(torch.int16)
        nibbles = torch.stack(
            [
                blocks[:, :, 0] & 0x0F,
                blocks[:, :, 0] >> 4,
                blocks[:, :, 1] & 0x0F,
                blocks[:, :, 1] >> 4,
            ],
            dim=2,
        )
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int16).view(1, 1, 4, 1, 1)
        high = (blocks[:, :, 2:3] >> shifts) & 3  # [tiles, K/16, 4 quads, 16, 4]
        values = (nibbles | (high << 4)) - code_offset
        return values.permute(0, 3, 1, 2, 4).reshape(n, k).to(torch.int8).contiguous()
    octets = codes.view(tiles, k // 8, LANE_ROWS, 4)
    halves = torch.stack([octets & 0x0F, octets >> 4], dim=3)  # [tiles, K/8, 16, 2, 4]
    values = halves.permute(0, 2, 1, 3, 4).reshape(n, k // 32, 2, 16)
    return (values[:, :, 0] | (values[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
