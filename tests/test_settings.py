"""Settings: defaults written once, GPU defaults where only memory is at stake."""

from __future__ import annotations

from slotread.settings import GATEWAY_CONCURRENCY, GPU_DEFAULTS, Settings


def test_cpu_defaults_run_on_a_laptop() -> None:
    settings = Settings()
    assert (settings.device, settings.dtype, settings.max_concurrency, settings.queue_size) == (
        "cpu",
        "bfloat16",
        1,
        16,
    )
    assert settings.prefix_cache_bytes is None and settings.max_batch is None


def test_a_gpu_raises_the_limits_not_set_explicitly() -> None:
    gpu = Settings(device="cuda")
    assert (gpu.max_concurrency, gpu.queue_size) == (GPU_DEFAULTS["max_concurrency"], GPU_DEFAULTS["queue_size"])
    assert Settings(device="cuda:1", queue_size=8).queue_size == 8  # an explicit value wins
    gateway = Settings(device="cuda", upstreams=["http://127.0.0.1:8001"])  # the replicas hold the GPU
    assert (gateway.max_concurrency, gateway.queue_size) == (GATEWAY_CONCURRENCY, 16)
