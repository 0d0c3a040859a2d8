"""Errors a user can fix: printed as one line by the launcher, exit code 2, no traceback."""

import contextlib


class UserError(Exception):
    """A problem with the user's config, files or environment; the message names the key/file and the fix."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as `Type: message` on one line, cut to `limit` characters."""
    text = " ".join(str(e).split()) or "no details"
    return f"{type(e).__name__}: {text[:limit]}"


@contextlib.contextmanager
def reading(what: str, fix: str):
    """Where a user's file is opened and parsed: whatever the library raises becomes one line naming the file.

    Args:
        what: the key and/or file, e.g. "data.tokenizer=<dir>: tokenizer.json".
        fix: what the user can do about it.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's own error, whatever its type, is the message
        raise UserError(f"{what} cannot be read ({one_line(e)}); {fix}") from None
