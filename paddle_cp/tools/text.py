"""Plain-text output shared by the command-line tools."""


def ruled_table(head, rows):
    """`head`, a rule as wide as it, then `rows`, one per line."""
    return "\n".join([head, "-" * len(head), *rows])
