"""Dataset errors that say what is wrong and what to do, instead of a deep numpy traceback."""


class DatasetNotFoundError(FileNotFoundError):
    """The dataset files are not where they were looked for."""


class DatasetCorruptError(ValueError):
    """A dataset file exists but cannot be read (truncated, wrong format, bad header)."""
