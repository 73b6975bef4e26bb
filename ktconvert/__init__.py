"""ktconvert: turn huge Mixture-of-Experts checkpoints into CPU expert files and GPU layers."""
__version__ = "0.1.0"
