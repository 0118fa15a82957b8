"""The absl flags the command-line tools share (``train``, ``plan``), defined once.

absl keeps one registry of flags per process, so two modules that each defined ``--config``
could not be imported together (a notebook, a test that imports every module). Each tool imports
these and adds its own.
"""

from absl import flags
from ml_collections import config_flags

CONFIG = config_flags.DEFINE_config_file(
    "config", None, "A shipped config's name (quickstart, llada8b_gsm8k, ...) or the path of a "
    "get_config() file.", lock_config=True)
VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of an error (a bad config "
                            "value, a busy or mismatched workdir) instead of one line.")
