"""Engine options under which a sequence's rows reach the sampler differently: the tests that
compare a per-token feature with a reference run under each (`@SCHEDULINGS`)."""

from __future__ import annotations

import pytest

SCHEDULINGS = pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "block_size": 4},  # chunked prompts
        {"num_kv_blocks": 10, "block_size": 4},  # preemption by recompute
        {"async_scheduling": True},
        {"speculative_method": "ngram", "prompt_lookup_min": 1},
    ],
    ids=["default", "chunked-16", "preempt", "async", "speculative"],
)
