"""Pallas TPU kernels for Qwen3.5-MoE serving, each beside its pure-JAX reference.

Modules (one op each): ``ragged_paged_attention``, ``gmm``, ``gdn``, ``routing``,
``collectives``; ``dispatch`` picks the implementation; ``cost`` holds the cost models.
"""
