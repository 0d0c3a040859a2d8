"""Errors a user can fix: printed as one line by the launcher, exit code 2, no traceback."""


class UserError(Exception):
    """A problem with the user's config, files or environment; the message names the key/file and the fix."""
