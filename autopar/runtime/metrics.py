"""The training run's metrics log: one JSON line per step beside the plan's prediction, and
TensorBoard scalars where the tensorboard package is installed.

In: `TrainOptions.metrics_path` / `tensorboard_dir`, the plan's `Prediction`, each finished
`StepResult` and its learning rate. Out, per step (rank 0 writes; appended, so a resumed run
continues the file):

    {"step", "loss", "grad_norm", "lr", "step_time_s", "predicted_step_time_s",
     "tokens_per_s", "mfu", "predicted_mfu", "peak_memory_bytes", "peak_reserved_bytes",
     "predicted_peak_memory_bytes", "time"}

peak_memory_bytes is the most the rank's tensors held (CUDA: max_memory_allocated; CPU: the
peak resident set), peak_reserved_bytes the most CUDA's caching allocator held (null on CPU).

MFU measured = the plan's MFU x predicted / measured step time: the model's FLOPs per step
are the plan's, so MFU scales with the inverse of the step time. Fields the plan does not
give are null.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.runtime.trainer import Prediction, StepResult, TrainOptions


class Metrics:
    def __init__(self, path: Path | None, tensorboard: Any, prediction: Prediction) -> None:
        self.path, self.tensorboard, self.prediction = path, tensorboard, prediction

    @classmethod
    def open(cls, options: TrainOptions, prediction: Prediction) -> Metrics | None:
        """The log the options ask for; None when neither a path nor TensorBoard is set."""
        if options.metrics_path is None and options.tensorboard_dir is None:
            return None
        path = None
        if options.metrics_path is not None:
            path = Path(options.metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
        writer = None
        if options.tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package
                print("[autopar] tensorboard is not installed: metrics go to the JSON log only")
            else:
                writer = SummaryWriter(options.tensorboard_dir)
        return cls(path, writer, prediction)

    def line(self, result: StepResult, lr: float) -> dict[str, Any]:
        pred = self.prediction
        tokens = pred.tokens_per_step
        mfu = None
        if pred.mfu is not None and pred.step_time_s:
            mfu = pred.mfu * pred.step_time_s / result.step_time_s
        peaks = pred.stage_peak_bytes
        return {
            "step": result.step,
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": lr,
            "step_time_s": result.step_time_s,
            "predicted_step_time_s": pred.step_time_s,
            "tokens_per_s": tokens / result.step_time_s if tokens else None,
            "mfu": mfu,
            "predicted_mfu": pred.mfu,
            "peak_memory_bytes": result.memory_bytes.get("peak"),
            "peak_reserved_bytes": result.memory_bytes.get("peak_reserved"),  # CUDA only
            "predicted_peak_memory_bytes": max(peaks) if peaks else None,
            "time": time.time(),
        }

    def write(self, result: StepResult, lr: float) -> None:
        line = self.line(result, lr)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        if self.tensorboard is not None:
            for key, value in line.items():
                if key not in ("step", "time") and value is not None:
                    self.tensorboard.add_scalar(key, value, result.step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
