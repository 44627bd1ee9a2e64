"""The rollout viewer (`miles-platform viewer`): a read-only web page over the catalog.
queries.py reads, tokens.py shades, pages.py renders, server.py serves. This module imports nothing:
the Dagster layer reads its constants to link partitions to the viewer."""

DEFAULT_PORT = 8700
# where Dagster runs: the base URL of a running viewer (http://127.0.0.1:8700); partitions link to it
VIEWER_URL_ENV = "MILES_VIEWER_URL"
