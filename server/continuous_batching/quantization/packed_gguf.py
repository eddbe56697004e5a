"""GGUF quantised matrices repacked, exactly, into the one layout our CPU kernels read
(``cpu_kernels/qgemm.h``): they stay quantised in memory and are dequantised inside the matmul.

The layout, per weight row (an output feature), K along the row in groups of G weights:

* ``codes``: 4-bit (two a byte: byte j of a group holds element j in its low nibble and
  element j + G/2 in its high one, G = 32) or 8-bit (int8, one a byte);
* per group an integer-or-fp16 ``group_scale`` and optional ``group_offset``; with
  ``super_scale`` (float32, one per super-block of S groups) a group's scale is
  ``super_scale * group_scale`` (K-quants' ``d * sc``), likewise the offset;
* value = scale * code - offset, in float32: the same products ``gguf.quants.dequantize``
  computes, so every weight matches it bit for bit.

How each source type maps onto it (bytes per 256 weights: source -> packed):

=======  ===========================================  ============
Q8_0     int8 codes, scale = d (fp16)                 272 -> 272
Q4_0     4-bit codes, scale = d, offset = 8 d (fp16)  144 -> 160
Q4_1     4-bit codes, scale = d, offset = -m (fp16)   160 -> 160
Q4_K     4-bit codes, d*sc, dmin*m (6-bit sc, m)      144 -> 152
Q5_K     8-bit codes (0..31), as Q4_K                 176 -> 280
Q6_K     int8 codes q-32, G = 16, d*sc (int8 sc)      210 -> 276
=======  ===========================================  ============

Every repacker is vectorised over all blocks of a tensor (no Python loop over blocks).

On AVX512-VNNI and AVX2 builds the super-block layouts (Q4_K, Q5_K, Q6_K, GPTQ g128) are then
tiled for the kernels that keep the weight rows in the vector lanes (``lane_tiled``,
``lane_tiles``), with the super-block scales and offsets as fp16 where that is exact (the
K-quants' d and dmin are the file's fp16): Q4_K 148 bytes per 256 weights there (the file:
144), Q5_K (5-bit codes) 180 (176), Q6_K (6-bit codes) 210, the file's own size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from .lane_tiles import LANE_ROWS, tile_rows, untile_codes, untile_rows

#: Source types that repack exactly into the layout (others are dequantised at load).
PACKABLE_TYPES: frozenset[T] = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K})
_SUPER = 256  # K-quants' super-block


@dataclass(frozen=True)
class PackedWeight:
    """A [num_rows, in_features] matrix in the packed layout (see the module docstring)."""

    source: str
    codes: torch.Tensor
    bits: int
    group: int
    group_scale: torch.Tensor
    group_offset: torch.Tensor | None = None
    super_scale: torch.Tensor | None = None
    super_offset: torch.Tensor | None = None
    #: Rows in tiles of 16 for the AVX512-VNNI and AVX2 kernels (``lane_tiles``; ``lane_tiled``).
    is_lane_tiled: bool = False

    @property
    def num_rows(self) -> int:
        """Output features."""
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        """K, the length of a row."""
        return self.codes.shape[1] * 8 // self.bits

    @property
    def num_bytes(self) -> int:
        """Bytes held (codes and scales)."""
        parts = [self.codes, self.group_scale, self.group_offset]
        parts += [self.super_scale, self.super_offset]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    @property
    def activation_group(self) -> int:
        """How many of x's values share one int8 scale when the int8-activation kernel runs
        this weight: a whole super-block where the group scales are small integers under a
        float32 super scale (Q4_K, Q5_K, Q6_K, GPTQ g128: ``cpu_kernels/qgemm_super.h`` sums
        the super-block in integers), else one weight group."""
        if self.super_scale is None:
            return self.group
        per_super = self.group_scale.shape[1] // self.super_scale.shape[1]
        span = self.group * per_super
        has_offset = self.group_offset is not None
        if has_offset and (self.group_offset.dtype != torch.uint8 or self.super_offset is None):
            return self.group
        is_unsigned = self.group_scale.dtype == torch.uint8 and has_offset
        is_signed = self.group_scale.dtype == torch.int8 and not has_offset
        # The layouts of ``with_super_layout`` (qgemm_super.h): Q4_K and GPTQ int4 g128, Q5_K;
        # Q6_K.
        unsigned_layouts = ((4, 8), (4, 4), (8, 8))
        bits = 8 if self.bits in (5, 6) else self.bits  # 5- and 6-bit tiles hold 8-bit codes
        is_super = (is_unsigned and self.group == 32 and (bits, per_super) in unsigned_layouts) or (
            is_signed and bits == 8 and self.group == 16 and per_super == 16
        )
        return span if is_super and self.in_features % span == 0 else self.group

    @property
    def can_lane_tile(self) -> bool:
        """True when the tiled layout of ``lane_tiles`` can hold this weight: a super-block
        layout (integer sums per super-block) with rows in whole tiles of 16."""
        is_super = self.activation_group != self.group
        return is_super and self.num_rows % LANE_ROWS == 0 and not self.is_lane_tiled

    @property
    def _code_offset(self) -> int:
        """What 8-bit codes gain as tiles: Q6_K's signed codes (int8 group scales) + 32."""
        return 32 if self.group_scale.dtype == torch.int8 else 0

    def lane_tiled(self, kernels: ModuleType) -> PackedWeight:
        """This weight in the tiled layout (``kernels``: a build with ``lane_tile_codes``);
        8-bit codes as 5-bit tiles where they fit in groups of 32 (Q5_K), else as 6-bit tiles
        where they fit (Q6_K plus 32), else the weight itself, untiled."""
        if not self.can_lane_tile:
            raise ValueError(f"a {self.source} weight of {self.num_rows} rows cannot be tiled")
        tile_bits = 4
        if self.bits == 8:
            low, high = torch.aminmax(self.codes.view(torch.int8))
            low, high = int(low) + self._code_offset, int(high) + self._code_offset
            if low < 0 or high > 63:
                return self
            tile_bits = 5 if high <= 31 and self.group % 32 == 0 else 6
        scales = [None if t is None else tile_rows(t) for t in self.tensors()[1:]]
        scales[2:] = _as_fp16_if_exact(scales[2:])
        codes = kernels.lane_tile_codes(self.codes, self.bits, self._code_offset, tile_bits)
        fields = dict(zip(ROW_FIELDS, [codes, *scales], strict=True))
        return replace(self, **fields, bits=tile_bits, is_lane_tiled=True)

    def untiled(self, rows: torch.Tensor | None = None) -> PackedWeight:
        """This weight in the plain packed layout (itself when it is not tiled): its rows
        ``rows`` (all when None) of a tiled one."""
        if not self.is_lane_tiled:
            return self if rows is None else self.select_rows(rows)
        scales = [None if t is None else untile_rows(t, rows) for t in self.tensors()[1:]]
        scales[2:] = [None if t is None else t.float() for t in scales[2:]]  # plain: float32
        codes = untile_codes(self.codes, self.bits, self._code_offset, rows)
        fields = dict(zip(ROW_FIELDS, [codes, *scales], strict=True))
        return replace(self, **fields, bits=4 if self.bits == 4 else 8, is_lane_tiled=False)

    def tensors(self) -> list[torch.Tensor | None]:
        """Every row-indexed tensor, in field order (None where absent)."""
        return [
            self.codes,
            self.group_scale,
            self.group_offset,
            self.super_scale,
            self.super_offset,
        ]

    def layout_key(self) -> tuple:
        """Equal for weights whose rows can be stacked into one (same K, bits, groups, dtypes)."""
        kinds = tuple(None if t is None else (t.dtype, t.shape[1]) for t in self.tensors())
        return (self.bits, self.group, kinds, self.is_lane_tiled)

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """The rows ``index`` (permuting rows of a row-quantised matrix is exact), in the plain
        layout (from a tiled weight, only those rows are untiled)."""
        if self.is_lane_tiled:
            return self.untiled(index)
        picked = [None if t is None else t.index_select(0, index) for t in self.tensors()]
        return replace(self, **dict(zip(ROW_FIELDS, picked, strict=True)))

    def dequantize_rows(self, index: torch.Tensor, kernels: ModuleType | None) -> torch.Tensor:
        """float32 [len(index), in_features]: the rows ``index`` dequantised (an embedding
        lookup), in one pass of ``kernels.dequantize_rows`` where the extension has it, else
        ``select_rows(index).dequantize()``: the same values."""
        if kernels is None or not hasattr(kernels, "dequantize_rows"):
            return self.select_rows(index).dequantize()
        return kernels.dequantize_rows(
            self.codes, self.bits, self.group, self.group_scale, self.group_offset,
            self.super_scale, self.super_offset, index.to(torch.int64), self.is_lane_tiled,
            self._code_offset,
        )  # fmt: skip

    def dequantize(self) -> torch.Tensor:
        """float32 [num_rows, in_features]: the plain reference the kernels are tested with."""
        if self.is_lane_tiled:
            return self.untiled().dequantize()
        rows, num_groups = self.group_scale.shape
        scale = _expand(self.group_scale, self.super_scale)
        if self.bits == 8:
            codes = self.codes.view(torch.int8).float()
        else:
            low = (self.codes & 0x0F).view(rows, num_groups, -1)
            high = (self.codes >> 4).view(rows, num_groups, -1)
            halves = torch.stack([low, high], 2)
            codes = halves.reshape(rows, -1).float()
        values = scale.unsqueeze(-1) * codes.view(rows, num_groups, self.group)
        if self.group_offset is not None:
            values = values - _expand(self.group_offset, self.super_offset).unsqueeze(-1)
        return values.reshape(rows, -1)


