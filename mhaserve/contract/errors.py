"""Errors that are the user's input, not the program's fault. Torch-free: the command line catches them."""


class UsageError(ValueError):
    """Bad input from the command line or a file the user named. Its message is one line that names
    what was expected and what came; the command line prints it and exits with code 2."""


def json_kind(value) -> str:
    """What a decoded value is, in the words of JSON, which most clients write: a refusal names what came as its
    writer wrote it (an integer told apart from other numbers, as protobuf's parameters are)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)
