"""What is measured: the model (the bundled SmolLM2 dequantised once and cached, tiny-random, a local directory or
a hub id, loaded with fp32 master weights; load) and the prompts it is given (bundled, or a user's file; prompts).

May import: base.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
