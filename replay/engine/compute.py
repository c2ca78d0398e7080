"""The work one engine step really does: matrix products on the CPU (NumPy) or a GPU (PyTorch).

The engine has no model weights, but utilization must be real so the auditor can measure what a
zombie costs. A "model" here is ``layers`` square matrices; one step pushes ``rows`` activation
rows through all of them, where ``rows`` is the decode batch plus the prompt tokens prefilled in
that step. Rows are padded to a multiple of eight, as serving engines pad batches to the sizes
their CUDA graphs were captured for; this also keeps BLAS on its matrix-matrix path, whose cost
grows smoothly with rows. ``layers`` is calibrated at start so that a step of up to eight rows
costs about ``step_ms``; more rows cost more, sub-linearly, which is why batching pays.

PyTorch is imported only for ``device="cuda"`` and is not a dependency: without it, or without a
GPU, :func:`make_backend` raises :class:`ComputeUnavailable` with what to do.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

# One BLAS thread: a step then occupies one core fully, like one GPU, and its cost stays
# predictable on a shared machine (multi-threaded BLAS spin-waits badly when cores are busy).
# Only effective when this module is the first to import NumPy, as in the engine process.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402

from auditor.errors import AuditorError  # noqa: E402

CPU_HIDDEN = 1024
CUDA_HIDDEN = 4096
_CALIBRATION_LAYERS = 32
ROW_PADDING = 8


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of :data:`ROW_PADDING` (at least one multiple)."""
    return max(1, -(-rows // ROW_PADDING)) * ROW_PADDING


class ComputeUnavailable(AuditorError):
    """The requested compute device cannot be used here."""


class ComputeBackend(Protocol):
    """Runs one engine step; implementations differ only by device."""

    device: str
    hidden: int
    layers: int

    def step(self, rows: int) -> float:
        """Push ``rows`` activation rows through every layer; returns a checksum (forces the work)."""
        ...


def _layers_for(step_seconds: float, seconds_per_layer: float) -> int:
    return max(1, round(step_seconds / max(seconds_per_layer, 1e-9)))


def _refine(backend: ComputeBackend, step_seconds: float, rounds: int = 3) -> int:
    """Correct the layer count by timing whole steps: small timings mislead (warm-up, caches)."""
    layers = backend.layers
    for _ in range(rounds):
        samples = []
        for _ in range(3):
            started = time.perf_counter()
            backend.step(1)
            samples.append(time.perf_counter() - started)
        measured = min(samples)
        if abs(measured - step_seconds) < 0.1 * step_seconds:
            break
        layers = max(1, round(layers * step_seconds / max(measured, 1e-9)))
        backend.layers = layers
    return layers


class NumpyBackend:
    """CPU compute with NumPy (BLAS) matrix products."""

    device = "cpu"

    def __init__(self, step_ms: float, hidden: int = CPU_HIDDEN, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.hidden = hidden
        # Scaled so activations neither vanish nor explode across many layers.
        self._weight = (rng.standard_normal((hidden, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
        self._activation = rng.standard_normal((1, hidden), dtype=np.float32)
        self.layers = 1
        self.layers = _layers_for(step_ms / 1000.0, self._seconds_per_layer())
        self.layers = _refine(self, step_ms / 1000.0)

    def _seconds_per_layer(self) -> float:
        self._run(1, 4)  # warm caches and BLAS threads
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            self._run(1, _CALIBRATION_LAYERS)
            samples.append((time.perf_counter() - started) / _CALIBRATION_LAYERS)
        # The fastest sample is the uncontended cost; a busy machine only ever makes steps slower.
        return min(samples)

    def _run(self, rows: int, layers: int) -> float:
        activation = np.repeat(self._activation, padded_rows(rows), axis=0)
        for _ in range(layers):
            activation = activation @ self._weight
        return float(activation[0, 0])

    def step(self, rows: int) -> float:
        return self._run(rows, self.layers)


def cuda_unavailable_reason() -> str | None:
    """Why ``--device cuda`` cannot run here, or None. Creates no CUDA context, so a caller that
    only checks (``auditor demo``) does not show up in NVML as a GPU process."""
    try:
        import torch
    except ImportError:
        return ("--device cuda needs PyTorch with CUDA, which is not installed here; "
                "install torch (e.g. `pip install torch`) or use --device cpu")
    if not torch.cuda.is_available():
        return "--device cuda: PyTorch finds no CUDA GPU here; use --device cpu"
    return None


class TorchCudaBackend:
    """GPU compute with PyTorch on CUDA; half precision like a real serving stack."""

    device = "cuda"

    def __init__(self, step_ms: float, hidden: int = CUDA_HIDDEN, seed: int = 0) -> None:
        problem = cuda_unavailable_reason()
        if problem:
            raise ComputeUnavailable(problem)
        import torch

        self._torch: Any = torch
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.hidden = hidden
        self._weight = (torch.randn((hidden, hidden), generator=generator, device="cuda", dtype=torch.float16)
                        / hidden ** 0.5)
        self._activation = torch.randn((1, hidden), generator=generator, device="cuda", dtype=torch.float16)
        self.layers = 1
        self._run(1, 8)
        torch.cuda.synchronize()
        started = time.perf_counter()
        self._run(1, _CALIBRATION_LAYERS)
        torch.cuda.synchronize()
        per_layer = (time.perf_counter() - started) / _CALIBRATION_LAYERS
        self.layers = _layers_for(step_ms / 1000.0, per_layer)
        self.layers = _refine(self, step_ms / 1000.0)

    def _run(self, rows: int, layers: int) -> float:
        activation = self._activation.expand(padded_rows(rows), -1).contiguous()
        for _ in range(layers):
            activation = activation @ self._weight
        # .item() synchronizes: the step really ends when the GPU is done.
        return float(activation[0, 0].item())

    def step(self, rows: int) -> float:
        return self._run(rows, self.layers)


def make_backend(device: str, step_ms: float) -> ComputeBackend:
    """The backend for ``device`` (``cpu`` or ``cuda``), calibrated to ``step_ms`` per one-row step."""
    if step_ms <= 0:
        raise ComputeUnavailable(f"step time must be positive, got {step_ms} ms; use e.g. --step-ms 20")
    if device == "cpu":
        return NumpyBackend(step_ms)
    if device == "cuda":
        return TorchCudaBackend(step_ms)
    raise ComputeUnavailable(f"unknown device {device!r}; use cpu or cuda")
