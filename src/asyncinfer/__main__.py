"""``python -m asyncinfer ...``: the same as the ``asyncinfer`` command."""

import sys

from asyncinfer.cli import main

sys.exit(main())
