"""Quantization options: the data model of how one tensor is stored.

An option is one or more *segments* of input channels, each quantized with MLX
affine group quantization at its own bit width and group size (highest bits
first), or "keep 16-bit". Descriptions follow ExLlamaV2's notation:
``"0.1:4b_32g/0.9:3b_32g"`` (10% of input channels at 4-bit group 32, 90% at
3-bit group 32), ``"1.0:4b_64g"`` (uniform), ``"16bit"`` (kept).

Mixed options sort input channels by activation energy (act-order) and store
that permutation; uniform options store none, so they stay loadable by stock
mlx-lm.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from mlx_dq.errors import InputError

VALID_BITS = (2, 3, 4, 5, 6, 8)
VALID_GROUPS = (32, 64, 128)
SCALE_BITS = 16  # scales and biases are stored in the weight's 16-bit dtype
FAST_ALIGN = 512  # Metal qmv fast path wants K to be a multiple of 512
KEEP16_DESC = "16bit"

_SEG_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*:\s*(\d+)b_(\d+)g\s*$")


@dataclass(frozen=True)
class Segment:
    """A share of a tensor's input channels quantized at one width."""

    bits: int
    group_size: int
    prop: float

    def __post_init__(self) -> None:
        if self.bits not in VALID_BITS:
            raise InputError(f"bits must be one of {VALID_BITS}, got {self.bits}")
        if self.group_size not in VALID_GROUPS:
            raise InputError(f"group size must be one of {VALID_GROUPS}, got {self.group_size}")
        if not (0.0 < self.prop <= 1.0 + 1e-9):
            raise InputError(f"segment proportion must be in (0, 1], got {self.prop}")


