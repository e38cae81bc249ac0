"""``codeenv`` (and ``python -m codeenv``): the command line, or one line saying what it needs.

The command is installed with the client too (``pip install codeenv-rl``), which runs on Python
3.10+ and has none of the service's packages; there, and on an interpreter older than the service's
3.12, it says what to install instead of failing with a traceback.
"""

import sys

SERVICE_PYTHON = (3, 12)


def main() -> None:
    if sys.version_info < SERVICE_PYTHON:
        version = ".".join(map(str, sys.version_info[:3]))
        sys.exit(f"codeenv: the service and its command need Python >= 3.12 (this is {version}); "
                 "on this interpreter use the client (codeenv.client, codeenv.rl, codeenv.integrations)")
    try:
        import fastapi  # noqa: F401  (the service's packages, which a client-only install lacks)
        import typer  # noqa: F401
    except ImportError as exc:
        sys.exit(f"codeenv: this install has only the client ({exc.name} is missing); for the service: "
                 "pip install 'codeenv-rl[server]'")
    from codeenv.cli import main as cli

    cli()


if __name__ == "__main__":
    main()
