"""Plain-text output shared by the command-line tools."""
import json
from pathlib import Path


def ruled_table(head, rows):
    """`head`, a rule as wide as it, then `rows`, one per line."""
    return "\n".join([head, "-" * len(head), *rows])


def show(table, result, json_path=None):
    """Print a tool's table; with `json_path` (its --json), also write the whole result there."""
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
