"""``python -m asyncinfer ...`` and the ``asyncinfer`` console script: :func:`asyncinfer.cli.main`,
with Ctrl-C at any moment, imports included, ending in one line and exit status 130."""

import sys


def main() -> int:
    """The command (``sys.argv``), its module imported inside the guard: the package's own import
    is cheap (its names load on first use), so a Ctrl-C this early lands here, not in a traceback."""
    try:
        from asyncinfer._interrupts import deferred_interrupts

        with deferred_interrupts():
            from asyncinfer.cli import main as run
        return run()
    except KeyboardInterrupt:  # before cli.main's own guard (which ends the same way)
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
