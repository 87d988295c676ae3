"""Plain-text output shared by the command-line tools."""
import argparse
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


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help: the description and epilog as written, and each option's default where it has one."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)
