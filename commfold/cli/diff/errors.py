"""How `commfold diff` fails: one line for the user and an exit code."""

EXIT_OK, EXIT_RANK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class DiffError(Exception):
    """Bad input or a failed run: one line for the user, and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
