"""Step buckets: the few (mode, T, R, L) shapes every step is padded to, so steady-state
serving never compiles (warm-up compiles each one).

T: token rows of the step, R: request rows, L: logits rows (all per DP rank).
  DECODE:  T = R = L in ``req_buckets`` (powers of four from 8 up to max_running_requests).
  MIXED:   every other step (prefill chunks, with or without decodes: EXTEND steps run as
           MIXED, one program for both); T in ``token_buckets`` (powers of four from 64 up
           to max_tokens_per_step), R = L = max_running_requests (``extend_req_buckets``, one
           bucket), covering both the requests and the logits rows (the scheduler keeps
           logits rows per step <= max_running_requests, chunking prompt-logprob prefills).
The ladders are coarse on purpose: every bucket is one more program to compile before the
server answers, and a padded row costs far less than a compile (padding rows route to no
expert and read no pages; GDN chunks and attention blocks loop over the real ones only).
With the default limits (64 requests, 256-token steps) that is 3 DECODE and 2 MIXED programs.
A prefill step pads its requests to the limit: its cost is dominated by its tokens, so extra
request rows barely show. A decode step's cost grows with R, hence its own ladder.
The page table is always ``pages_per_seq`` wide (context length / page size): the attention
kernels read only the pages a request holds, so the width costs an upload of the table, not
work, and needs no bucket of its own.

Speculative decoding (``verify_tokens`` n = k+1): a decode step whose drafts the scheduler
verifies runs as TARGET_VERIFY, n token rows and n logits rows per request: T = L = R * n
for R in ``req_buckets`` (deterministic mode: R = max_running_requests); one without drafts
runs as DECODE. Both sets of shapes are compiled.

Deterministic mode (``--enable-deterministic-inference``): two shapes only
(``deterministic_shapes``): DECODE with T = R = L = max_running_requests, and a prefill-only
MIXED step with T = max_tokens_per_step, R = ``deterministic_prefill_reqs`` (the scheduler
sends at most that many prefill chunks, never decodes, in such a step; few rows keep the GDN
chunk slots few) and L = ``deterministic_prefill_rows`` (room for a whole 64-token chunk of
prompt logprobs). On XLA:CPU an op's per-row result can depend on the program's shapes (the
GDN chunked path rounds differently at T=16 and T=64), so a fixed shape per kind is what
makes a row's result independent of the batch; padding rows cost compute, not correctness
(``benchmarks/bench_deterministic.py`` measures it).
"""

from __future__ import annotations

from sglang_tpu_backend.model_executor.forward_mode import ForwardMode
from sglang_tpu_backend.server_args import DETERMINISTIC_MIN_CHUNK

Shape = tuple[ForwardMode, int, int, int]  # (mode, T, R, L)

MIN_BUCKET = 8
DECODE_FACTOR = 4  # decode request buckets: 8, 32, 128, ... (capped at the limit)
PREFILL_MIN_TOKENS, PREFILL_TOKEN_FACTOR = 64, 4  # prefill token buckets: 64, 256, 1024, ...


