"""ktrun.text: token ids <-> text. The tokenizer of a converted directory (tokenizer.json through `tokenizers`, special
tokens, the chat template), built-in chat templates for directories that carry none, and the one stop-string rule
(text_stream.py) that generate(), the Engine and the server all follow.
"""
from .text_stream import TextStream
from .tokenizer import Tokenizer, TokenizerError

__all__ = ["TextStream", "Tokenizer", "TokenizerError"]
