"""Exception type raised by fedgc's datasets, partitioners and models."""


class DataError(ValueError):
    """A dataset, partition scheme or model was asked for with a bad name, value or missing file.

    Subclasses :class:`ValueError` so callers that validate configuration generically still catch
    it; the message always names the offending value and what was expected.
    """
