"""ktconvert.testing: tiny hub-layout checkpoints for tests and benchmarks (like numpy.testing / torch.testing).

Random-initialised transformers models written exactly as the hub ships them (BF16 or DeepSeek FP8, sharded with
an index, with a small byte-level BPE tokenizer); nothing is downloaded. `python -m ktconvert.testing ARCH OUT_DIR`
builds one from the command line.
"""
from ktconvert.testing.checkpoints import ARCHS, checkpoint_nbytes, make_checkpoint, make_config, make_model

__all__ = ["ARCHS", "checkpoint_nbytes", "make_checkpoint", "make_config", "make_model"]
