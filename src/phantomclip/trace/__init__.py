"""Where β is born and why it grows: the error of a recipe against a reference site by site along the depth (depth,
job: `phantomclip trace`), the what-if recipes, and how β grows along a run's kept snapshots (growth: `trace --run`),
with what both print (text).

May import: base, precision, maths, models, engines, routing, runs.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
