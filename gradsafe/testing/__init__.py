"""Test utilities for users' own tests (CUDA-graph emulation: not implemented yet)."""
