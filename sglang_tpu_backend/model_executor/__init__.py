"""Turning scheduled requests into device steps: ForwardBatch, ModelRunner."""
