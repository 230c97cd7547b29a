"""Errors that name the command-line flag: shared by the `kfit-ps` subcommands."""


def flag_error(parser, flag, value, fix):
    """Exits with usage and "FLAG: FIX Received: FLAG VALUE." (argparse's status 2)."""
    parser.error(f"{flag}: {fix} Received: {flag} {value!r}.")
