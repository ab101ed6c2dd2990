"""The one error type that commands raise; the CLI turns it into a one-line message."""


class FreeTokenError(Exception):
    """A user-facing failure: bad input, a missing file, an unsupported option.

    The message is one line that names the file, field or value at fault. `exit_code` is what the CLI
    exits with (1; 2 for a usage problem found before any work, such as a port already in use).
    """

    exit_code: int = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code
