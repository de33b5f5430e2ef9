"""Ray Serve application (``serve run ray_app:app``): ingress, prefill and decode replicas.

The deployments arrive with their own issue; they will reuse the HTTP routes of
``sglang_tpu_backend.entrypoints.http_server`` and the engine API unchanged.
"""