#: The row-indexed tensor fields of ``PackedWeight``, in ``tensors()`` order.
ROW_FIELDS = ("codes", "group_scale", "group_offset", "super_scale", "super_offset")


def _as_fp16_if_exact(supers: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A tiled weight's super-block scale and offset as fp16 where both convert exactly (a
    K-quant's d and dmin: the file's own fp16), else as they are. Batch-1 decode streams every
    byte of the weight: for Q4_K, fp16 makes 148 bytes per 256 weights of 152 (the file: 144)."""
    present = [t for t in supers if t is not None]
    if not present or any(not torch.equal(t.half().float(), t) for t in present):
        return supers
    return [None if t is None else t.half() for t in supers]


def _expand(group: torch.Tensor, super_: torch.Tensor | None) -> torch.Tensor:
    """float32 per-group values: the group's own, or its super-block's times it."""
    values = group.float()
    if super_ is None:
        return values
    per_super = group.shape[1] // super_.shape[1]
    return super_.repeat_interleave(per_super, dim=1) * values


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """One weight stacking ``parts``' rows (their ``layout_key`` must agree)."""
    if len({p.layout_key() for p in parts}) != 1 or parts[0].is_lane_tiled:
        raise ValueError("packed weights of different layouts cannot be stacked")
    stacked = [
        None if tensors[0] is None else torch.cat(tensors)
        for tensors in zip(*(p.tensors() for p in parts), strict=True)
    ]
    source = "+".join(dict.fromkeys(p.source for p in parts))
    return replace(parts[0], source=source, **dict(zip(ROW_FIELDS, stacked, strict=True)))


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte ``start`` of every block, as float16 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)


