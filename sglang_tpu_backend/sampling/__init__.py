"""Sampling parameters and the jitted sampler."""