def bucket_ladder(limit: int, smallest: int = MIN_BUCKET, factor: int = 2) -> tuple[int, ...]:
    """Powers of ``factor`` from ``smallest`` below ``limit``, then ``limit`` itself."""
    out, b = [], min(smallest, limit)
    while b < limit:
        out.append(b)
        b *= factor
    out.append(limit)
    return tuple(out)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket >= n (ValueError when n exceeds them all)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def ladders(max_running_requests: int, max_tokens_per_step: int
            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(decode request buckets, prefill request buckets (the limit alone), prefill token
    buckets)."""
    return (bucket_ladder(max_running_requests, factor=DECODE_FACTOR),
            (max_running_requests,),
            bucket_ladder(max(max_tokens_per_step, max_running_requests),
                          smallest=PREFILL_MIN_TOKENS, factor=PREFILL_TOKEN_FACTOR))


def step_shapes(max_running_requests: int, max_tokens_per_step: int) -> list[Shape]:
    """Every bucketed (mode, T, R, L) a runner with these limits can step with.

    DECODE: T = R = L in the decode ladder. MIXED: T in the token ladder x R = L in the
    prefill request ladder, only where some request count n <= T picks that R.
    """
    req_buckets, extend_req_buckets, token_buckets = ladders(max_running_requests,
                                                             max_tokens_per_step)
    out = [(ForwardMode.DECODE, r, r, r) for r in req_buckets]
    for t in token_buckets:
        prev = 0
        for r in extend_req_buckets:
            if prev < t:  # some count n in (prev, r] with n <= t picks r
                out.append((ForwardMode.MIXED, t, r, r))
            prev = r
    return out


def deterministic_prefill_reqs(max_running_requests: int) -> int:
    """Prefill chunks per step in deterministic mode (the step's fixed R)."""
    return min(MIN_BUCKET, max_running_requests)


def deterministic_prefill_rows(max_running_requests: int, max_tokens_per_step: int) -> int:
    """Logits rows of the deterministic prefill step (the scheduler's ``max_logits_rows``):
    at least one aligned chunk of prompt logprobs, which cannot be cut shorter."""
    T = max(max_tokens_per_step, max_running_requests)
    return min(T, max(max_running_requests, DETERMINISTIC_MIN_CHUNK))


def deterministic_shapes(max_running_requests: int, max_tokens_per_step: int) -> list[Shape]:
    """The two (mode, T, R, L) of deterministic mode: DECODE and prefill-only MIXED."""
    R, T = max_running_requests, max(max_tokens_per_step, max_running_requests)
    return [(ForwardMode.DECODE, R, R, R),
            (ForwardMode.MIXED, T, deterministic_prefill_reqs(R),
             deterministic_prefill_rows(R, max_tokens_per_step))]


class StepBuckets:
    """The buckets of one runner's limits (per DP rank), and the bucket of a step."""

    def __init__(self, max_running_requests: int, max_tokens_per_step: int,
                 deterministic: bool = False, verify_tokens: int | None = None):
        """``verify_tokens``: n = k+1 under speculative decoding (None: off)."""
        self.limits = (max_running_requests, max_tokens_per_step)
        self.deterministic = deterministic
        self.verify_tokens = verify_tokens
        self.req_buckets, self.extend_req_buckets, self.token_buckets = ladders(*self.limits)
        # The shapes steps may take while a staged warm-up compiles the rest (None: all of
        # them; ``background_warmup.py``): a DECODE step whose bucket is not among them runs
        # as MIXED, a MIXED step takes the smallest of their token buckets that holds it.
        self.ready: frozenset[Shape] | None = None

    def first_shapes(self) -> list[Shape]:
        """The one bucket a staged warm-up compiles before serving: MIXED with the smallest
        token bucket that holds a decode step of every running request."""
        R = self.extend_req_buckets[-1]
        return [(ForwardMode.MIXED, pick_bucket(self.token_buckets, R), R, R)]

    def all_shapes(self) -> list[Shape]:
        """Every (mode, T, R, L) serving can produce (what warm-up compiles)."""
        shapes = (deterministic_shapes if self.deterministic else step_shapes)(*self.limits)
        n = self.verify_tokens
        if n is None:
            return shapes
        return shapes + [(ForwardMode.TARGET_VERIFY, R * n, R, R * n)
                         for mode, _, R, _ in shapes if mode == ForwardMode.DECODE]

    def shape_for(self, kind: ForwardMode, num_tokens: int, num_reqs: int, num_rows: int
                  ) -> Shape:
        """Bucketed (mode, T, R, L) of a step: DECODE stays DECODE, anything else runs as
        MIXED. Deterministic mode: the one shape of each kind, whatever the counts."""
        if kind == ForwardMode.TARGET_VERIFY and self.verify_tokens is None:
            raise ValueError("a TARGET_VERIFY step needs buckets built with verify_tokens")
        if self.deterministic:
            if kind not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
                kind = ForwardMode.MIXED
            return next(s for s in self.all_shapes() if s[0] == kind)
        if kind == ForwardMode.TARGET_VERIFY:
            r = pick_bucket(self.req_buckets, num_reqs)
            return kind, r * self.verify_tokens, r, r * self.verify_tokens
        ready = self.ready
        if kind == ForwardMode.DECODE:
            r = pick_bucket(self.req_buckets, num_reqs)
            if ready is None or (ForwardMode.DECODE, r, r, r) in ready:
                return ForwardMode.DECODE, r, r, r
        tokens = self.token_buckets if ready is None else tuple(
            sorted(s[1] for s in ready if s[0] == ForwardMode.MIXED))
        t = pick_bucket(tokens, num_tokens)
        r = pick_bucket(self.extend_req_buckets, max(num_reqs, num_rows, 1))
        return ForwardMode.MIXED, t, r, r