def _q4_k_codes(qs: np.ndarray, rows: int) -> np.ndarray:
    """Q4_K's nibbles [rows, blocks, 128] -> our 4-bit packing without unpacking them.

    Per 64 weights, bytes b0..31 hold weights 0-31 in their low nibbles and 32-63 in their high
    ones; our group of 32 wants element j low and element j + 16 high. So from the halves
    lo = b0..15 and hi = b16..31: group A = lo's low | hi's low << 4 and group B = lo's
    high >> 4 | hi's high, computed 8 bytes at a time (a shift by 4 then a nibble mask keeps
    every nibble inside its byte)."""
    words = np.ascontiguousarray(qs).view(np.uint64).reshape(rows, -1, 4, 2, 2)
    lo, hi = words[..., 0, :], words[..., 1, :]
    group_a = (lo & _LOW_NIBBLES) | ((hi << np.uint64(4)) & _HIGH_NIBBLES)
    group_b = ((lo >> np.uint64(4)) & _LOW_NIBBLES) | (hi & _HIGH_NIBBLES)
    return np.stack([group_a, group_b], axis=-2).reshape(rows, -1).view(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes of each block -> (sc, m), 6-bit, 8 per block (gguf's own
    bit layout, ``Q4_K.get_scale_min``)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _repack_legacy(blocks: np.ndarray, qtype: T, rows: int) -> PackedWeight:
    """Q8_0 / Q4_0 / Q4_1: one fp16 scale (and offset) per block of 32."""
    d = _f16(blocks, 0)
    if qtype == T.Q8_0:
        codes = blocks[..., 2:].reshape(rows, -1).view(np.int8)
        return PackedWeight("Q8_0", _t(codes), 8, 32, _t(d))
    if qtype == T.Q4_0:
        # d * (q - 8) = d q - 8 d: both products exact in float32, so the difference is too.
        codes, offset = blocks[..., 2:], (d.astype(np.float32) * 8).astype(np.float16)
    else:
        codes, offset = blocks[..., 4:], -_f16(blocks, 2)
    # gguf's own nibble order is ours: low nibbles the first 16 elements.
    return PackedWeight(qtype.name, _t(codes.reshape(rows, -1)), 4, 32, _t(d), _t(offset))


def _repack_k(blocks: np.ndarray, qtype: T, rows: int) -> PackedWeight:
    """Q4_K / Q5_K: fp16 d, dmin per 256, 6-bit sc, m per 32."""
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(rows, -1, 4, 1, 32)
    if qtype == T.Q5_K:
        # Per 64 weights, 32 bytes: low nibbles the first 32 weights, high nibbles the next 32.
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 256)
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32)
        high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q5 = (q | (high.reshape(rows, -1, 256) << 4)).reshape(rows, -1).view(np.int8)
        codes, bits = q5, 8
    else:
        codes, bits = _q4_k_codes(blocks[..., -128:], rows), 4
    return PackedWeight(
        qtype.name,
        _t(codes),
        bits,
        32,
        _t(sc.reshape(rows, -1)),
        _t(mn.reshape(rows, -1)),
        _t(d),
        _t(dmin),
    )


