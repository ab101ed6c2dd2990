"""The one error type that commands raise; the CLI turns it into a one-line message."""


class FreeTokenError(Exception):
    """A user-facing failure: bad input, a missing file, an unsupported option.

    The message is one line that names the file, field or value at fault.
    """
