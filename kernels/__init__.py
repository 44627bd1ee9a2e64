"""Compute kernels: xor delta, fp8/int4 (de)quantization, log-prob from logits.

Each has a torch reference; faster paths are used where the hardware has them.
"""
