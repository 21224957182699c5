"""Test set-up: 8 host CPU devices for the multi-device tests, float32 matmuls."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
