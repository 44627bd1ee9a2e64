"""Weights: update sessions, transports, disk-delta format, conversion, quantization."""
