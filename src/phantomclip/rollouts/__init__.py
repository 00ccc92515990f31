"""The rollout record: the token ids a real engine sampled and the log-probs it gave them, as a user's run recorded
them (record, the format field by field), one reader per source that writes it (readers), and records packed as the
engines' own Rollouts (batches). Past this boundary nothing knows where the tokens came from.

May import: base, engines, routing.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
