"""The mutation check is a command (``make mutation-check``), not part of the test run."""
collect_ignore_glob = ["*.py"]
