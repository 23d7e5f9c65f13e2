"""One exception type for problems the user can fix; the CLI prints its message on one line."""


class AiaynError(Exception):
    """Bad input, flag, file or checkpoint. The message names what is wrong and what to do."""
