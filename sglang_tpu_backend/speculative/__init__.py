"""Speculative decoding: drafts proposed on the host, verified by the target model in one
TARGET_VERIFY step (``model_executor/verify.py``).

  drafter.py  the ``Drafter`` protocol the scheduler asks for drafts, ``make_drafter``
              (``--speculative-algorithm``) and ``CallbackDrafter`` (drafts from a function:
              tests, experiments).
  ngram.py    NGRAM: drafts copied from the request's own prompt + output after the longest
              earlier occurrence of its current suffix (no draft model).
  greedy.py   greedy acceptance on the device: the longest draft prefix the target's argmax
              agrees with, the next token, logprobs of every kept token.
  rejection.py  acceptance for sampled requests (speculative rejection sampling against the
              sampler's per-position target distribution).
"""
