"""Request state, scheduling and request/response structs (plain Python)."""
