"""The hardware view: what the device can do (device.py), what a forward costs (roofline.py), and
what memory did while decoding (telemetry.py). Works without a GPU, NVML or Triton."""
from .device import (
                       DeviceProfile,
                       Measure,
                       cpu_facts,
                       describe,
                       measure_copy_bandwidth,
                       measure_matmul_flops,
)
from .roofline import (
                       SHAPES,
                       Cost,
                       Roofline,
                       decode_cost,
                       forward_cost,
                       linear_params,
                       predicted_speedup,
                       random_model,
                       tree_cost,
                       verify_cost,
)
from .telemetry import Sample, Sampler, per_step, run_with_telemetry

__all__ = ["DeviceProfile", "Measure", "cpu_facts", "describe", "measure_copy_bandwidth", "measure_matmul_flops",
           "SHAPES", "Cost", "Roofline", "decode_cost", "forward_cost", "linear_params", "predicted_speedup", "random_model", "tree_cost",
           "verify_cost", "Sample", "Sampler", "per_step", "run_with_telemetry"]
