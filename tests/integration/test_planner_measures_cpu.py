"""The planner's CPU device, measured on this machine by two processes that compute and communicate at once."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # two gloo processes timing matmuls and collectives: ~40 s here


def test_cpu_device_is_measured():
    from scalenlp.plan.measure import measure_cpu

    spec = measure_cpu(processes=2)
    assert spec.peak_flops_fp32 > 1e8 and spec.hbm_bw > 1e8
    assert spec.intra_node_bw > 1e6 and 0 < spec.latency_s < 0.1
    assert spec.runtime_bytes > 50e6 and spec.memory_bytes > 0
    assert spec.fsdp_unit_overhead_s >= 0 and spec.tp_linear_overhead_s >= 0
    assert spec.vocab_parallel_loss_factor > 0 and spec.loss_s_per_logit > 0 and spec.attention_flops > 1e6
    assert spec.all_gather_factor > 0 and spec.reduce_scatter_factor > 0
