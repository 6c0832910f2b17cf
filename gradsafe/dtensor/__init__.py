"""DTensor-aware layout contract for autograd gradients (not implemented yet)."""
