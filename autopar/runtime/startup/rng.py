"""A counter-based random generator: the draw at position i depends on (key, i) alone.

In: a 64-bit key (a random op's seed and its place in the model's build, `record`) and int64
positions. Out: uniform (0, 1) float64 values, and normal ones, one per position.

Why by hand: torch's generators are sequential (Mersenne Twister on the CPU) or keyed by
kernel launch geometry (Philox on CUDA), so the value a tensor's element gets depends on how
much of the tensor is drawn at once and in what order. A rank that materializes only its
shard must draw exactly the values the whole tensor would hold; here the value at a position
is a pure function of the key and the position, on any device and any slicing.

    x = splitmix64(key + (2 * position + stream) * GOLDEN)       # two streams per position
    u = (x >>> 11 + 0.5) / 2**53                                  # 53 bits, in (0, 1)
    normal = sqrt(-2 ln u0) * cos(2 pi u1)                        # Box-Muller

splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
2014) passes BigCrush as a counter hash. torch's int64 arithmetic wraps, which is the unsigned
arithmetic splitmix64 needs; its right shifts are arithmetic, so `_srl` masks the sign bits.

Public functions:
    mix_key(*parts) -> int
    uniform(key, positions) -> float64 tensor in (0, 1)
    normal(key, positions) -> float64 tensor
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 ``x``."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def _splitmix_int(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_key(*parts: int) -> int:
    """One signed 64-bit key from several integers (a seed, an op's index, a stream)."""
    key = 0
    for part in parts:
        key = _splitmix_int(key + 0x9E3779B97F4A7C15 + (part & _MASK64))
    return _signed(key)


def _bits(key: int, positions: torch.Tensor, stream: int) -> torch.Tensor:
    return _splitmix(key + (positions * 2 + stream) * _GOLDEN)


def uniform(key: int, positions: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """Float64 values in the open interval (0, 1), one per int64 position."""
    return (_srl(_bits(key, positions, stream), 11).double() + 0.5) * (1.0 / 2**53)


def normal(key: int, positions: torch.Tensor) -> torch.Tensor:
    """Standard normal float64 values, one per int64 position (Box-Muller on two streams)."""
    radius = torch.sqrt(-2.0 * torch.log(uniform(key, positions, 0)))
    return radius * torch.cos((2 * math.pi) * uniform(key, positions, 1))
