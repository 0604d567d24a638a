"""Shared test settings: Hypothesis profiles ("ci" by default, "nightly" for long runs)."""

from __future__ import annotations

import os
import warnings

from hypothesis import HealthCheck, settings

from embstore import _libpmem

settings.register_profile(
    "ci", max_examples=40, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "nightly", max_examples=1000, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("EMBSTORE_HYPOTHESIS_PROFILE", "ci"))

# libpmem absent, the pmem backend warns once per process that it falls back to mmap; under
# `filterwarnings = error` that warning would fail whichever test happens to come first. It is
# taken here, before any test, so no outcome depends on the order or selection of tests.
# EMBSTORE_TEST_HIDE_LIBPMEM=1 runs the suite as on a machine without libpmem.
if os.environ.get("EMBSTORE_TEST_HIDE_LIBPMEM", "").strip() in ("1", "true", "yes"):
    _libpmem.LIBRARY_NAME = "libpmem-hidden-by-EMBSTORE_TEST_HIDE_LIBPMEM.so.1"
with warnings.catch_warnings():
    warnings.simplefilter("ignore", _libpmem.PmemFallbackWarning)
    _libpmem.load()
