"""The report of a `--benchmark` run, one format for `main.py train` and `main.py infer`."""

import json

import numpy as np

# Percentiles of the per-step latency that --benchmark reports.
LATENCY_PERCENTILES = (50, 90, 95, 99)


def report_benchmark(name, step_times, batch_size, precision, logger=None):
    """Prints the throughput and latency of the measured steps, also as one JSON line; returns the record.

    Args:
      name: what was measured, 'train' or 'inference': the lines read '<name> throughput: X img/s'.
      step_times: seconds of each measured step (warm-up steps left out), at least one.
      batch_size: images per step (all workers together).
      precision: the Keras policy name the steps ran under.
      logger: a RunLogger that also records it (event 'benchmark'), or None.

    Returns:
      dict {benchmark, throughput_img_per_s, steps, batch_size, precision, latency_s: {mean, p50, p90,
      p95, p99}}, the JSON line's content.
    """
    times = np.asarray(step_times, np.float64)
    if times.size == 0:
        raise ValueError("no measured step: --benchmark_steps must be >= 1")
    throughput = batch_size * len(times) / times.sum()
    latency = {"mean": float(times.mean()), **{f"p{p}": float(np.percentile(times, p)) for p in LATENCY_PERCENTILES}}
    print(f"{name} throughput: {throughput:.3f} img/s")
    print(f"{name} latency (s/step): " + "  ".join(f"{k} {v:.3f}" for k, v in latency.items()))
    record = {"benchmark": name, "throughput_img_per_s": throughput, "steps": len(times), "batch_size": batch_size,
              "precision": precision, "latency_s": latency}
    print(json.dumps(record), flush=True)
    if logger is not None:
        logger.event("benchmark", echo=False, **record)
    return record
