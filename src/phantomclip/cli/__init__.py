"""The command line: `phantomclip diagnose | train | experiment | trace | engines | report`, parsed and dispatched
(main), a job's config dataclass as flags (flags), and the settings a trainer's config file gives (sources). Bad input
ends in one line on stderr and exit code 2.

May import: every package.
"""

from .. import moved_names

__getattr__ = moved_names(__name__)
