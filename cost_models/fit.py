"""Fit the cost model's parameters to measurements: efficiency curves and alpha-beta links.

In: measurements taken on a machine (by ``autopar profile``): (size, achieved rate) of ops,
(collective, message bytes, group size, time) of collectives. Out: the parameters the cost
model prices with (`cost_models.compute.EfficiencyCurve`, `cost_models.comm.Level`), fitted so
that the cost model's own formulas predict back what was measured. No torch import.

Efficiency curve (`fit_efficiency_curve`). The model (`EfficiencyCurve.at`) says an op of size
x runs at rate P * e_max * x / (x + x_half), so its time is linear in x:

    t(x) = x / rate(x) = (x + x_half) / (P e_max) = a + b x,   b = 1 / (P e_max),  a = x_half b

a and b come from least squares on the *relative* error sum_i ((a + b x_i) / t_i - 1)^2, so
a small op's microseconds weigh as much as a large op's seconds and multiplicative noise
does not bias the fit; a >= 0 and b > 0 are enforced (a < 0 refits with a = 0). The fitted
large-size rate is R = 1 / b, the half size x_half = a / b, and e_max = R / P, where P is
the given peak or, without one, the larger of R and the best measured rate.

Alpha-beta per level (`fit_level`). For a group of n ranks on one level with latency a and
achieved bandwidth B (efficiency 1: B is already what large transfers get), every algorithm
in `cost_models.comm` prices a collective of S bytes as

    t = L * a + K * S / B

with L, K set by the collective, the algorithm and n (a ring all-reduce has L = 2(n-1),
K = 2(n-1)/n). L and K are read off `comm.collective_options` itself, by pricing with
(a=1, B=inf) and (a=0, B=1), so the fit and the cost model cannot disagree on a formula.
`collective_time` takes the cheapest algorithm, so the fit alternates: pick each
measurement's cheapest algorithm under the current (a, 1/B), solve the linear least squares
in (a, 1/B) on the relative error as above, then refine it to the least squares of
log(predicted / measured) (`_log_fit`: a collective 3x slower than the formula weighs as one 3x
faster), until the picks stop changing. With ``per_collective``, each collective kind then
gets its own latency (`_collective_latencies`, B kept), for runtimes such as gloo whose
send/recv and collectives have fixed costs several times apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from cost_models.comm import COLLECTIVES, HierarchicalGroup, Level, collective_options
from cost_models.compute import EfficiencyCurve


@dataclass(frozen=True)
class CurveFit:
    """A fitted efficiency curve and the rate it is a fraction of."""

    curve: EfficiencyCurve
    peak: float  # the rate the curve's fractions refer to (FLOP/s or bytes/s)
    rate: float  # fitted large-size rate, peak * curve.max
    rms_relative_error: float  # of the fitted times against the measured ones
    num_points: int

    def time_s(self, size: float) -> float:
        """Predicted time of an op of ``size``: (size + half_size) / (peak * max)."""
        return (size + self.curve.half_size) / self.rate

    def as_text(self) -> str:
        return (
            f"rate {self.rate:.3g}/s (max {self.curve.max:.3f} of {self.peak:.3g}), "
            f"half size {self.curve.half_size:.3g}, rms error {self.rms_relative_error:.1%} "
            f"over {self.num_points} points"
        )


@dataclass(frozen=True)
class CommMeasurement:
    """One timed collective; ``message_bytes`` in the nccl-tests convention of `comm`."""

    collective: str
    message_bytes: float
    group_size: int
    time_s: float


@dataclass(frozen=True)
class LevelFit:
    """A fitted topology level and how well it prices the measurements it came from."""

    level: Level
    algorithms: tuple[str, ...]  # the algorithm priced for each measurement, in order
    rms_log_ratio: float  # sqrt(mean(log(predicted / measured)^2)); exp of it: a typical factor
    num_points: int

    def time_s(self, collective: str, message_bytes: float, group_size: int) -> float:
        """The cost model's time for a collective on ``group_size`` ranks of this level."""
        return _price(self.level, collective, message_bytes, group_size)

    def as_text(self) -> str:
        lv = self.level
        return (
            f"{lv.name}: latency {lv.latency_s * 1e6:.1f} us, bandwidth "
            f"{lv.bandwidth_bytes_per_s / 1e9:.3g} GB/s, typical error x"
            f"{math.exp(self.rms_log_ratio):.2f} over {self.num_points} points"
        )


