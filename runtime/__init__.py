"""ktrun: load converted MoE checkpoints (mmap) and run them: CPU experts + GPU (or CPU) dense layers."""
__version__ = "0.1.0"
