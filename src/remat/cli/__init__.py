"""The command line: thin, parse -> one library call -> render; only here do errors become exit codes."""
