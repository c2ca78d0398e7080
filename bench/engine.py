"""Reference engine throughput: step time and tokens/s against batch size, CPU (and CUDA if present).

Two views side by side for each batch size B:
- ``step ms``: one decode step of B rows on the compute backend alone (median of several);
- ``engine tok/s``: B requests of TOKENS tokens each through the real scheduler (queue, continuous
  batching, per-token delivery), wall clock from submit to the last finish.
The step is calibrated to STEP_MS for up to 8 rows; bigger batches cost more per step but yield
more tokens per second, which is why engines batch.

Run: .venv/bin/python bench/engine.py [--step-ms 20] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

# This script's own tree first (not the one the virtualenv was installed from), unless
# PYTHONPATH names one.
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.engine.compute import ComputeBackend, ComputeUnavailable, make_backend
from replay.engine.core import Engine, RequestHandle

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def step_ms(backend: ComputeBackend, rows: int, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        backend.step(rows)
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def engine_tokens_per_second(backend: ComputeBackend, batch: int, tokens: int) -> tuple[float, float]:
    """(tokens/s, mean time to first token in ms) for ``batch`` concurrent requests."""
    done = threading.Semaphore(0)
    finished: list[RequestHandle] = []

    def on_finish(request: RequestHandle) -> None:
        finished.append(request)
        done.release()

    engine = Engine(backend, max_batch=batch, on_finish=on_finish)
    engine.start()
    started_ns = time.time_ns()
    for index in range(batch):
        engine.submit(RequestHandle(request_id=f"bench-{index}", prompt_tokens=16, max_tokens=tokens, seed=index,
                                    stream=True, model="bench", arrival_at=time.time_ns()))
    for _ in range(batch):
        done.acquire()
    elapsed = (time.time_ns() - started_ns) / 1e9
    engine.stop()
    generated = sum(r.tokens_generated for r in finished)
    ttft = statistics.mean((r.first_token_at or 0) - r.arrival_at for r in finished) / 1e6
    return generated / elapsed, ttft


def run(device: str, step: float, tokens: int) -> None:
    try:
        started = time.perf_counter()
        backend = make_backend(device, step)
        calibration = time.perf_counter() - started
    except ComputeUnavailable as exc:
        print(f"\n{device}: skipped - {exc}")
        return
    print(f"\n{device}: hidden {backend.hidden}, {backend.layers} layers, calibrated to {step} ms "
          f"in {calibration:.2f} s; {tokens} tokens per request")
    print(f"{'batch':>5} {'step ms':>8} {'step tok/s':>10} {'engine tok/s':>12} {'ttft ms':>8} {'vs B=1':>7}")
    baseline = None
    for batch in BATCH_SIZES:
        milliseconds = step_ms(backend, batch)
        throughput, ttft = engine_tokens_per_second(backend, batch, tokens)
        baseline = baseline or throughput
        print(f"{batch:>5} {milliseconds:>8.1f} {batch / milliseconds * 1000:>10.0f} {throughput:>12.0f} "
              f"{ttft:>8.1f} {throughput / baseline:>6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    for device in ("cpu", "cuda"):
        run(device, args.step_ms, args.tokens)


if __name__ == "__main__":
    main()
