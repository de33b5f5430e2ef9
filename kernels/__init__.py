"""Pallas TPU kernels for Qwen3.5-MoE serving, each beside its pure-JAX reference.

Modules (one op each): ``ragged_paged_attention`` (a package: reference, K/V write, Pallas
kernel and XLA path in their own modules), ``gmm``, ``gdn`` (its Pallas kernels in
``gdn_kernels``, the math shared with the reference in ``gdn_common``; its speculative
verify mode in ``gdn_verify`` and ``gdn_verify_kernel``), ``routing``,
``collectives``; ``dispatch`` picks the implementation; ``cost`` holds the cost models;
``tpu_compile`` compiles any of them (or a whole step) for an Ironwood topology without a TPU.
"""
