"""One wgrad-return policy for fused and delayed weight gradients (not implemented yet)."""
