"""`python -m qstate_cli` and the `qstate` command (pyproject's script). The CLI imports torch
(~2 s): a Ctrl-C while it loads exits 130 with one line, as one during a command does (a
SIGTERM then takes its default action, which a shell reports as 143; once the command line
is parsed, cli/group.py turns SIGTERM into the same path as Ctrl-C, exit 143)."""
import sys


def main() -> None:
    try:
        from .cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("qstate: interrupted\n")
        raise SystemExit(130) from None
    cli()


if __name__ == "__main__":
    main()
