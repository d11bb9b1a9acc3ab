"""GPU time of a call from a captured CUDA graph (no host cost in it): what the kernel-choice benchmarks measure.

>>> captured_us.__name__   # needs CuPy and a GPU to run
'captured_us'
"""
from __future__ import annotations

import statistics


def captured_us(cp, run, reps: int, rounds: int) -> tuple:
    """``(median, low, high)`` GPU microseconds a call of ``run``: one call to warm up, then ``reps`` calls captured in
    one CUDA graph on a stream of their own, the graph replayed ``rounds`` times between two events."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        run()
        stream.synchronize()
        stream.begin_capture()
        for _ in range(reps):
            run()
        graph = stream.end_capture()
        graph.launch(stream)
        times = []
        for _ in range(rounds):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / reps)
    return statistics.median(times), min(times), max(times)