def fit_efficiency_curve(
    sizes: Sequence[float], rates: Sequence[float], *, peak: float | None = None
) -> CurveFit:
    """Fit ``efficiency(x) = max * x / (x + half_size)`` to achieved rates (module docstring).

    Args:
        sizes: x of each measured op (FLOPs, or bytes moved), > 0.
        rates: achieved rate of each op (x / its time), > 0.
        peak: the rate efficiency is a fraction of (a datasheet peak); None: the larger of
            the fitted large-size rate and the best measured rate, so that max <= 1.

    Returns:
        A CurveFit.

    Raises:
        ValueError: fewer than two distinct sizes, a size or rate <= 0, or times that do not
            grow with size (no rate to fit).

    Example:
        >>> fit = fit_efficiency_curve([1e6, 1e7, 1e8], [4.5454545e9, 2.5e10, 4.5454545e10])
        >>> round(fit.rate / 1e10, 3), round(fit.curve.half_size / 1e6, 3)
        (5.0, 10.0)
    """
    x = np.asarray(sizes, dtype=float)
    r = np.asarray(rates, dtype=float)
    if x.shape != r.shape or x.ndim != 1:
        raise ValueError(f"sizes and rates must be equal-length lists, got {x.shape}, {r.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"need at least two distinct sizes to fit a curve, got {list(x)}")
    if np.any(x <= 0) or np.any(r <= 0) or not np.all(np.isfinite(r)):
        raise ValueError(f"sizes and rates must be > 0, got sizes {list(x)}, rates {list(r)}")
    t = x / r
    a, b = _nonnegative_fit(np.ones_like(x), x, t, intercept_name="half_size")
    rate = 1.0 / b
    half = a / b
    top = max(rate, float(r.max())) if peak is None else float(peak)
    if top <= 0:
        raise ValueError(f"peak must be > 0, got {peak}")
    curve = EfficiencyCurve(min(1.0, rate / top), half)
    rate = top * curve.max
    predicted = (x + half) / rate
    return CurveFit(curve, top, rate, _rms_relative(predicted, t), len(x))


def fit_level(
    measurements: Sequence[CommMeasurement],
    *,
    name: str,
    devices_per_domain: int,
    max_iterations: int = 20,
    per_collective: bool = False,
) -> LevelFit:
    """Fit one topology level's latency and bandwidth to timed collectives on it.

    Every measurement is a group of ranks that meet on this level only (one rank per domain
    of the level inside it), priced as ``HierarchicalGroup((level,), (n,))``.

    Args:
        measurements: timed collectives; at least two distinct (L, K * S) rows.
        name: the level's name (``loopback``, ``nvlink``, ``infiniband``, ...).
        devices_per_domain: as in the profile (0: the whole cluster).
        max_iterations: rounds of algorithm picking (module docstring).
        per_collective: also fit each collective's own latency (`_collective_latencies`)
            into the level's ``collective_latency_s``.

    Returns:
        A LevelFit whose level has efficiency 1 and the achieved bandwidth.

    Raises:
        ValueError: an unknown collective, a group of one rank, a time <= 0, too few points.
    """
    if len(measurements) < 2:
        raise ValueError(f"level {name!r}: need at least two measurements, got {len(measurements)}")
    for m in measurements:
        if m.collective not in COLLECTIVES:
            raise ValueError(
                f"unknown collective {m.collective!r}; known: {', '.join(COLLECTIVES)}"
            )
        if m.group_size < 2 or m.time_s <= 0 or m.message_bytes < 0:
            raise ValueError(
                f"level {name!r}: {m.collective} needs group_size >= 2, time_s > 0 and "
                f"message_bytes >= 0, got {m.group_size}, {m.time_s}, {m.message_bytes}"
            )
    options = [_coefficients(m) for m in measurements]
    t = np.array([m.time_s for m in measurements])
    picks = [0] * len(measurements)  # the first option: ring, pairwise or direct
    latency = inverse_bandwidth = 0.0
    for _ in range(max_iterations):
        lat_col = np.array([opts[p][1] for opts, p in zip(options, picks, strict=True)])
        bw_col = np.array([opts[p][2] for opts, p in zip(options, picks, strict=True)])
        start = _nonnegative_fit(lat_col, bw_col, t, intercept_name="latency")
        latency, inverse_bandwidth = _log_fit(lat_col, bw_col, t, start)
        new = [
            min(
                range(len(opts)),
                key=lambda i, o=opts: o[i][1] * latency + o[i][2] * inverse_bandwidth,
            )
            for opts in options
        ]
        if new == picks:
            break
        picks = new
    level = Level(name, devices_per_domain, 1.0 / inverse_bandwidth, latency, 1.0)
    if per_collective:
        level = replace(
            level,
            collective_latency_s=_collective_latencies(
                measurements, options, picks, latency, inverse_bandwidth
            ),
        )
    predicted = np.array(
        [_price(level, m.collective, m.message_bytes, m.group_size) for m in measurements]
    )
    algorithms = tuple(opts[p][0] for opts, p in zip(options, picks, strict=True))
    rms_log = float(np.sqrt(np.mean(np.log(predicted / t) ** 2)))
    return LevelFit(level, algorithms, rms_log, len(measurements))


def _collective_latencies(
    measurements: Sequence[CommMeasurement],
    options: list[list[tuple[str, float, float]]],
    picks: list[int],
    latency: float,
    inverse_bandwidth: float,
) -> tuple[tuple[str, float], ...]:
    """Per collective kind, the latency a that prices its latency-bound points: the median of
    (t - K S / B) / L over its points whose transfer K S / B is below the shared fit's L a
    (all its points when none is), with the shared bandwidth B kept; never negative."""
    by_kind: dict[str, list[tuple[float, float, float]]] = {}
    for m, opts, p in zip(measurements, options, picks, strict=True):
        _, lat_coef, bw_coef = opts[p]
        if lat_coef > 0:
            by_kind.setdefault(m.collective, []).append((lat_coef, bw_coef, m.time_s))
    out = []
    for kind, rows in sorted(by_kind.items()):
        bound = [r for r in rows if r[1] * inverse_bandwidth < r[0] * latency] or rows
        values = [max(0.0, t - v * inverse_bandwidth) / u for u, v, t in bound]
        out.append((kind, float(np.median(values))))
    return tuple(out)


def _price(level: Level, collective: str, message_bytes: float, group_size: int) -> float:
    group = HierarchicalGroup((level,), (group_size,))
    return min(e.time_s for e in collective_options(collective, message_bytes, group))  # type: ignore[arg-type]


def _coefficients(m: CommMeasurement) -> list[tuple[str, float, float]]:
    """(algorithm, L, K * S) for each algorithm comm prices ``m`` with: t = L a + K S / B."""
    unit_latency = Level("fit", 0, math.inf, 1.0, 1.0)
    unit_bandwidth = Level("fit", 0, 1.0, 0.0, 1.0)
    by_latency = collective_options(
        m.collective,  # type: ignore[arg-type]
        m.message_bytes,
        HierarchicalGroup((unit_latency,), (m.group_size,)),
    )
    by_bandwidth = collective_options(
        m.collective,  # type: ignore[arg-type]
        m.message_bytes,
        HierarchicalGroup((unit_bandwidth,), (m.group_size,)),
    )
    return [
        (lat.algorithm, lat.time_s, bw.time_s)
        for lat, bw in zip(by_latency, by_bandwidth, strict=True)
    ]


def _nonnegative_fit(
    u: np.ndarray, v: np.ndarray, t: np.ndarray, *, intercept_name: str
) -> tuple[float, float]:
    """(p, q) >= 0 with q > 0 minimising sum ((p u_i + q v_i) / t_i - 1)^2."""
    w = 1.0 / t
    design = np.column_stack([u * w, v * w])
    target = np.ones_like(t)
    (p, q), *_ = np.linalg.lstsq(design, target, rcond=None)
    if p < 0:  # the intercept cannot be negative: refit the slope alone
        vw = v * w
        p, q = 0.0, float(vw.sum() / (vw * vw).sum()) if np.any(vw > 0) else 0.0
    if q <= 0 or not math.isfinite(q):
        raise ValueError(
            f"times do not grow with size (fitted slope {q:.3g}, {intercept_name} {p:.3g}): "
            "measure over a wider range of sizes"
        )
    return float(p), float(q)


def _log_fit(
    u: np.ndarray, v: np.ndarray, t: np.ndarray, start: tuple[float, float]
) -> tuple[float, float]:
    """(p, q) > 0 minimising sum log((p u_i + q v_i) / t_i)^2, from ``start`` (Gauss-Newton).

    Over- and under-prediction by the same factor weigh the same here, which the relative
    error of `_nonnegative_fit` (bounded by 1 below, unbounded above) does not: when no (p, q)
    fits every point, as when a runtime implements each collective its own way, this is the
    fit whose errors are balanced.
    """
    # A zero start (no latency) has no logarithm: start a billion times below any time.
    floors = [1e-9 * float(np.min(t / np.maximum(col, 1e-300))) for col in (u, v)]
    theta = np.log(np.maximum(np.array(start, dtype=float), floors))
    damping = 1e-3

    def loss(th: np.ndarray) -> float:
        return float(np.sum(np.log((np.exp(th[0]) * u + np.exp(th[1]) * v) / t) ** 2))

    current = loss(theta)
    for _ in range(100):
        p, q = np.exp(theta)
        predicted = p * u + q * v
        residual = np.log(predicted / t)
        jacobian = np.column_stack([p * u / predicted, q * v / predicted])
        normal = jacobian.T @ jacobian
        gradient = jacobian.T @ residual
        step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-12), -gradient)
        trial = theta + step
        trial_loss = loss(trial)
        if trial_loss < current:
            theta, current, damping = trial, trial_loss, damping / 3
            if np.max(np.abs(step)) < 1e-10:
                break
        else:
            damping *= 10
            if damping > 1e10:
                break
    p, q = np.exp(theta)
    return float(p), float(q)


def _rms_relative(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.sqrt(np.mean((predicted / measured - 1.0) ** 2)))
