"""KV page and GDN state-slot allocators (plain Python)."""
