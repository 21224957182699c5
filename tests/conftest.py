"""Test set-up: 8 host CPU devices for the multi-device tests, and one persistent compilation
cache for the whole session (its workers and the trainer processes the tests start), so a
program compiled once (the tiny config's step, above all) is loaded from disk afterwards. JAX logs
"Compiling ..." before it looks in the cache, so the tests that check a bad input stops before any
compile still see every compile."""

import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jrl-tests-compile-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
