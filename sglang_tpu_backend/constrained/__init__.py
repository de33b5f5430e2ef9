"""Grammar-constrained decoding (regex / JSON schema) through llguidance."""
