"""One lock for importing from transformers in the loaders' threads.

transformers' top-level names are lazy: the first ``from transformers import X`` of each name imports its
submodule, and two threads doing so at once failed one of them (``ImportError: cannot import name
'PreTrainedTokenizerBase' from 'transformers'``: two models loading at once, each in a thread of its own). Every
loader's import from transformers is made inside :func:`transformers_imports`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_LOCK = threading.RLock()


@contextmanager
def transformers_imports() -> Iterator[None]:
    """Within the block, this thread alone imports from transformers (through the loaders)."""
    with _LOCK:
        yield
