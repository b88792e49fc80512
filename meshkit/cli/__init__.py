"""The command line: the only part of meshkit that prints or exits. It parses flags, calls the
ops, renders tables or JSON, and maps errors to exit codes (0 ok, 1 failed on some node, 2 usage
error, 130 interrupted)."""
