"""Errors about the user's input (a flag, a file, a model): shown as one clear line, no traceback."""


class UserError(ValueError):
    pass
