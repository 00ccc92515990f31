"""Expert routing of mixture-of-experts models: the routes a forward chooses, captured and replayed bit for bit
(routes), where flips start along the depth (depth), the training loop's side (train) and diagnose's route table
(text).

May import: base, precision, maths, engines.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
