"""How often warm-up compiles the TARGET_VERIFY programs (run as a script, in a fresh process,
so that no earlier engine of the test session has compiled them already).

Run by tests/engine/test_speculative.py. A one-device NGRAM engine (k = 3, 16 requests: the
decode buckets 8 and 16, so two TARGET_VERIFY shapes) warms up with jax's compile log on,
then warms up again. Writes JSON: the programs compiled by the first warm-up, per jitted
function (from the log's ``Compiling jit(<name>)`` lines), the jit cache entries of the verify
forward, the verify sampler and the commit, the warm-up's TARGET_VERIFY shapes, its sampler
variants and top-logprob counts, and the programs the second warm-up lowered.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import sys

import jax

from sglang_tpu_backend.engine import Engine
from sglang_tpu_backend.model_executor import verify
from sglang_tpu_backend.model_executor.compile_cache import CompileCounter
from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.server_args import ServerArgs
from sglang_tpu_backend.speculative.rejection import sample_verify_step_jit

ARGS = dict(max_running_requests=16, chunked_prefill_size=64, context_length=128, page_size=16,
            dtype="float32", random_seed=0, skip_warmup=True, speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=4)


class CompileLog(logging.Handler):
    """Counts jax's ``Compiling jit(<name>) ...`` records by name."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.counts = collections.Counter()

    def emit(self, record):
        m = re.match(r"Compiling (\S+)", record.getMessage())
        if m:
            self.counts[m[1]] += 1


def main(out_path: str) -> None:
    eng = Engine(ServerArgs(**ARGS), start_loop=False)
    runner = eng.runner
    log = CompileLog()
    logging.getLogger("jax").addHandler(log)  # one handler: the records propagate up to it
    jax.config.update("jax_log_compiles", True)
    runner.warmup(progress=False)
    jax.config.update("jax_log_compiles", False)
    counter = CompileCounter()
    runner.warmup(progress=False)
    json.dump({
        "compiles": dict(log.counts),
        "cache_entries": {"forward_verify": verify.forward_verify_jit._cache_size(),
                          "sample_verify_step": sample_verify_step_jit._cache_size(),
                          "commit_accepted": verify.commit_accepted_jit._cache_size()},
        "verify_shapes": [list(s[1:]) for s in runner.all_shapes()
                          if s[0] == ForwardMode.TARGET_VERIFY],
        "variants": len(runner.sampler_variants()),
        "top_logprobs": sorted({0, runner.max_top_logprobs_num}),
        "second_warmup_lowerings": counter.lowerings,
    }, open(out_path, "w"))
    eng.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