@dataclass(frozen=True)
class QuantOption:
    """How one tensor is stored: segments (highest bits first) or 16-bit."""

    segments: tuple[Segment, ...] = ()
    keep16: bool = False

    def __post_init__(self) -> None:
        if self.keep16:
            if self.segments:
                raise InputError("a 16-bit option has no segments")
            return
        if not self.segments:
            raise InputError("an option needs at least one segment or keep16=True")
        total = sum(s.prop for s in self.segments)
        if abs(total - 1.0) > 1e-6:
            raise InputError(f"segment proportions must sum to 1, got {total:.6g}")
        bits = [s.bits for s in self.segments]
        if bits != sorted(bits, reverse=True) or len(set(bits)) != len(bits):
            raise InputError(f"segment bit widths must be distinct and descending, got {bits}")

    # ----------------------------------------------------------------- naming
    @classmethod
    def uniform(cls, bits: int, group_size: int) -> "QuantOption":
        """One segment covering the whole tensor."""
        return cls((Segment(bits, group_size, 1.0),))

    @classmethod
    def fp16(cls) -> "QuantOption":
        """Keep the tensor in 16-bit."""
        return cls(keep16=True)

    @classmethod
    def parse(cls, desc: str) -> "QuantOption":
        """Parse an EXL2-style description; a trailing ``s4`` scale tag is ignored."""
        if not isinstance(desc, str) or not desc.strip():
            raise InputError(f"empty option description: {desc!r}")
        text = desc.strip()
        if text.lower() in (KEEP16_DESC, "fp16", "bf16", "16b"):
            return cls.fp16()
        text = re.sub(r"\s+s\d+$", "", text)
        segs = []
        for part in text.split("/"):
            m = _SEG_RE.match(part)
            if not m:
                raise InputError(f"cannot parse option description {desc!r} (bad part {part!r})")
            segs.append(Segment(int(m.group(2)), int(m.group(3)), float(m.group(1))))
        segs.sort(key=lambda s: -s.bits)
        return cls(tuple(segs))

    @property
    def desc(self) -> str:
        """Canonical description, e.g. ``0.1:4b_32g/0.9:3b_32g``."""
        if self.keep16:
            return KEEP16_DESC
        return "/".join(f"{_fmt_prop(s.prop)}:{s.bits}b_{s.group_size}g" for s in self.segments)

    def __str__(self) -> str:
        return self.desc

    @property
    def is_mixed(self) -> bool:
        """True when more than one segment (needs a permutation and custom layer)."""
        return len(self.segments) > 1

    @property
    def max_bits(self) -> int:
        """Highest bit width in the option (16 for kept tensors)."""
        return 16 if self.keep16 else self.segments[0].bits

    # --------------------------------------------------------------- geometry
    def split(self, in_features: int) -> list[int]:
        """Number of input channels in each segment for a tensor with ``in_features`` inputs.

        Boundaries fall on whole groups of every segment; when the tensor is wide
        enough (K a multiple of 512, at least 8 blocks) they fall on multiples of
        512 so Metal's fast quantized matmul applies to each segment. The first
        segments are rounded up (as in EXL2); segments that end up empty are
        reported as 0 and stored as nothing.
        """
        if self.keep16:
            return []
        align = 1
        for s in self.segments:
            align = math.lcm(align, s.group_size)
        if in_features % align != 0:
            raise InputError(
                f"in_features={in_features} is not a multiple of the option's groups ({align}) for {self.desc}"
            )
        if in_features % FAST_ALIGN == 0 and in_features // FAST_ALIGN >= 8:
            align = math.lcm(align, FAST_ALIGN)
        widths, start, cum = [], 0, 0.0
        for i, s in enumerate(self.segments):
            cum += s.prop
            if i == len(self.segments) - 1:
                end = in_features
            else:
                end = min(in_features, int(math.ceil(cum * in_features / align - 1e-9)) * align)
            widths.append(max(0, end - start))
            start = max(start, end)
        return widths

    def storage_bits(self, shape: Sequence[int], scale_bits: int = SCALE_BITS) -> int:
        """Exact bits this option stores for a weight of ``shape`` (``[..., out, in]``).

        Counts packed codes, one scale and one bias per group (``scale_bits`` each)
        and, for mixed options, the input permutation (uint16 when in < 65536,
        else uint32; one per tensor, shared by all experts of a bank).
        """
        *lead, out_f, in_f = [int(d) for d in shape]
        rows = out_f * math.prod(lead) if lead else out_f
        if self.keep16:
            return rows * in_f * 16
        total = 0
        for s, k in zip(self.segments, self.split(in_f)):
            if k == 0:
                continue
            total += rows * k * s.bits + rows * (k // s.group_size) * 2 * scale_bits
        if self.is_mixed:
            total += in_f * perm_bits(in_f)
        return total

    def bpw(self, shape: Sequence[int], scale_bits: int = SCALE_BITS) -> float:
        """Stored bits per weight for ``shape``, everything counted."""
        return self.storage_bits(shape, scale_bits) / math.prod(int(d) for d in shape)

    def nominal_bpw(self, scale_bits: int = SCALE_BITS) -> float:
        """Bits per weight ignoring rounding of segments and the permutation."""
        if self.keep16:
            return 16.0
        return sum(s.prop * (s.bits + 2 * scale_bits / s.group_size) for s in self.segments)

    def fits(self, in_features: int) -> bool:
        """Whether the option can be applied to a tensor with ``in_features`` inputs."""
        if self.keep16:
            return True
        align = 1
        for s in self.segments:
            align = math.lcm(align, s.group_size)
        return in_features % align == 0

    def to_exl2_qparams(self) -> dict:
        """The option as an ExLlamaV2 ``qparams`` record (fp16 scales: scale_bits 16)."""
        if self.keep16:
            return {"group_size": {}, "bits": [16], "bits_prop": [1.0], "scale_bits": 16}
        return {
            "group_size": {str(s.bits): s.group_size for s in self.segments},
            "bits": [s.bits for s in self.segments],
            "bits_prop": [s.prop for s in self.segments],
            "scale_bits": SCALE_BITS,
        }

    @classmethod
    def from_exl2_qparams(cls, qp: dict) -> "QuantOption":
        """Build an option from an ExLlamaV2 ``qparams`` record (bits must be MLX-valid)."""
        bits = [int(b) for b in qp["bits"]]
        props = [float(p) for p in qp["bits_prop"]]
        gs = {str(k): int(v) for k, v in qp.get("group_size", {}).items()}
        if bits == [16]:
            return cls.fp16()
        segs = [Segment(b, gs.get(str(b), 64), p) for b, p in zip(bits, props)]
        segs.sort(key=lambda s: -s.bits)
        return cls(tuple(segs))


def perm_bits(in_features: int) -> int:
    """Bits per stored permutation index for a tensor with ``in_features`` inputs."""
    return 16 if in_features <= 65536 else 32


def _fmt_prop(p: float) -> str:
    text = f"{p:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text
