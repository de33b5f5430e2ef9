"""Speculative decoding: drafts, and their verification against the target model."""
