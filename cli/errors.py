"""How the `goinfer` command fails: bad input is one line on stderr and exit code 2, never a
traceback or click's several lines of usage."""

from __future__ import annotations

import sys

import click

EXIT_BAD_INPUT = 2
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def fail(message: str) -> None:
    click.echo(f"goinfer: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (reported in one line), not a bug."""
    from goinfer.artifacts.giw import BundleError
    from goinfer.artifacts.zoo_store import StoreError
    from goinfer.compiler.build import BuildError
    from goinfer.compiler.sources.base import SourceError

    files = (FileNotFoundError, IsADirectoryError, PermissionError)
    return (BundleError, BuildError, SourceError, StoreError, *files)


class OneLineErrors(click.Group):
    """Usage errors as one line (click prints usage and help hints over several)."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("goinfer: aborted", err=True)
            sys.exit(1)
        except _NO_ARGS_IS_HELP as e:  # bare `goinfer`: the help text, as is
            click.echo(e.format_message(), err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as e:
            fail(e.format_message().replace("\n", " "))
        sys.exit(rv if isinstance(rv, int) else 0)
