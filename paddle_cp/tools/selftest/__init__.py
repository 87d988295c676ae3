"""pcp-selftest (cli.py: the devices' attention and exchanges against one device) and its parts: the checks each
rank runs (checks.py) and the exchanges it times (exchanges.py)."""
