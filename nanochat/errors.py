"""
The errors a user can fix: a script prints them as one line, without a traceback (nanochat.cli), and names the flag
of a SettingError's setting.
"""


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file, ...). Scripts print it as one line, no traceback."""


def require(ok, message):
    """Raise UserError(message) unless ok: the validators' one check (not `assert`, which `python -O` drops)."""
    if not ok:
        raise UserError(message)


class SettingError(UserError):
    """A bad value of the setting `setting` (a function argument that the scripts take from the flag of the
    same name: device_type from --device-type). The message reads "<setting> <problem>"; nanochat.cli
    names the flag instead."""

    def __init__(self, setting, problem):
        super().__init__(f"{setting} {problem}")
        self.setting, self.problem = setting, problem
