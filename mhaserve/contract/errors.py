"""Errors that are the user's input, not the program's fault. Torch-free: the command line catches them."""


class UsageError(ValueError):
    """Bad input from the command line or a file the user named. Its message is one line that names
    what was expected and what came; the command line prints it and exits with code 2."""
