"""Speculative decoding: drafts proposed on the host, verified by the target model in one
TARGET_VERIFY step (``model_executor/verify.py``).

  drafter.py  the ``Drafter`` protocol the scheduler asks for drafts, ``DraftGuard`` (the
              per-request back-off of both drafters while their drafts keep being
              rejected) and ``CallbackDrafter`` (drafts from a function: tests, experiments).
  registry.py ``make_drafter``: the drafter of ``--speculative-algorithm`` (above the
              drafters, so that none imports another).
  ngram.py    NGRAM: drafts copied from the request's own prompt + output after the longest
              earlier occurrence of its current suffix (no draft model).
  nextn.py    NEXTN / EAGLE: the drafts the model's MTP layers proposed on the device after
              the request's latest step (``model_executor/nextn_step.py``).
  rejection.py  acceptance on the device for every request: greedy rows by exact match with
              the argmax, drawn rows by speculative rejection sampling, both against the
              sampler's per-position target (penalties, logit bias, grammar mask); the
              verify step's sampler (``sample_verify_step``).
"""
