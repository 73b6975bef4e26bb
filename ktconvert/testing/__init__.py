"""ktconvert.testing: tiny hub-layout checkpoints for tests and benchmarks (like numpy.testing / torch.testing).

Random-initialised transformers models written exactly as the hub ships them (BF16 or DeepSeek FP8, sharded with
an index, with a small byte-level BPE tokenizer); nothing is downloaded. One entry per family in `families.py`.
`python -m ktconvert.testing ARCH OUT_DIR` builds one from the command line.
"""
from ktconvert.testing.checkpoints import checkpoint_nbytes, make_checkpoint, make_config, make_model
from ktconvert.testing.families import ARCHS, FIXTURES

__all__ = ["ARCHS", "FIXTURES", "checkpoint_nbytes", "make_checkpoint", "make_config", "make_model"]
