"""Pipeline step time and peak in-flight micro-batches, cached for the search.

The event simulation (cost_models.pipeline) is scale-free: simulating k*t gives k*step and the
same peaks. So results are cached on the stage times normalised by their largest value and
rounded to 4 significant digits (an error below 1e-4 of the step), and configs whose stages
have the same proportions share one simulation. Checked against direct simulations in
tests/autopar/estimate/test_pipeline_timer.py.
"""

from __future__ import annotations

from cost_models.pipeline import simulate_pipeline
from cost_models.pipeline_shared import simulate_pipeline_shared


class PipelineTimer:
    """Step time and peak in-flight micro-batches of a schedule, cached on normalised times."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[float, tuple[float, ...]]] = {}
        self._shared_cache: dict[tuple, float] = {}

    def __call__(
        self,
        schedule: str,
        pp: int,
        m: int,
        forward_s: tuple[float, ...],
        backward_input_s: tuple[float, ...],
        backward_weight_s: tuple[float, ...],
        p2p_s: tuple[float, ...],
        virtual_stages: int,
    ) -> tuple[float, tuple[float, ...]]:
        scale, norm = _normalised(forward_s, backward_input_s, backward_weight_s, p2p_s)
        step, inflight = self._simulate(schedule, pp, m, norm, virtual_stages)
        return step * scale, inflight

    def _simulate(
        self, schedule: str, pp: int, m: int, norm: tuple, virtual_stages: int
    ) -> tuple[float, tuple[float, ...]]:
        key = (schedule, pp, m, virtual_stages, norm)
        if key not in self._cache:
            fwd, b_in, b_w, p2p = norm
            result = simulate_pipeline(
                schedule,  # type: ignore[arg-type]
                pp,
                m,
                forward_s=fwd,
                backward_input_s=b_in,
                backward_weight_s=b_w,
                p2p_s=p2p,
                virtual_stages=virtual_stages,
                record_tasks=False,
            )
            self._cache[key] = (result.step_time_s, result.peak_inflight_microbatches)
        return self._cache[key]

    def shared(
        self,
        schedule: str,
        pp: int,
        m: int,
        forward_s: tuple[float, ...],
        backward_input_s: tuple[float, ...],
        backward_weight_s: tuple[float, ...],
        p2p_s: tuple[float, ...],
        virtual_stages: int,
        node_of: tuple[int, ...],
        weight: tuple[float, ...],
        slots: int,
    ) -> float:
        """Step time with ranks time-sharing ``slots`` per node (`simulate_pipeline_shared`,
        times at the full rate), cached the same way: processor sharing is scale-free too."""
        scale, norm = _normalised(forward_s, backward_input_s, backward_weight_s, p2p_s)
        key = (schedule, pp, m, virtual_stages, norm, node_of, weight, slots)
        if key not in self._shared_cache:
            fwd, b_in, b_w, p2p = norm
            self._shared_cache[key] = simulate_pipeline_shared(
                schedule,
                pp,
                m,
                forward_s=fwd,
                backward_input_s=b_in,
                backward_weight_s=b_w,
                node_of=node_of,
                weight=weight,
                slots=slots,
                p2p_s=p2p,
                virtual_stages=virtual_stages,
            )
        return self._shared_cache[key] * scale


def _normalised(*times) -> tuple[float, tuple[tuple[float, ...], ...]]:
    """(the largest time, every time sequence over it to 4 significant digits); the p2p
    latencies, one per hop, come last."""
    scale = max(*(x for seq in times for x in seq), 1e-30)
    norm = tuple(tuple(float(f"{x / scale:.4g}") for x in seq) for seq in times)
    return scale, norm
