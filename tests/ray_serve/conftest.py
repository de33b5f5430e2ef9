"""Ray Serve's HTTP proxy on a loaded two-core CI machine.

Serve's controller gives a starting proxy 5 s per readiness check and kills it after three
misses. In a CI run of 2026-12-07 the proxy of ``test_multihost_app``'s cluster missed all
three while the other lane compiled beside it, and ``serve.start`` failed with the killed
actor. The controller reads the timeout from its environment, which the local Ray cluster
inherits from this process at ``ray.init``: every fixture here starts its cluster after this
module is imported."""

import os

os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