def _repack_q6_k(blocks: np.ndarray, rows: int) -> PackedWeight:
    """Q6_K: int8 codes q - 32, groups of 16 with int8 scales, fp16 d per 256."""
    nb = blocks.shape[1]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    d = _f16(blocks, 208).astype(np.float32)
    shifts4 = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = ql.reshape(rows, nb, 2, 1, 64) >> shifts4
    low &= 0x0F
    shifts2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = qh.reshape(rows, nb, 2, 1, 32) >> shifts2
    high &= 0x03
    high <<= 4
    # In place, in uint8: q - 32 wraps to the int8 value's bytes.
    codes = low.reshape(rows, nb, 8, 32)
    codes |= high.reshape(rows, nb, 8, 32)
    codes -= 32
    codes = codes.reshape(rows, -1).view(np.int8)
    return PackedWeight("Q6_K", _t(codes), 8, 16, _t(scales.reshape(rows, -1)), None, _t(d))


_BLOCK_BYTES = {T.Q8_0: 34, T.Q4_0: 18, T.Q4_1: 20, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}


def repack(raw: np.ndarray, qtype: T) -> PackedWeight:
    """Repack a GGUF tensor's raw bytes, uint8 [rows, bytes per row] (``ReaderTensor.data``
    of a quantised type), into a ``PackedWeight``. Raises ValueError for other types."""
    if qtype not in PACKABLE_TYPES:
        raise ValueError(f"GGUF type {qtype.name} has no packed layout")
    rows = raw.shape[0]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[qtype])
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        return _repack_legacy(blocks, qtype, rows)
    if qtype == T.Q6_K:
        return _repack_q6_k(blocks, rows)
    return _repack_k(blocks, qtype, rows)
