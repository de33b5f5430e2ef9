"""Ray Serve application: ``serve run ray_app:app [key=value ...]``.

An ingress with the standalone server's HTTP routes over engine replicas: colocated (one
engine deployment) or disaggregated (prefill replicas hand each request's KV pages and GDN
states to decode replicas). ``app`` is the application builder (``ray_app/app.py``).
"""

from ray_app.app import build_app as app

__all__ = ["app"]
